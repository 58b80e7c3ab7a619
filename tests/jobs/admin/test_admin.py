"""Dead letters and the job ledger in Django admin."""

from __future__ import annotations

import re
import uuid

import pytest
from django.utils import timezone

from jobs.broker import running
from jobs.models import DeadLetter, DeadLetterStatus, Job, JobState
from tests.conftest import wait_until
from tests.support import tasks

pytestmark = pytest.mark.django_db(transaction=True)


def dead_letter(**fields) -> DeadLetter:
    now = timezone.now()
    values = {
        "job_id_value": uuid.uuid4(),
        "task_name": "tests.prioritized",
        "args": ["k", "replayed"],
        "kwargs": {},
        "queue": "reports",
        "exception_class": "jobs.core.policies.Permanent",
        "exception_message": "nope",
        "traceback": "Traceback (most recent call last):\n  boom",
        "first_failed_at": now,
        "last_failed_at": now,
    }
    values.update(fields)
    return DeadLetter.objects.create(**values)


def test_dead_letter_list_and_detail_render(admin_client):
    row = dead_letter()

    listing = admin_client.get("/admin/jobs/deadletter/")
    detail = admin_client.get(f"/admin/jobs/deadletter/{row.pk}/change/")

    assert listing.status_code == 200 and b"tests.prioritized" in listing.content
    assert detail.status_code == 200
    assert b"<pre>Traceback (most recent call last):" in detail.content


def test_replay_action_enqueues_a_linked_job(admin_client, admin_user, clean_redis):
    row = dead_letter()

    response = admin_client.post(
        "/admin/jobs/deadletter/",
        {"action": "replay_selected", "_selected_action": [row.pk]},
        follow=True,
    )

    row.refresh_from_db()
    assert row.status == DeadLetterStatus.REPLAYED and row.resolved_by == admin_user
    assert row.replayed_job_id is not None
    job = Job.objects.get(id=row.replayed_job_id)
    assert job.task_name == "tests.prioritized" and job.args == ["k", "replayed"]
    assert job.replay_of_id == row.pk
    # the message links the new job
    link = f'<a href="/admin/jobs/job/{job.id}/change/">{job.id}</a>'
    assert f"1 dead letter replayed as {link}." in response.content.decode()


def test_discard_action_marks_rows(admin_client):
    rows = [dead_letter(), dead_letter()]

    response = admin_client.post(
        "/admin/jobs/deadletter/",
        {"action": "discard_selected", "_selected_action": [r.pk for r in rows]},
        follow=True,
    )

    assert b"2 dead letters discarded." in response.content
    assert set(DeadLetter.objects.values_list("status", flat=True)) == {DeadLetterStatus.DISCARDED}


def test_job_ledger_is_read_only(admin_client, clean_redis):
    handle = tasks.prioritized.enqueue("k", "a")

    assert admin_client.get("/admin/jobs/job/").status_code == 200
    assert admin_client.get(f"/admin/jobs/job/{handle.id}/change/").status_code == 200
    assert admin_client.get("/admin/jobs/job/add/").status_code == 403


@pytest.fixture
def viewer(django_user_model):
    """A staff user who may look at dead letters but not act on them."""
    from django.contrib.auth.models import Permission

    user = django_user_model.objects.create_user("viewer", password="pw-viewer-123", is_staff=True)
    user.user_permissions.add(
        *Permission.objects.filter(codename__in=["view_deadletter", "view_job"])
    )
    return user


def test_list_masks_personal_data_and_searches_by_job_id(admin_client):
    row = dead_letter(kwargs={"to": "jane.doe@example.com"})
    dead_letter(task_name="tests.other")

    listing = admin_client.get("/admin/jobs/deadletter/", {"q": str(row.job_id_value)})

    assert b"j***@example.com" in listing.content and b"jane.doe@" not in listing.content
    assert listing.context["cl"].result_count == 1


def test_detail_shows_raw_arguments_only_with_the_permission(client, admin_client, viewer):
    row = dead_letter(kwargs={"to": "jane.doe@example.com"})
    client.force_login(viewer)

    masked = client.get(f"/admin/jobs/deadletter/{row.pk}/change/")
    raw = admin_client.get(f"/admin/jobs/deadletter/{row.pk}/change/")

    assert b"j***@example.com" in masked.content and b"jane.doe@" not in masked.content
    assert b"jane.doe@example.com" in raw.content


