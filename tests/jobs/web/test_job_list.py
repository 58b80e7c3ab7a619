"""GET /api/jobs/ (a user's jobs, newest first, in signed cursor pages) and the "My jobs" page:
who sees what, the cursor walk, filters and their 400s, and the query plan on 100,000 rows."""

from __future__ import annotations

import time
import uuid
from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.db import connection
from django.utils import timezone

from jobs.ledger import NewRow, insert_many
from jobs.models import Job, JobState
from jobs.web.api import listed_jobs
from tests.conftest import Worker, set_flag, wait_until
from tests.support import tasks

pytestmark = pytest.mark.django_db

LIST_URL = "/api/jobs/"
NOW = timezone.now().replace(microsecond=0)


def make_job(owner: Any, minutes_ago: float, **fields: Any) -> Job:
    """A ledger row as enqueue writes it, enqueued `minutes_ago` before NOW."""
    fields.setdefault("task_name", "tests.add")
    fields.setdefault("queue", "default")
    return Job.objects.create(
        owner=owner, enqueued_at=NOW - timedelta(minutes=minutes_ago), **fields
    )


@pytest.fixture
def alice() -> Any:
    return get_user_model().objects.create_user("alice", password="pw-alice-123")


@pytest.fixture
def bob() -> Any:
    return get_user_model().objects.create_user("bob", password="pw-bob-123")


def ids(body: dict[str, Any]) -> list[str]:
    return [item["job_id"] for item in body["items"]]


# --- who sees what ----------------------------------------------------------------------------
def test_a_user_lists_only_their_own_jobs(client: Any, alice: Any, bob: Any) -> None:
    # given
    mine = [make_job(alice, minutes_ago=m) for m in (3, 1, 2)]
    make_job(bob, minutes_ago=0)
    # when
    client.force_login(alice)
    response = client.get(LIST_URL)
    # then: newest first, each item the detail document
    assert response.status_code == 200
    body = response.json()
    assert ids(body) == [str(mine[1].id), str(mine[2].id), str(mine[0].id)]
    assert body["next_cursor"] is None
    detail = client.get(f"/api/jobs/{mine[1].id}/").json()
    # (the job's own route adds its durable steps, which a list leaves out: null)
    assert detail.pop("steps") == [] and body["items"][0].pop("steps") is None
    assert body["items"][0] == detail


def test_staff_list_everyone_or_one_owner(
    client: Any, admin_user: Any, alice: Any, bob: Any
) -> None:
    a, b = make_job(alice, minutes_ago=2), make_job(bob, minutes_ago=1)
    client.force_login(admin_user)

    assert ids(client.get(LIST_URL).json()) == [str(b.id), str(a.id)]
    assert ids(client.get(LIST_URL, {"owner": alice.pk}).json()) == [str(a.id)]


def test_owner_filter_is_staff_only(client: Any, alice: Any, bob: Any) -> None:
    own = make_job(alice, minutes_ago=1)
    make_job(bob, minutes_ago=1)
    client.force_login(alice)

    response = client.get(LIST_URL, {"owner": bob.pk})
    assert response.status_code == 403
    assert "Only staff" in response.json()["detail"]
    # naming yourself is allowed (the "My jobs" page does, for staff and users alike)
    assert ids(client.get(LIST_URL, {"owner": alice.pk}).json()) == [str(own.id)]


def test_anonymous_gets_401(client: Any, alice: Any) -> None:
    make_job(alice, minutes_ago=1)
    assert client.get(LIST_URL).status_code == 401


def test_bearer_token_lists_the_token_owners_jobs(client: Any, alice: Any, bob: Any) -> None:
    from web.models import ApiToken

    own = make_job(alice, minutes_ago=1)
    make_job(bob, minutes_ago=0)
    _, token = ApiToken.issue(user=alice, name="list test")
    response = client.get(LIST_URL, headers={"Authorization": f"Bearer {token}"})
    assert response.status_code == 200
    assert ids(response.json()) == [str(own.id)]


# --- cursor pages -----------------------------------------------------------------------------
def test_cursor_walk_returns_every_job_once_newest_first(client: Any, alice: Any, bob: Any) -> None:
    # given: seven jobs, two pairs of them enqueued at the same instant (the id breaks the tie)
    jobs = [make_job(alice, minutes_ago=m) for m in (1, 2, 2, 3, 4, 4, 5)]
    make_job(bob, minutes_ago=3)
    expected = [str(j.id) for j in sorted(jobs, key=lambda j: (j.enqueued_at, j.id), reverse=True)]
    client.force_login(alice)
    # when
    seen: list[str] = []
    pages = 0
    params: dict[str, Any] = {"limit": 3}
    while True:
        body = client.get(LIST_URL, params).json()
        pages += 1
        seen += ids(body)
        if body["next_cursor"] is None:
            break
        params["cursor"] = body["next_cursor"]
    # then
    assert seen == expected
    assert pages == 3  # 3 + 3 + 1


