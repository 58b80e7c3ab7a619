"""Case 6: replaying 10,000 dead letters through the bulk path operators use
(jobs.flow.deadletters.dead_letter_replay_many, behind the admin's "replay" action)."""

from __future__ import annotations

import uuid

from django.db import connection
from django.utils import timezone

from benchmarks import jobs as bench
from benchmarks.harness import CaseResult, clock, empty_queues, queued
from benchmarks.sizes import SIZES
from jobs import dead_letter_replay_many
from jobs.models import DeadLetter, DeadLetterStatus


def make_dead_letters(count: int, marker: str) -> None:
    now = timezone.now()
    rows = [
        DeadLetter(
            job_id_value=uuid.uuid4(),
            task_name=bench.noop.name,
            args=[i],
            kwargs={},
            queue="default",
            priority=5,
            attempts=3,
            exception_class="ConnectionError",
            exception_message=marker,
            traceback="Traceback (most recent call last): ...",
            first_failed_at=now,
            last_failed_at=now,
            status=DeadLetterStatus.DEAD,
        )
        for i in range(count)
    ]
    DeadLetter.objects.bulk_create(rows, batch_size=1000)


def run(*, full: bool = False) -> CaseResult:
    size = SIZES["deadletters"]
    count = size.count(full)
    result = CaseResult(
        case="deadletters",
        title="6. Dead letters: bulk replay (dead_letter_replay_many), PostgreSQL",
        params={"dead_letters_per_round": count, "rounds": size.repeats},
    )
    if count != size.issue:
        result.notes.append(f"scaled: {count:,} dead letters instead of {size.issue:,}")
    seconds: list[float] = []
    for _ in range(size.repeats):
        empty_queues()
        marker = f"bench {uuid.uuid4().hex}"
        make_dead_letters(count, marker)
        connection.close()
        started = clock()
        outcome = dead_letter_replay_many(
            queryset=DeadLetter.objects.filter(exception_message=marker)
        )
        seconds.append(clock() - started)
        if outcome.done != count or queued() != count:
            raise AssertionError(f"replayed {outcome.done}, queued {queued()}, expected {count}")
        connection.close()
    empty_queues()
    result.figure(
        "replay seconds",
        seconds,
        "s",
        higher_is_better=False,
        what=f"{count:,} dead letters -> new jobs (ledger rows + messages) + rows marked replayed",
    )
    result.figure("replay rate", [count / s for s in seconds], "jobs/s")
    scaled = result.figures["replay seconds"]["median"] * (size.issue / count)
    result.target("10,000 dead-letter replays (s)", scaled, "<= 5 s", scaled <= 5)
    rate = result.figures["replay rate"]["median"]
    result.target("dead-letter bulk replay, jobs/s", rate, ">= 20,000", rate >= 20_000)
    return result
