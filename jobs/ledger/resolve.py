"""Writes that resolve dead letters: replayed (one, or many in one UPDATE) or discarded."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from django.db.models import OuterRef, Subquery
from django.utils import timezone

from jobs.core.states import DeadLetterStatus
from jobs.ledger import batch
from jobs.ledger.steps import steps_copied
from jobs.models import DeadLetter, Job

logger = logging.getLogger(__name__)


def _user(by: Any) -> Any:
    return by if getattr(by, "pk", None) else None


# --- dead letters: replayed or discarded --------------------------------------------------
def dead_letter_replayed(*, dead_letter: DeadLetter, job_id: str | None, by: Any = None) -> None:
    """From dead to replayed: the dead letter points at its new job (locked by the caller)."""
    if job_id is not None:
        Job.objects.filter(id=job_id).update(replay_of=dead_letter)
        batch.member_replayed(dead_letter=dead_letter, job_id=job_id)
        # its finished steps are not run again (jobs.worker.steps)
        steps_copied(pairs=[(dead_letter.job_id_value, job_id)])
    DeadLetter.objects.filter(pk=dead_letter.pk, status=DeadLetterStatus.DEAD).update(
        status=DeadLetterStatus.REPLAYED,
        replayed_job_id=job_id,
        resolved_at=timezone.now(),
        resolved_by=_user(by),
    )


def dead_letters_replayed(*, pks: Sequence[int], by: Any = None) -> int:
    """From dead to replayed for many rows in one UPDATE; each row's new job is the newest
    job whose replay_of points at it."""
    batch.members_replayed(pks=pks)
    steps_copied(  # each new job keeps its dead job's finished steps (jobs.worker.steps)
        pairs=Job.objects.filter(replay_of_id__in=pks).values_list("replay_of__job_id_value", "id")
    )
    return DeadLetter.objects.filter(pk__in=pks, status=DeadLetterStatus.DEAD).update(
        status=DeadLetterStatus.REPLAYED,
        replayed_job_id=Subquery(
            Job.objects.filter(replay_of_id=OuterRef("pk"))
            .order_by("-enqueued_at")
            .values("id")[:1]
        ),
        resolved_at=timezone.now(),
        resolved_by=_user(by),
    )


def dead_letters_discarded(*, queryset: Any, by: Any = None) -> int:
    """From dead to discarded: an operator decided these will not run."""
    return queryset.filter(status=DeadLetterStatus.DEAD).update(
        status=DeadLetterStatus.DISCARDED, resolved_at=timezone.now(), resolved_by=_user(by)
    )
