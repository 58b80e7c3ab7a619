"""What a call may ask, checked before anything is written: its arguments against the job's
signature, its priority, queue and start; and which of its message options the ledger keeps
for the relay and for replays."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any

from django.utils import timezone

from jobs.core.conf import backlot_settings
from jobs.core.exceptions import InvalidArguments

logger = logging.getLogger(__name__)

# Message options that tie a job into a canvas; kept on the ledger row so a relayed job keeps them.
CANVAS_OPTIONS = frozenset(
    {"link", "link_error", "chain", "chord", "group_id", "group_index", "root_id", "parent_id"}
)
# Per-call time limits (apply_async(time_limit=..., soft_time_limit=...)), kept on the row too:
# a relayed or retried job runs under the limits it was sent with, not the task's defaults.
LIMIT_OPTIONS = frozenset({"time_limit", "soft_time_limit"})
# Celery options a relayed message must keep: an absolute expiry (PlatformTask.apply_async
# turns a relative one into a time), custom headers and stamps, ignore_result, and the caller's
# own readable copies of the arguments (argsrepr/kwargsrepr: Celery's way to hide a secret).
CELERY_OPTIONS = frozenset(
    {"expires", "headers", "stamped_headers", "ignore_result", "argsrepr", "kwargsrepr"}
)
STORED_OPTIONS = CANVAS_OPTIONS | LIMIT_OPTIONS | CELERY_OPTIONS


def check_priority(priority: int) -> int:
    if not isinstance(priority, int) or isinstance(priority, bool) or not 0 <= priority <= 9:
        raise ValueError(
            f"priority must be an integer from 0 (lowest) to 9 (highest), got {priority!r}"
        )
    return priority


def check_queue(queue: str) -> str:
    queues = backlot_settings().QUEUES
    if queue not in queues:
        raise ValueError(f"Unknown queue {queue!r}; configured: {', '.join(queues)}")
    return queue


def check_arguments(task: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
    """Raise InvalidArguments (a TypeError), naming the job, when the arguments do not fit its
    function's signature; called before anything is written, so a mistyped call leaves no row.

    Celery's own check (Task.typing, the task's ``__header__`` stub with the function's
    signature) runs only inside apply_async, after the ledger row is written: that row would
    fail every publish. A task declared typing=False (``@job(typing=False)``) is not checked.
    """
    header = getattr(task, "__header__", None)
    if header is None or not getattr(task, "typing", True):
        return
    try:
        header(*args, **kwargs)
    except TypeError as exc:
        raise InvalidArguments(f"{task.name}: {exc}; nothing was enqueued") from None


def arguments_checker(task: Any) -> Callable[[Sequence[Any], Mapping[str, Any]], None]:
    """check_arguments for many calls of one task, binding the signature once per shape.

    Whether arguments bind to a signature (and the TypeError's text) depends only on how
    many are positional and on the keyword names in their order, not on the values: calls of
    one shape get the first one's verdict. A bulk replay's 10,000 rows share a shape or two.
    Arguments that are not a list or tuple and a dict (a hand-edited row) are checked alone."""
    verdicts: dict[tuple[int, tuple[Any, ...]], str | None] = {}

    def check(args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
        if type(args) not in (list, tuple) or type(kwargs) is not dict:
            check_arguments(task, args, kwargs)
            return
        shape = (len(args), tuple(kwargs))
        try:
            refused = verdicts[shape]
        except KeyError:
            try:
                check_arguments(task, args, kwargs)
                refused = None
            except InvalidArguments as exc:
                refused = str(exc)
            verdicts[shape] = refused
        if refused is not None:
            raise InvalidArguments(refused)

    return check


def resolve_start(delay: float | None, eta: datetime | None, now: datetime) -> datetime | None:
    if delay is not None and eta is not None:
        raise ValueError("pass either delay or eta, not both")
    if delay is not None:
        if delay < 0:
            raise ValueError(f"delay must be >= 0 seconds, got {delay!r}")
        return now + timedelta(seconds=delay) if delay > 0 else None
    if eta is not None:
        if timezone.is_naive(eta):
            raise ValueError("eta must be timezone-aware")
        return eta if eta > now else None
    return None


def replay_options(options: Mapping[str, Any] | None) -> dict[str, Any]:
    """What a replay of a job keeps of its message options: the per-call time limits and the
    custom headers (not its canvas links: a replay is a job of its own)."""
    return {k: v for k, v in (options or {}).items() if k in LIMIT_OPTIONS or k == "headers"}


def storable_options(options: Mapping[str, Any] | None) -> dict[str, Any]:
    """Message options worth keeping in the ledger for the relay (canvas links, per-call time
    limits, Celery's expiry, headers and stamps), as JSON."""
    options = options or {}
    # A stamp rides as an option named by stamped_headers (Celery's stamping visitors).
    names = STORED_OPTIONS | set(options.get("stamped_headers") or ())
    kept = {k: v for k, v in options.items() if k in names and v is not None}
    if not kept:
        return {}  # most enqueues: no JSON round trip of nothing
    try:
        return json.loads(json.dumps(kept))
    except (TypeError, ValueError):
        logger.warning(
            "Canvas options of a job are not JSON; the relay would re-send it without them"
        )
        return {}
