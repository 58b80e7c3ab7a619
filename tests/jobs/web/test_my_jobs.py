"""'My jobs' as what the user did (issue 25 item 6): a fan-out under its parent (a small one job
by job, a large one counted by kind and state), each job named by the app that registered a
describer (jobs.describe_jobs) with a link to its object's page, filters (state, kind, since),
pages over the list API's cursor, and a bounded number of queries whatever the page holds.
The same documents through GET /api/jobs/ (top_level, kind, children)."""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator, Sequence
from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from jobs import JobDescription, describe_jobs
from jobs.ledger import NewRow, insert_many
from jobs.models import Job, JobState
from jobs.web import descriptions
from jobs.web.listing import listed_jobs

pytestmark = pytest.mark.django_db

NOW = timezone.now().replace(microsecond=0)


def make_job(owner: Any, minutes_ago: float, **fields: Any) -> Job:
    fields.setdefault("task_name", "tests.add")
    fields.setdefault("queue", "default")
    return Job.objects.create(
        owner=owner, enqueued_at=NOW - timedelta(minutes=minutes_ago), **fields
    )


@pytest.fixture
def alice() -> Any:
    return get_user_model().objects.create_user("alice", password="pw-alice-123")


@pytest.fixture
def registry() -> Iterator[None]:
    """The apps' registrations, restored after a test that adds its own."""
    saved = dict(descriptions._registry)
    yield
    descriptions._registry.clear()
    descriptions._registry.update(saved)


def rows(html: str) -> list[str]:
    """The job ids of the page's top-level rows, in order."""
    return re.findall(r'<tr class="job[^"]*" data-job-id="([0-9a-f-]{36})"', html)


def fan_out(owner: Any, minutes_ago: float, children: int, **fields: Any) -> Job:
    """A succeeded parent and `children` jobs it started: the first 2 running, the rest done."""
    parent = make_job(owner, minutes_ago, task_name="tests.fan", state=JobState.SUCCEEDED, **fields)
    for n in range(children):
        make_job(
            owner,
            minutes_ago - 0.001 * (n + 1),  # oldest first
            parent=parent,
            task_name="tests.child",
            state=JobState.RUNNING if n < 2 else JobState.SUCCEEDED,
            args=[n],
        )
    return parent


def test_a_fan_out_sits_under_its_parent(client: Any, alice: Any) -> None:
    # given: a campaign-like fan-out of 30 and a video-like one of 3, and a job on its own
    large = fan_out(alice, minutes_ago=3, children=30)
    small = fan_out(alice, minutes_ago=2, children=3)
    alone = make_job(alice, minutes_ago=1, state=JobState.SUCCEEDED)
    client.force_login(alice)

    # when
    html = client.get("/jobs/").content.decode()

    # then: three rows, the children under their parents, not among the rows
    assert rows(html) == [str(alone.id), str(small.id), str(large.id)]
    assert f'data-children-of="{large.id}"' in html and f'data-children-of="{small.id}"' in html
    assert "tests.child (30): 2 running, 28 succeeded" in html  # counted, not listed
    assert "tests.child (3): 2 running, 1 succeeded" in html
    listed = re.findall(r'<li data-job-id="([0-9a-f-]{36})"', html)
    assert listed == [str(j.id) for j in Job.objects.filter(parent=small).order_by("enqueued_at")]
    # the parents' work goes on: they read waiting_children, not succeeded
    for parent in (large, small):
        row = html.split(f'data-job-id="{parent.id}"', 1)[1]
        assert row.split('data-field="state">', 1)[1].startswith("waiting_children<")


def test_the_page_costs_the_same_queries_for_5_or_50_fan_outs(client: Any, alice: Any) -> None:
    def queries() -> int:
        with CaptureQueriesContext(connection) as captured:
            assert client.get("/jobs/").status_code == 200
        return len(captured)

    client.force_login(alice)
    for n in range(5):
        fan_out(alice, minutes_ago=100 + n, children=4 if n % 2 else 12)
    few = queries()
    for n in range(45):
        fan_out(alice, minutes_ago=200 + n, children=4 if n % 2 else 12)
    many = queries()
    print(f"\n'My jobs' with 5 fan-outs: {few} queries; with 50: {many}")
    assert many == few


