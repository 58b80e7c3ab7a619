"""The job page's timeline of attempts (jobs.web.views.attempt_timeline): a job that failed
twice and then succeeded on a real worker shows three attempts, the failed ones with their
start, end, worker, error class and message and retry delay, the last with its start, end and
outcome."""

from __future__ import annotations

import re
from typing import Any

import pytest

from jobs.models import Job, JobState
from tests.conftest import wait_until
from tests.support import tasks


@pytest.fixture
def owner(django_user_model: Any) -> Any:
    return django_user_model.objects.create_user("timeline-owner", password="not-used")


def test_the_job_page_shows_each_attempt(worker, client, owner, unique):
    handle = tasks.flaky.using(owner=owner).enqueue(unique, 2)
    wait_until(
        lambda: Job.objects.get(id=handle.id).state == JobState.SUCCEEDED,
        timeout=60,
        what="the flaky job to succeed on its third attempt",
    )
    client.force_login(owner)

    page = client.get(f"/jobs/{handle.id}/").content.decode()

    timeline = page[page.index('<table id="timeline">') : page.index("</table>")]
    rows = re.findall(r'<tr data-attempt="(\d+)">(.*?)</tr>', timeline, re.S)
    assert [number for number, _ in rows] == ["1", "2", "3"]
    for _, cells in rows[:2]:
        assert ">failed<" in cells and "<code>" in cells
        # each failed attempt: its start and end, the worker that ran it, the retry's delay
        assert cells.count("<time") >= 2
        worker = re.search(r'data-field="worker">([^<]*)<', cells)
        assert worker is not None and "@" in worker.group(1)  # Celery's node name
        assert re.search(r'data-field="retry-in">after [\d.]+ s<', cells)
    last = rows[2][1]
    assert ">succeeded<" in last and last.count("<time") == 2  # started and ended
