"""Dead letters: replay (one, or many in bulk), discard, and the audit record of operator
actions. A replay is a new job linked to its dead letter, with the original queue, owner and
priority; the dead letter's row is locked first, so two operators replaying at once make one
new job.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from django.contrib.auth import get_user_model
from django.db import transaction

from jobs import ledger
from jobs.broker.broker import BULK_BATCH
from jobs.core import context, events
from jobs.core.exceptions import InvalidArguments, ReplayError, UnknownTask
from jobs.core.options import arguments_checker, replay_options
from jobs.enqueue.fanout import enqueue_many
from jobs.enqueue.submit import JobHandle, enqueue
from jobs.ledger import batch as batch_ledger
from jobs.models import AuditEntry, DeadLetter, DeadLetterStatus
from jobs.worker.registry import task_by_name

logger = logging.getLogger(__name__)


def dead_letter_replay(
    *,
    dead_letter: DeadLetter,
    by: Any = None,
    args: Sequence[Any] | None = None,
    kwargs: Mapping[str, Any] | None = None,
) -> JobHandle:
    """Send a dead letter's job again as a new job, linked to it; the row is marked replayed.

    `args`/`kwargs` replace the original arguments (an operator fixed them); the new job keeps
    the original queue, priority and owner.
    """
    with transaction.atomic():
        row = DeadLetter.objects.select_for_update().get(pk=dead_letter.pk)
        if row.status != DeadLetterStatus.DEAD:
            raise ReplayError(
                f"Dead letter {row.pk} is already {row.status}; it cannot be replayed"
            )
        task = task_by_name(row.task_name)
        handle = enqueue(
            task=task,
            args=row.args if args is None else args,
            kwargs=row.kwargs if kwargs is None else kwargs,
            priority=row.priority,
            owner=row.owner,
            queue=row.queue,
            # the per-call time limits and headers it was sent with (jobs.enqueue.submit)
            publish_options=replay_options(row.job.publish_options) if row.job else None,
            detached=True,
            # in the trace of the job that died (jobs.core.tracing), linked to the operator's
            trace_parent=row.job.trace_context if row.job is not None else None,
        )
        ledger.dead_letter_replayed(
            dead_letter=row, job_id=handle.id if task.track else None, by=by
        )
        _announce([handle.id], [row.pk], by, row.task_name)
    dead_letter.refresh_from_db()
    return handle


@dataclass
class BulkOutcome:
    """What a bulk replay or discard did."""

    done: int = 0
    skipped: int = 0  # already replayed/discarded, or locked by a concurrent operator
    errors: list[str] = field(default_factory=list)
    job_ids: list[str] = field(default_factory=list)  # a replay's new jobs


def dead_letter_replay_many(
    *,
    queryset: Any,
    by: Any = None,
    progress: Callable[[int, int, str], None] | None = None,
    limit: int | None = None,
    batch: Any = None,
) -> BulkOutcome:
    """Replay every unresolved dead letter in `queryset`, 1,000 per transaction.

    Each chunk locks its rows (skipping ones another operator holds), enqueues the new jobs
    in bulk (one COPY, one pipelined publish) and marks the rows replayed in one UPDATE: 10,000
    rows take a few seconds, not 10,000 round trips.

    With `batch` (an id), each chunk's replays join that batch in the chunk's transaction: its
    counters are the bulk replay's progress (the caller keeps it open, e.g. by being a member).
    A replay of a dead batch member goes back to that member's batch instead (jobs.flow.batches).
    """
    outcome = BulkOutcome()
    owner_model = get_user_model()  # DeadLetter.owner's
    ids = list(
        queryset.filter(status=DeadLetterStatus.DEAD)
        .order_by("pk")
        .values_list("pk", flat=True)[:limit]
    )
    for start in range(0, len(ids), BULK_BATCH):
        chunk = ids[start : start + BULK_BATCH]
        with transaction.atomic():
            rows = ledger.dead_letters_to_replay(pks=chunk)
            outcome.skipped += len(chunk) - len(rows)
            joining = context.JoiningBatch(str(batch)) if batch else context.joining_batch()
            # One bulk enqueue per task, priority, queue and owner: each replay keeps all four.
            groups: dict[tuple[str, int, str, int | None, bool], list[ledger.DeadToReplay]] = {}
            for row in rows:
                key = (
                    row.task_name,
                    row.priority,
                    row.queue,
                    row.owner_id,
                    row.batch_id is not None,
                )
                groups.setdefault(key, []).append(row)
            replayed: list[ledger.Replayed] = []
            for (task_name, priority, queue, owner_id, member), grouped in groups.items():
                try:
                    task = task_by_name(task_name)
                except UnknownTask as exc:
                    outcome.errors.append(str(exc))
                    outcome.skipped += len(grouped)
                    continue
                group = _fitting(task, grouped, outcome)
                if not group:
                    continue
                # a dead batch member's replay goes back to its own batch (ledger.batch)
                with context.joining(None if member else joining):
                    job_ids = enqueue_many(
                        task,
                        [(row.args, row.kwargs) for row in group],
                        priority=priority,
                        # enqueue_many reads only the owner's pk: no query for the user
                        owner=owner_model(pk=owner_id) if owner_id is not None else None,
                        queue=queue,
                        replay_of=[row.pk for row in group],
                        detached=True,
                    )
                tracked = task.track
                replayed += [
                    ledger.Replayed(
                        row.pk,
                        job_id if tracked else None,
                        row.steps_from if tracked else None,
                        row.batch_id,
                    )
                    for row, job_id in zip(group, job_ids, strict=True)
                ]
                outcome.job_ids += job_ids
                _announce(job_ids, [row.pk for row in group], by, task_name)
            added = joining.added if batch and joining is not None else 0
            if added and not batch_ledger.members_added(batch_id=batch, waiting=added):
                raise ReplayError(f"Batch {batch} has ended; these replays were not sent")
            ledger.dead_letters_replayed(replays=replayed, by=by)
            outcome.done += len(replayed)
        if progress:
            progress(min(start + BULK_BATCH, len(ids)), len(ids), f"{outcome.done} replayed")
    return outcome


def _fitting(
    task: Any, group: list[ledger.DeadToReplay], outcome: BulkOutcome
) -> list[ledger.DeadToReplay]:
    """The dead letters whose arguments fit the job's signature; the others are skipped with
    the reason (replay them one by one with fixed arguments), not the whole bulk replay."""
    fitting = []
    check = arguments_checker(task)
    for row in group:
        try:
            check(row.args, row.kwargs)
        except InvalidArguments as exc:
            outcome.errors.append(f"dead letter {row.pk}: {exc}")
            outcome.skipped += 1
        else:
            fitting.append(row)
    return fitting


def _announce(job_ids: list[str], dead_letter_ids: list[int], by: Any, task: str) -> None:
    def send() -> None:
        events.send(
            events.job_replayed, task=task, job_ids=job_ids, dead_letter_ids=dead_letter_ids, by=by
        )

    transaction.on_commit(send)


def dead_letter_discard(*, dead_letter: DeadLetter, by: Any = None) -> bool:
    """Discard one dead letter (it will not run); False when it was already resolved."""
    return bool(
        ledger.dead_letters_discarded(queryset=DeadLetter.objects.filter(pk=dead_letter.pk), by=by)
    )


def dead_letter_discard_many(*, queryset: Any, by: Any = None) -> int:
    return ledger.dead_letters_discarded(queryset=queryset, by=by)


def audit(*, user: Any, action: str, count: int, **detail: Any) -> None:
    """Record an operator action (who, what, how many)."""
    AuditEntry.objects.create(
        user=user if getattr(user, "pk", None) else None, action=action, count=count, detail=detail
    )
    logger.info(
        "Operator action %s on %s row(s) by user %s", action, count, getattr(user, "pk", None)
    )