def test_an_apps_describer_names_the_job_and_links_its_page(
    client: Any, alice: Any, registry: None
) -> None:
    # given: an app registered how its jobs read, describing a page's jobs in one call
    calls: list[int] = []

    def describe(jobs: Sequence[Job]) -> dict[Any, JobDescription]:
        calls.append(len(jobs))
        return {j.id: JobDescription(f"Order {j.args[0]}", f"/orders/{j.args[0]}/") for j in jobs}

    describe_jobs("tests.add", kind="Order", describe=describe)
    jobs = [make_job(alice, minutes_ago=n, args=[40 + n]) for n in range(3)]
    client.force_login(alice)

    html = client.get("/jobs/").content.decode()

    assert calls == [3]
    for job in jobs:
        number = job.args[0]
        assert f'<a data-field="label" href="/orders/{number}/">Order {number}</a>' in html
        assert f'href="/jobs/{job.id}/">tests.add · {job.id}</a>' in html
    assert '<span class="kind">Order</span>' in html
    item = client.get("/api/jobs/").json()["items"][0]
    assert (item["kind"], item["label"], item["url"]) == ("Order", "Order 40", "/orders/40/")


def test_a_describer_that_raises_leaves_task_names(
    client: Any, alice: Any, registry: None, caplog: Any
) -> None:
    def broken(jobs: Sequence[Job]) -> dict[Any, JobDescription]:
        raise LookupError("the app's bug")

    describe_jobs("tests.add", kind="Order", describe=broken)
    job = make_job(alice, minutes_ago=1)
    client.force_login(alice)

    response = client.get("/jobs/")

    assert response.status_code == 200
    assert '<span data-field="label">tests.add</span>' in response.content.decode()
    assert "The describer of tests.add raised" in caplog.text
    assert str(job.id) in response.content.decode()


def test_filters_state_kind_and_since(client: Any, alice: Any, registry: None) -> None:
    describe_jobs("tests.fan", kind="Fan")
    describe_jobs("tests.child", kind="Child")
    working = fan_out(alice, minutes_ago=5, children=3)
    old_dead = make_job(alice, minutes_ago=60 * 30, state=JobState.DEAD)
    dead = make_job(alice, minutes_ago=2, state=JobState.DEAD)
    done = make_job(alice, minutes_ago=1, state=JobState.SUCCEEDED)
    client.force_login(alice)

    def listed(**params: str) -> list[str]:
        return rows(client.get("/jobs/", params).content.decode())

    assert listed(state="dead") == [str(dead.id), str(old_dead.id)]
    assert listed(state="dead", since="24h") == [str(dead.id)]
    # succeeded leaves out a parent whose children still run; waiting_children picks it
    assert listed(state="succeeded") == [str(done.id)]
    assert listed(state="waiting_children") == [str(working.id)]
    # a kind's jobs are listed wherever they sit, fan-out children included
    children = [str(j.id) for j in Job.objects.filter(parent=working).order_by("-enqueued_at")]
    assert sorted(listed(kind="Child")) == sorted(children)
    assert listed(kind="Fan") == [str(working.id)]
    html = client.get("/jobs/", {"kind": "Fan", "state": "dead"}).content.decode()
    assert "No jobs match these filters." in html
    assert '<option value="Child">Child</option>' in html
    assert '<option value="Fan" selected>Fan</option>' in html
    # the page's script polls the API with the same filters
    assert "kind=Fan" in html and "state=dead" in html and "top_level=false" in html


def test_the_state_filter_picks_the_state_the_user_sees(client: Any, alice: Any) -> None:
    # given: a retry whose time has come (shown queued), one still waiting (retrying), and a
    # fan-out whose children a cancel stopped after it had finished (shown cancelled)
    due = make_job(alice, 3, state=JobState.RETRYING, scheduled_for=NOW - timedelta(minutes=1))
    later = make_job(alice, 2, state=JobState.RETRYING, scheduled_for=NOW + timedelta(hours=1))
    stopped = make_job(
        alice,
        1,
        state=JobState.SUCCEEDED,
        finished_at=NOW - timedelta(seconds=30),
        cancel_requested_at=NOW,
    )
    client.force_login(alice)

    def listed(state: str) -> list[str]:
        return [i["job_id"] for i in client.get("/api/jobs/", {"state": state}).json()["items"]]

    assert listed("queued") == [str(due.id)]
    assert listed("retrying") == [str(later.id)]
    assert listed("cancelled") == [str(stopped.id)]
    assert listed("succeeded") == []
    for job_id, state in ((due.id, "queued"), (later.id, "retrying"), (stopped.id, "cancelled")):
        assert client.get(f"/api/jobs/{job_id}/").json()["state"] == state