def test_limit_bounds(client: Any, alice: Any) -> None:
    for minutes in range(3):
        make_job(alice, minutes_ago=minutes)
    client.force_login(alice)
    assert len(client.get(LIST_URL, {"limit": 2}).json()["items"]) == 2
    for bad in ("0", "201", "many"):
        response = client.get(LIST_URL, {"limit": bad})
        assert response.status_code == 400
        assert "limit must be a whole number from 1 to 200" in response.json()["detail"]


@pytest.mark.parametrize(
    "cursor",
    [
        "garbage",
        # a real cursor whose position was edited: the signature no longer matches
        "WyIyMDk5LTAxLTAxVDAwOjAwOjAwKzAwOjAwIiwiMDAwMDAwMDAtMDAwMC0wMDAwLTAwMDAtMDAwMDAwMDAwMDAwIl0:AAAA",
    ],
)
def test_a_bad_cursor_is_400(client: Any, alice: Any, cursor: str) -> None:
    client.force_login(alice)
    response = client.get(LIST_URL, {"cursor": cursor})
    assert response.status_code == 400
    assert response.json()["detail"].startswith("Invalid cursor")


def test_a_tampered_cursor_is_400(client: Any, alice: Any) -> None:
    for minutes in range(3):
        make_job(alice, minutes_ago=minutes)
    client.force_login(alice)
    cursor = client.get(LIST_URL, {"limit": 1}).json()["next_cursor"]
    payload, _, signature = cursor.rpartition(":")
    response = client.get(LIST_URL, {"cursor": payload[:-2] + "xx:" + signature})
    assert response.status_code == 400
    assert "altered or not issued by this API" in response.json()["detail"]


# --- filters ----------------------------------------------------------------------------------
def test_filters_by_state_task_queue_and_since(client: Any, alice: Any) -> None:
    old = make_job(alice, minutes_ago=60, state=JobState.SUCCEEDED)
    dead = make_job(alice, minutes_ago=5, state=JobState.DEAD, task_name="tests.flaky")
    queued = make_job(alice, minutes_ago=1, queue="emails")
    client.force_login(alice)

    def listed(**params: Any) -> list[str]:
        response = client.get(LIST_URL, params)
        assert response.status_code == 200, response.content
        return ids(response.json())

    assert listed(state="dead") == [str(dead.id)]
    assert listed(task="tests.add") == [str(queued.id), str(old.id)]
    assert listed(queue="emails") == [str(queued.id)]
    since = (NOW - timedelta(minutes=10)).isoformat()
    assert listed(since=since) == [str(queued.id), str(dead.id)]
    # an unencoded "+00:00" arrives as " 00:00": still understood
    assert listed(since=since.replace("+", " ")) == [str(queued.id), str(dead.id)]
    assert listed(since=(NOW - timedelta(minutes=10)).strftime("%Y-%m-%dT%H:%M:%SZ")) == [
        str(queued.id),
        str(dead.id),
    ]
    assert listed(state="succeeded", task="tests.add", queue="default") == [str(old.id)]


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"state": "finished"}, "Unknown state 'finished'; one of: queued, scheduled, running"),
        ({"since": "yesterday"}, "since must be an ISO 8601 date and time with a time zone"),
        ({"since": "2025-01-31T09:00:00"}, "with a time zone"),  # naive
        ({"since": "2025-13-31T09:00:00Z"}, "with a time zone"),  # no such month
        ({"owner": "not-an-id"}, "owner must be a user id"),
    ],
)
def test_bad_filters_are_400_naming_the_problem(
    client: Any, admin_user: Any, params: dict[str, str], message: str
) -> None:
    client.force_login(admin_user)
    response = client.get(LIST_URL, params)
    assert response.status_code == 400
    assert message in response.json()["detail"]


# --- the "My jobs" page -----------------------------------------------------------------------
def test_my_jobs_page_needs_a_login(client: Any) -> None:
    response = client.get("/jobs/")
    assert response.status_code == 302
    assert response["Location"].startswith("/accounts/login/?next=/jobs/")


def test_my_jobs_page_lists_own_jobs_with_links(
    client: Any, alice: Any, bob: Any, admin_user: Any
) -> None:
    mine = make_job(alice, minutes_ago=1, state=JobState.RUNNING, progress_done=3, progress_total=4)
    theirs = make_job(bob, minutes_ago=0)
    make_job(admin_user, minutes_ago=0)
    client.force_login(alice)

    html = client.get("/jobs/").content.decode()

    assert f'href="/jobs/{mine.id}/"' in html
    assert 'data-field="state">running<' in html and "width: 75.0%" in html
    assert str(theirs.id) not in html
    # the script polls the list API for what the page shows: jobs no other job started
    assert f'data-list-url="/api/jobs/?owner={alice.pk}&amp;limit=50&amp;top_level=true"' in html
    assert 'href="/jobs/">My jobs</a>' in html  # the project's nav links to it


def test_my_jobs_page_for_staff_shows_their_own(client: Any, alice: Any, admin_user: Any) -> None:
    make_job(alice, minutes_ago=1)
    client.force_login(admin_user)
    html = client.get("/jobs/").content.decode()
    assert "You have no jobs yet." in html