def test_without_permission_no_actions_and_forged_post_is_403(client, viewer):
    row = dead_letter()
    client.force_login(viewer)

    listing = client.get("/admin/jobs/deadletter/")
    forged = client.post(
        "/admin/jobs/deadletter/", {"action": "replay_selected", "_selected_action": [row.pk]}
    )
    forged_discard = client.post(
        "/admin/jobs/deadletter/", {"action": "discard_selected", "_selected_action": [row.pk]}
    )

    assert (
        b"replay_selected" not in listing.content and b"Replay all matching" not in listing.content
    )
    assert forged.status_code == 403 and forged_discard.status_code == 403
    assert client.get("/admin/jobs/deadletter/replay-matching/").status_code == 403
    assert client.get(f"/admin/jobs/deadletter/{row.pk}/replay/").status_code == 403
    row.refresh_from_db()
    assert row.status == DeadLetterStatus.DEAD


def test_actions_are_audited(admin_client, admin_user, clean_redis):
    from jobs.models import AuditEntry

    rows = [dead_letter(), dead_letter()]
    admin_client.post(
        "/admin/jobs/deadletter/",
        {"action": "replay_selected", "_selected_action": [r.pk for r in rows]},
    )

    entry = AuditEntry.objects.get()
    assert (entry.user, entry.action, entry.count) == (admin_user, "replay", 2)


def test_replay_with_edited_arguments_validates_and_records_the_edit(admin_client, clean_redis):
    from jobs.models import AuditEntry

    row = dead_letter(args=["k", "old"])
    url = f"/admin/jobs/deadletter/{row.pk}/replay/"

    bad = admin_client.post(url, {"args": "[not json", "kwargs": "{}"})
    assert bad.status_code == 200 and b"Not valid JSON" in bad.content
    assert Job.objects.count() == 0

    response = admin_client.post(url, {"args": '["k", "new"]', "kwargs": "{}"})

    assert response.status_code == 302
    row.refresh_from_db()
    assert row.status == DeadLetterStatus.REPLAYED and row.replayed_job is not None
    assert row.replayed_job.args == ["k", "new"]
    edit = AuditEntry.objects.get(action="replay-edited")
    assert edit.detail["before"]["args"] == ["k", "old"] and edit.detail["after"]["args"] == [
        "k",
        "new",
    ]


def test_replay_all_matching_runs_in_the_background(worker, admin_client):
    matching = [dead_letter(exception_class="ConnectionError") for _ in range(30)]
    other = dead_letter(exception_class="ValueError")
    url = "/admin/jobs/deadletter/replay-matching/?exception_class__exact=ConnectionError"

    confirm = admin_client.get(url)
    assert b"30 unresolved dead letters match" in confirm.content
    response = admin_client.post(url.split("?")[0], {"exception_class__exact": "ConnectionError"})

    job_id = response["Location"].split("/")[-2]
    wait_until(
        lambda: Job.objects.filter(id=job_id, state=JobState.SUCCEEDED).exists(), what="bulk replay"
    )
    assert (
        DeadLetter.objects.filter(
            pk__in=[r.pk for r in matching], status=DeadLetterStatus.REPLAYED
        ).count()
        == 30
    )
    other.refresh_from_db()
    assert other.status == DeadLetterStatus.DEAD
    assert Job.objects.filter(replay_of__in=matching).count() == 30


