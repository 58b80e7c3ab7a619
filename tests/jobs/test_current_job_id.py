"""jobs.current_job_id(): the job's id inside its hooks, in the process that calls them (here
the canceller's: a waiting job cancelled runs its on_cancelled hook after the commit), and
None outside any job."""

from __future__ import annotations

from typing import Any

import pytest

import jobs
from jobs import cancel, job
from jobs.models import Job, JobState

seen: list[tuple[str | None, tuple, dict]] = []


def _cancelled(args: tuple, kwargs: dict) -> None:
    seen.append((jobs.current_job_id(), args, kwargs))


@job(name="tests.current_job_id.probe", on_cancelled=_cancelled)
def probe(n: int) -> int:
    return n


@pytest.mark.django_db(transaction=True)
def test_a_hook_run_by_the_canceller_names_its_job(clean_redis: Any) -> None:
    seen.clear()
    first = probe.using(delay=600).enqueue(1)
    second = probe.using(delay=600).enqueue(2)

    assert jobs.current_job_id() is None  # outside any job
    cancel(second.id)
    cancel(first.id)

    assert seen == [(second.id, (2,), {}), (first.id, (1,), {})]
    assert jobs.current_job_id() is None  # the hook's context ended with it
    assert set(
        Job.objects.filter(id__in=[first.id, second.id]).values_list("state", flat=True)
    ) == {JobState.CANCELLED}