# --- the query plan on 100,000 rows -----------------------------------------------------------
ROWS = 100_000
OWNERS = 4
CHUNK = 250  # rows sharing one enqueued_at: 400 instants, ties included


def plan(queryset: Any) -> str:
    return str(queryset.explain())


def test_the_list_is_served_by_its_index_on_100k_rows(django_user_model: Any) -> None:
    # given: 100,000 jobs of four owners, newest every CHUNK rows, then fresh statistics
    started = time.monotonic()
    owners = [django_user_model.objects.create_user(f"owner{n}") for n in range(OWNERS)]
    for chunk in range(ROWS // CHUNK):
        prototype = Job(
            task_name="tests.add",
            queue="default",
            owner=owners[chunk % OWNERS],
            state=JobState.SUCCEEDED if chunk % 3 else JobState.QUEUED,
            enqueued_at=NOW - timedelta(seconds=ROWS // CHUNK - chunk),  # oldest first, as in life
        )
        insert_many(
            prototype=prototype,
            rows=[NewRow(id=uuid.uuid4(), args=[1, 2], kwargs={}) for _ in range(CHUNK)],
        )
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE jobs_job")
    assert Job.objects.count() == ROWS
    owner = owners[1]
    page = listed_jobs(owner)[:51]
    first = list(page)
    later = listed_jobs(owner, after=(first[-1].enqueued_at, first[-1].id))[:51]
    deep_job = listed_jobs(owner)[20_000]
    deep = listed_jobs(owner, after=(deep_job.enqueued_at, deep_job.id))[:51]
    staff = get_user_model()(is_staff=True, is_active=True)
    one_owner = listed_jobs(staff, owner=owner.pk)[:51]

    # then: each page is an index scan in the response's order (no Seq Scan, no Sort)
    for queryset in (page, later, deep, one_owner):
        text = plan(queryset)
        assert "Index Scan using job_owner_list_idx on jobs_job" in text, text
        assert "Seq Scan" not in text and "Sort" not in text, text
    # a later page starts the scan at the cursor (an index condition, not a filter)
    index_cond = plan(deep).split("Index Cond:")[1].split("\n")[0]
    assert "owner_id =" in index_cond and "enqueued_at <=" in index_cond, plan(deep)
    rows = list(deep)
    assert len(rows) == 51 and rows[0].enqueued_at <= deep_job.enqueued_at
    assert time.monotonic() - started < 30


# --- live states in a real browser ------------------------------------------------------------
def wait_for_state(job_id: str, state: str) -> None:
    wait_until(
        lambda: Job.objects.get(id=job_id).state == state,
        timeout=20,
        interval=0.05,
        what=f"job {job_id} {state}",
    )


@pytest.mark.django_db(transaction=True)
def test_my_jobs_page_shows_state_changes_live(
    worker: Worker, live_server: Any, unique: str, django_user_model: Any, browser_page: Any
) -> None:
    from playwright.sync_api import expect

    user = django_user_model.objects.create_user("carol", password="pw-carol-123")
    running = tasks.progress.using(owner=user).enqueue(unique, 4)  # waits at step 2 for the flag
    wait_for_state(running.id, JobState.RUNNING)

    page = browser_page
    page.goto("/accounts/login/?next=/jobs/")
    page.fill("#id_username", "carol")
    page.fill("#id_password", "pw-carol-123")
    page.get_by_role("button", name="Sign in").click()
    row = page.locator(f'tr[data-job-id="{running.id}"]')
    expect(row.locator('[data-field="state"]')).to_have_text("running")
    page.evaluate("window.sameDocument = true")  # gone if the page were reloaded

    # when: the job finishes, and a new one is enqueued, while the page stays open
    set_flag(unique)
    wait_for_state(running.id, JobState.SUCCEEDED)
    added = tasks.add.using(owner=user).enqueue(2, 3)

    # then: both show without a reload
    expect(row.locator('[data-field="state"]')).to_have_text("succeeded")
    expect(row.locator('[data-field="message"]')).to_have_text("step 4")
    new_row = page.locator("tbody tr").first
    expect(new_row).to_have_attribute("data-job-id", added.id)
    expect(new_row.locator('[data-field="state"]')).to_have_text("succeeded")
    assert page.evaluate("window.sameDocument === true")


@pytest.fixture
def browser_page(live_server: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """Debian's chromium through Playwright, as tests/system/test_browser.py launches it."""
    from django.db import connections

    from tests.system.test_browser import CHROMIUM, CHROMIUM_ARGS

    if not CHROMIUM.is_file():
        pytest.fail(f"{CHROMIUM} is missing: `make test` installs it", pytrace=False)
    from playwright.sync_api import sync_playwright

    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")  # see tests/system/test_browser.py
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS
        )
        try:
            context = browser.new_context(base_url=live_server.url)
            context.set_default_timeout(10_000)
            yield context.new_page()
        finally:
            browser.close()
            connections.close_all()
