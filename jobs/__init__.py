"""Backlot's job platform: @job, retry policies, the job ledger, dead letters, rate limits.

The names in ``__all__`` are the public API; a project imports them from ``jobs`` (and reads
``jobs.models``), nothing else. They load on first use (PEP 562), so ``import jobs`` works
before Django's app registry is ready (INSTALLED_APPS imports this package first).
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from jobs import _moved

_moved.install()  # the module paths from before the layers (jobs.celery, ...) for one release

# name -> the module that defines it
_EXPORTS = {
    "job": "jobs.worker.decorators",
    "pause": "jobs.broker.pausing",
    "resume": "jobs.broker.pausing",
    "paused_queues": "jobs.broker.pausing",
    "PlatformTask": "jobs.worker.task",
    "cancel": "jobs.flow.cancellation",
    "batch": "jobs.flow.batches",
    "Batch": "jobs.flow.batches",
    "BatchEnded": "jobs.flow.batches",
    "current_batch": "jobs.flow.batches",
    "Cancellation": "jobs.flow.cancellation",
    "acting_as": "jobs.core.context",
    "current_job_id": "jobs.core.context",
    "AlreadyFinished": "jobs.core.exceptions",
    "JobCancelled": "jobs.core.exceptions",
    "LeaseLost": "jobs.core.exceptions",
    "StepOrderChanged": "jobs.core.exceptions",
    "StepResultTooLarge": "jobs.core.exceptions",
    "StepTimeout": "jobs.core.exceptions",
    "SignalRefused": "jobs.core.exceptions",
    "signal": "jobs.flow.signals",
    "RetryPolicy": "jobs.core.policies",
    "DEFAULT_POLICY": "jobs.core.policies",
    "DEFAULT_RETRY_ON": "jobs.core.policies",
    "Permanent": "jobs.core.policies",
    "Retryable": "jobs.core.policies",
    "BacklotError": "jobs.core.exceptions",
    "InvalidArguments": "jobs.core.exceptions",
    "InvalidPayload": "jobs.core.exceptions",
    "PayloadTooLarge": "jobs.core.exceptions",
    "ReplayError": "jobs.core.exceptions",
    "UnknownTask": "jobs.core.exceptions",
    "BrokerUnavailable": "jobs.core.exceptions",
    "effect_once": "jobs.worker.effects",
    "effect_applied": "jobs.worker.effects",
    "enqueue_many": "jobs.enqueue.fanout",
    "JobHandle": "jobs.enqueue.submit",
    "dead_letter_replay": "jobs.flow.deadletters",
    "dead_letter_replay_many": "jobs.flow.deadletters",
    "dead_letter_discard": "jobs.flow.deadletters",
    "dead_letter_discard_many": "jobs.flow.deadletters",
    "events": "jobs.core.events",
    "http": "jobs.core.http",
    "mask_email": "jobs.core.masking",
    "mask_text": "jobs.core.masking",
    "mask_value": "jobs.core.masking",
    "json_problem": "jobs.core.payload",
    "OwnedQuerySet": "jobs.core.ownership",
    "ReadOnlyAdmin": "jobs.admin",
    "backlot_settings": "jobs.core.conf",
    "throttle": "jobs.web.throttle",
    "describe_jobs": "jobs.web.descriptions",
    "JobDescription": "jobs.web.descriptions",
}

# names that are modules, not attributes of one
_MODULES = frozenset({"events", "http", "throttle"})

__all__ = [
    "DEFAULT_POLICY",
    "DEFAULT_RETRY_ON",
    "AlreadyFinished",
    "BacklotError",
    "Batch",
    "BatchEnded",
    "BrokerUnavailable",
    "Cancellation",
    "InvalidArguments",
    "InvalidPayload",
    "JobCancelled",
    "JobDescription",
    "JobHandle",
    "LeaseLost",
    "OwnedQuerySet",
    "PayloadTooLarge",
    "Permanent",
    "PlatformTask",
    "ReadOnlyAdmin",
    "ReplayError",
    "RetryPolicy",
    "Retryable",
    "SignalRefused",
    "StepOrderChanged",
    "StepResultTooLarge",
    "StepTimeout",
    "UnknownTask",
    "acting_as",
    "backlot_settings",
    "batch",
    "cancel",
    "current_batch",
    "current_job_id",
    "dead_letter_discard",
    "dead_letter_discard_many",
    "dead_letter_replay",
    "dead_letter_replay_many",
    "describe_jobs",
    "effect_applied",
    "effect_once",
    "enqueue_many",
    "events",
    "http",
    "job",
    "json_problem",
    "mask_email",
    "mask_text",
    "mask_value",
    "pause",
    "paused_queues",
    "resume",
    "signal",
    "throttle",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'jobs' has no attribute {name!r}")
    value = import_module(module) if name in _MODULES else getattr(import_module(module), name)
    globals()[name] = value  # later reads skip this function
    return value


def __dir__() -> list[str]:
    return __all__


if TYPE_CHECKING:
    from jobs.admin import ReadOnlyAdmin
    from jobs.broker.pausing import pause, paused_queues, resume
    from jobs.core import events, http
    from jobs.core.conf import backlot_settings
    from jobs.core.context import acting_as, current_job_id
    from jobs.core.exceptions import (
        AlreadyFinished,
        BacklotError,
        BrokerUnavailable,
        InvalidArguments,
        InvalidPayload,
        JobCancelled,
        LeaseLost,
        PayloadTooLarge,
        ReplayError,
        SignalRefused,
        StepOrderChanged,
        StepResultTooLarge,
        StepTimeout,
        UnknownTask,
    )
    from jobs.core.masking import mask_email, mask_text, mask_value
    from jobs.core.ownership import OwnedQuerySet
    from jobs.core.payload import json_problem
    from jobs.core.policies import (
        DEFAULT_POLICY,
        DEFAULT_RETRY_ON,
        Permanent,
        Retryable,
        RetryPolicy,
    )
    from jobs.enqueue.fanout import enqueue_many
    from jobs.enqueue.submit import JobHandle
    from jobs.flow.batches import Batch, BatchEnded, batch, current_batch
    from jobs.flow.cancellation import Cancellation, cancel
    from jobs.flow.deadletters import (
        dead_letter_discard,
        dead_letter_discard_many,
        dead_letter_replay,
        dead_letter_replay_many,
    )
    from jobs.flow.signals import signal
    from jobs.web import throttle
    from jobs.web.descriptions import JobDescription, describe_jobs
    from jobs.worker.decorators import job
    from jobs.worker.effects import effect_applied, effect_once
    from jobs.worker.task import PlatformTask