def test_pages_follow_the_cursor(client: Any, alice: Any) -> None:
    from jobs.web.views import MY_JOBS_SHOWN

    jobs = [make_job(alice, minutes_ago=n) for n in range(MY_JOBS_SHOWN + 3)]
    client.force_login(alice)

    first = client.get("/jobs/").content.decode()
    assert rows(first) == [str(j.id) for j in jobs[:MY_JOBS_SHOWN]]
    older = re.search(r'<a href="\?([^"]+)" id="older-page">Older', first)
    assert older is not None and "Newest" not in first
    second = client.get("/jobs/?" + older.group(1).replace("&amp;", "&")).content.decode()
    assert rows(second) == [str(j.id) for j in jobs[MY_JOBS_SHOWN:]]
    assert 'id="older-page"' not in second and 'id="newest-page"' in second
    # a tampered cursor: the first page, and a word on why
    tampered = client.get("/jobs/", {"cursor": "garbage"}, follow=True).content.decode()
    assert "That page link is not valid any more" in tampered
    assert rows(tampered) == rows(first)


def test_the_api_lists_top_level_jobs_with_their_children(client: Any, alice: Any) -> None:
    small = fan_out(alice, minutes_ago=2, children=3)
    client.force_login(alice)

    body = client.get("/api/jobs/", {"top_level": "true"}).json()

    assert [item["job_id"] for item in body["items"]] == [str(small.id)]
    item = body["items"][0]
    assert item["state"] == "waiting_children"
    assert item["children"]["total"] == 3 and item["children"]["active"] == 2
    assert item["children"]["by_kind"] == {"tests.child": {"running": 2, "succeeded": 1}}
    assert [c["state"] for c in item["children"]["items"]] == ["running", "running", "succeeded"]
    detail = client.get(f"/api/jobs/{small.id}/").json()
    # the job's own route adds its durable steps (none here); a list leaves them out
    assert detail.pop("steps") == [] and item.pop("steps") is None
    assert item == detail
    # without top_level, the children are items too; waiting_children is a filter of its own
    assert len(client.get("/api/jobs/").json()["items"]) == 4
    waiting = client.get("/api/jobs/", {"state": "waiting_children"}).json()["items"]
    assert [i["job_id"] for i in waiting] == [str(small.id)]


def test_the_top_level_page_is_served_by_its_index_past_100k_sends(alice: Any) -> None:
    # given: 60 jobs of alice's own, then a campaign-like fan-out of 100,000 newer children
    for n in range(60):
        make_job(alice, minutes_ago=120 + n)
    parent = make_job(alice, minutes_ago=60, task_name="tests.fan", state=JobState.SUCCEEDED)
    for chunk in range(400):
        prototype = Job(
            task_name="tests.child",
            queue="default",
            owner=alice,
            parent=parent,
            state=JobState.SUCCEEDED,
            enqueued_at=NOW - timedelta(seconds=3600 - chunk),
        )
        insert_many(
            prototype=prototype,
            rows=[NewRow(id=uuid.uuid4(), args=[n], kwargs={}) for n in range(250)],
        )
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE jobs_job")

    # when: the first page of jobs no job started, and the one after it
    first = listed_jobs(alice, owner=alice.pk, top_level=True)[:51]
    rows_first = list(first)
    later = listed_jobs(
        alice,
        owner=alice.pk,
        top_level=True,
        after=(rows_first[-1].enqueued_at, rows_first[-1].id),
    )[:51]

    # then: both read job_owner_top_idx in the page's order, none walks the sends
    for queryset in (first, later):
        text = str(queryset.explain(analyze=True))
        assert "Index Scan using job_owner_top_idx on jobs_job" in text, text
        assert "Seq Scan" not in text and "Sort" not in text, text
        print("\n" + text.splitlines()[-1])
    assert rows_first[0].id == parent.id and len(rows_first) == 51
    assert len(list(later)) == 10