def test_two_operators_replaying_at_once_make_one_job(transactional_db, clean_redis):
    import threading

    from django.db import connection

    from jobs import dead_letter_replay
    from jobs.core.exceptions import ReplayError

    row = dead_letter()
    barrier, outcomes = threading.Barrier(2), []

    def replay():
        barrier.wait()
        try:
            outcomes.append(dead_letter_replay(dead_letter=DeadLetter.objects.get(pk=row.pk)).id)
        except ReplayError:
            outcomes.append("refused")
        finally:
            connection.close()

    threads = [threading.Thread(target=replay) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert sorted(outcomes, key=str)[-1] == "refused" and Job.objects.count() == 1


def test_dashboard_shows_queue_numbers(admin_client, client, viewer, clean_redis):
    tasks.prioritized.enqueue("k", "a")  # waits on `reports`

    page = admin_client.get("/admin/jobs/job/dashboard/")
    data = admin_client.get("/admin/jobs/job/dashboard.json").json()

    assert page.status_code == 200 and b"Jobs dashboard" in page.content and b"<svg" in page.content
    reports = next(q for q in data["queues"] if q["name"] == "reports")
    assert reports["waiting"] == 1
    assert data["health"]["thresholds"]["max_queue_depth"] == 1000
    assert b"Jobs dashboard" in admin_client.get("/admin/").content  # linked from the index
    client.force_login(viewer)
    assert client.get("/admin/jobs/job/dashboard.json").status_code == 200


def test_retry_of_a_dead_job_replays_it_linked_and_audited(admin_client, admin_user, clean_redis):
    from jobs.models import AuditEntry

    # given a dead job with its dead letter, and a succeeded one
    now = timezone.now()
    dead = Job.objects.create(
        task_name="tests.prioritized", queue="reports", state=JobState.DEAD, args=["k", "again"],
        finished_at=now,
    )  # fmt: skip
    done = Job.objects.create(
        task_name="tests.prioritized", queue="reports", state=JobState.SUCCEEDED, finished_at=now
    )
    letter = dead_letter(job_id_value=dead.id, args=["k", "again"])
    listing = admin_client.get("/admin/jobs/job/")
    assert b"retry_selected" in listing.content and b"cancel_selected" in listing.content

    # when both are retried from the job list
    response = admin_client.post(
        "/admin/jobs/job/",
        {"action": "retry_selected", "_selected_action": [dead.pk, done.pk]},
        follow=True,
    )

    # then the dead one is replayed as a new job, linked, and the action is audited
    letter.refresh_from_db()
    assert letter.status == DeadLetterStatus.REPLAYED
    new = Job.objects.get(id=str(letter.replayed_job_id))
    assert new.replay_of_id == letter.pk and new.args == ["k", "again"]
    body = response.content.decode()
    assert f'1 job retried as <a href="/admin/jobs/job/{new.id}/change/">{new.id}</a>' in body
    assert "1 not dead (or already replayed)" in body
    entry = AuditEntry.objects.get(action="retry")
    assert entry.user == admin_user and entry.count == 1


def test_retry_without_the_replay_permission_is_403(client, viewer):
    dead = Job.objects.create(task_name="tests.prioritized", queue="reports", state=JobState.DEAD)
    client.force_login(viewer)
    assert b"retry_selected" not in client.get("/admin/jobs/job/").content
    forged = client.post(
        "/admin/jobs/job/", {"action": "retry_selected", "_selected_action": [dead.pk]}
    )
    assert forged.status_code == 403


@pytest.mark.parametrize("defer", [True, False], ids=["deferred", "claimed"])
def test_the_job_list_shows_a_run_that_has_not_written_its_row_as_running(
    admin_client, clean_redis, settings, defer
):
    # given two queued jobs, and a run of the first one started without writing its row (the
    # record a solo worker's delivery takes with DEFER_CLAIM, jobs.broker.running)
    settings.BACKLOT = {**settings.BACKLOT, "DEFER_CLAIM": defer}
    started, waiting = (
        Job.objects.create(task_name="tests.add", state=JobState.QUEUED) for _ in range(2)
    )
    running.start(str(started.id), str(uuid.uuid4()), 30)

    # when an operator opens the job list
    page = admin_client.get("/admin/jobs/job/").content.decode()

    # then the started one says running (with DEFER_CLAIM), the other queued, as their rows
    # and the status API would say
    def state_of(job: Job) -> str:
        (row,) = [r for r in re.findall(r"<tr>.*?</tr>", page, re.S) if str(job.id) in r]
        cell = re.search(r'class="field-shown_state">([^<]*)<', row)
        assert cell is not None, row
        return cell[1]

    assert state_of(started) == ("Running" if defer else "Queued")
    assert state_of(waiting) == "Queued"
    started.refresh_from_db()
    assert started.state == JobState.QUEUED  # the row itself is not written
