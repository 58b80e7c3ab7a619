"""The module paths of Backlot before jobs/ was split into layers (core, broker, enqueue, worker,
flow, web), kept importable for one release: ``import jobs.celery`` or
``MIDDLEWARE = ["jobs.middleware.ActingAsMiddleware"]`` in a host project still work, with a
DeprecationWarning naming the new path. The old name is the same module object as the new one
(a patch through either is seen through both). jobs.broker and jobs.enqueue are packages now
(their modules are jobs.broker.broker and jobs.enqueue.submit): no host project named them.

Imports nothing of jobs/; installed once by jobs/__init__.py.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

# old module (under jobs.) -> where it lives now
MOVED = {
    "alerts": "jobs.web.alerts",
    "api": "jobs.web.api",
    "api_batches": "jobs.web.api_batches",
    "api_queues": "jobs.web.api_queues",
    "backends": "jobs.flow.backends",
    "batches": "jobs.flow.batches",
    "beat": "jobs.flow.beat",
    "cancellation": "jobs.flow.cancellation",
    "celery": "jobs.worker.celery",
    "celery_task": "jobs.worker.celery_task",
    "checks": "jobs.web.checks",
    "concurrency": "jobs.broker.concurrency",
    "conf": "jobs.core.conf",
    "context": "jobs.core.context",
    "counters": "jobs.broker.counters",
    "dashboard": "jobs.web.dashboard",
    "deadletters": "jobs.flow.deadletters",
    "decorators": "jobs.worker.decorators",
    "effects": "jobs.worker.effects",
    "errors": "jobs.web.errors",
    "events": "jobs.core.events",
    "exceptions": "jobs.core.exceptions",
    "execution": "jobs.worker.execution",
    "fetch": "jobs.broker.fetch",
    "fire_times": "jobs.core.fire_times",
    "forms": "jobs.web.forms",
    "gate_scripts": "jobs.broker.gate_scripts",
    "http": "jobs.core.http",
    "lease": "jobs.worker.lease",
    "masking": "jobs.core.masking",
    "metrics": "jobs.web.metrics",
    "middleware": "jobs.web.middleware",
    "monitoring": "jobs.web.monitoring",
    "options": "jobs.core.options",
    "outcomes": "jobs.worker.outcomes",
    "ownership": "jobs.core.ownership",
    "pausing": "jobs.broker.pausing",
    "payload": "jobs.core.payload",
    "policies": "jobs.core.policies",
    "progress": "jobs.worker.progress",
    "ratelimit": "jobs.broker.ratelimit",
    "redelivery": "jobs.worker.redelivery",
    "redis": "jobs.broker.redis",
    "registry": "jobs.worker.registry",
    "relay": "jobs.flow.relay",
    "request": "jobs.worker.request",
    "reservations": "jobs.broker.reservations",
    "restore": "jobs.broker.restore",
    "results": "jobs.worker.results",
    "retention": "jobs.flow.retention",
    "signals": "jobs.worker.signals",
    "slots": "jobs.broker.slots",
    "states": "jobs.core.states",
    "task": "jobs.worker.task",
    "telemetry": "jobs.worker.telemetry",
    "timers": "jobs.broker.timers",
    "tracing": "jobs.core.tracing",
    "urls": "jobs.web.urls",
    "views": "jobs.web.views",
}


class _Alias(importlib.abc.Loader):
    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        warnings.warn(
            f"{spec.name} moved to {self.target}; the old path goes away in the next release",
            DeprecationWarning,
            stacklevel=2,
        )
        return importlib.import_module(self.target)

    def exec_module(self, module: ModuleType) -> None:
        """The module is the new one, already executed."""


class _MovedFinder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        prefix, _, name = fullname.partition(".")
        if prefix != "jobs" or name not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, _Alias(MOVED[name]))


def install() -> None:
    """Put the finder on sys.meta_path once (before the path finder: the old files are gone)."""
    if not any(isinstance(finder, _MovedFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _MovedFinder())
