"""Backlot's job platform: @job, retry policies, the job ledger, dead letters, rate limits.

The names in ``__all__`` are the public API; a project imports them from ``jobs`` (and reads
``jobs.models``), nothing else. They load on first use (PEP 562), so ``import jobs`` works
before Django's app registry is ready (INSTALLED_APPS imports this package first).
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

# name -> the module that defines it
_EXPORTS = {
    "job": "jobs.decorators",
    "pause": "jobs.pausing",
    "resume": "jobs.pausing",
    "paused_queues": "jobs.pausing",
    "PlatformTask": "jobs.task",
    "cancel": "jobs.cancellation",
    "batch": "jobs.batches",
    "Batch": "jobs.batches",
    "BatchEnded": "jobs.batches",
    "current_batch": "jobs.batches",
    "Cancellation": "jobs.cancellation",
    "acting_as": "jobs.context",
    "AlreadyFinished": "jobs.exceptions",
    "JobCancelled": "jobs.exceptions",
    "LeaseLost": "jobs.exceptions",
    "RetryPolicy": "jobs.policies",
    "DEFAULT_POLICY": "jobs.policies",
    "DEFAULT_RETRY_ON": "jobs.policies",
    "Permanent": "jobs.policies",
    "Retryable": "jobs.policies",
    "BacklotError": "jobs.exceptions",
    "InvalidArguments": "jobs.exceptions",
    "InvalidPayload": "jobs.exceptions",
    "PayloadTooLarge": "jobs.exceptions",
    "ReplayError": "jobs.exceptions",
    "UnknownTask": "jobs.exceptions",
    "BrokerUnavailable": "jobs.exceptions",
    "effect_once": "jobs.effects",
    "effect_applied": "jobs.effects",
    "enqueue_many": "jobs.enqueue",
    "JobHandle": "jobs.enqueue",
    "dead_letter_replay": "jobs.deadletters",
    "dead_letter_replay_many": "jobs.deadletters",
    "dead_letter_discard": "jobs.deadletters",
    "dead_letter_discard_many": "jobs.deadletters",
    "events": "jobs.events",
    "http": "jobs.http",
    "mask_email": "jobs.masking",
    "mask_text": "jobs.masking",
    "mask_value": "jobs.masking",
    "json_problem": "jobs.payload",
    "OwnedQuerySet": "jobs.ownership",
    "ReadOnlyAdmin": "jobs.admin",
    "backlot_settings": "jobs.conf",
}

# names that are modules, not attributes of one
_MODULES = frozenset({"events", "http"})

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
    "UnknownTask",
    "acting_as",
    "backlot_settings",
    "batch",
    "cancel",
    "current_batch",
    "dead_letter_discard",
    "dead_letter_discard_many",
    "dead_letter_replay",
    "dead_letter_replay_many",
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
    from jobs import events, http
    from jobs.admin import ReadOnlyAdmin
    from jobs.batches import Batch, BatchEnded, batch, current_batch
    from jobs.cancellation import Cancellation, cancel
    from jobs.conf import backlot_settings
    from jobs.context import acting_as
    from jobs.deadletters import dead_letter_discard, dead_letter_discard_many, dead_letter_replay, dead_letter_replay_many
    from jobs.decorators import job
    from jobs.effects import effect_applied, effect_once
    from jobs.enqueue import JobHandle, enqueue_many
    from jobs.exceptions import AlreadyFinished, BacklotError, BrokerUnavailable, InvalidArguments, InvalidPayload, JobCancelled, LeaseLost, PayloadTooLarge, ReplayError, UnknownTask
    from jobs.masking import mask_email, mask_text, mask_value
    from jobs.ownership import OwnedQuerySet
    from jobs.pausing import pause, paused_queues, resume
    from jobs.payload import json_problem
    from jobs.policies import DEFAULT_POLICY, DEFAULT_RETRY_ON, Permanent, Retryable, RetryPolicy
    from jobs.task import PlatformTask
