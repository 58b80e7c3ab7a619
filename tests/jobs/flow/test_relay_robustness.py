"""The outbox holds up: a mistyped call leaves no row, one bad row never stops a sweep, a job of
an unknown task is reported once, a revoked job is never re-sent, and the relay process alone
publishes the jobs every domain app accepted while Redis was down."""

from __future__ import annotations

import io
import json
import logging
import os
import signal
import subprocess
import sys
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import requests
from django.core.management import call_command
from django.utils import timezone

from config.celery import app as celery_app
from jobs import InvalidArguments, dead_letter_replay, dead_letter_replay_many, enqueue_many, ledger
from jobs.broker.queues import queue_keys
from jobs.broker.redis import redis_client
from jobs.flow import relay
from jobs.flow.relay import job_relay
from jobs.models import DeadLetter, Job, JobState
from jobs.web.monitoring import health_report
from tests.conftest import LOG_DIR, ROOT, marks, wait_until
from tests.support import tasks

pytestmark = pytest.mark.django_db(transaction=True)


def messages_waiting(queue: str = "reports") -> int:
    client = redis_client()
    return sum(client.llen(key) for key in queue_keys(queue))


def outbox_row(task_name: str, args: list, kwargs: dict | None = None, **fields: Any) -> Job:
    """A queued row the broker never took, older than the relay's grace: what enqueue leaves
    when Redis was down (or what a deploy that changed a job's signature finds)."""
    return Job.objects.create(
        task_name=task_name,
        args=args,
        kwargs=kwargs or {},
        queue=fields.pop("queue", "reports"),
        state=JobState.QUEUED,
        enqueued_at=timezone.now() - timedelta(minutes=1),
        **fields,
    )


@pytest.fixture
def fresh_relay(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The relay's once-per-process memory of unknown tasks, empty, and its report cleared."""
    monkeypatch.setattr(relay, "_unknown_tasks", set())
    redis_client().delete(relay.UNKNOWN_TASKS)
    yield
    redis_client().delete(relay.UNKNOWN_TASKS)


# --- a mistyped call -------------------------------------------------------------------------
@pytest.mark.parametrize(
    "call",
    [
        pytest.param(lambda: tasks.add.delay(5), id="delay-missing"),  # type: ignore[call-arg]
        pytest.param(lambda: tasks.add.delay(1, 2, 3), id="delay-extra"),  # type: ignore[call-arg]
        pytest.param(lambda: tasks.add.enqueue(1, c=2), id="enqueue-unknown-kwarg"),  # type: ignore[call-arg]
        pytest.param(lambda: tasks.add.apply_async(args=(1,)), id="apply_async"),
        pytest.param(lambda: tasks.add.using(priority=9).enqueue(1), id="using"),  # type: ignore[call-arg]
        pytest.param(lambda: tasks.progress.delay("k"), id="bound-job"),  # type: ignore[call-arg]
        pytest.param(lambda: enqueue_many(tasks.add, [((1, 2), {}), ((5,), {})]), id="many"),
    ],
)
def test_a_mistyped_call_is_refused_before_any_row_is_written(clean_redis, call):
    with pytest.raises(InvalidArguments, match=r"nothing was enqueued") as raised:
        call()

    assert isinstance(raised.value, TypeError)  # what calling the function would raise
    assert raised.value.args[0].startswith(("tests.add: add()", "tests.progress: progress()"))
    assert Job.objects.count() == 0
    assert messages_waiting("default") == 0
    assert job_relay() == 0


def test_a_well_typed_call_still_goes_through(clean_redis):
    assert tasks.add.delay(1, b=2).id
    assert tasks.progress.delay("k", 3).id
    assert enqueue_many(tasks.add, [((1, 2), {}), ((), {"a": 1, "b": 2})])
    assert Job.objects.count() == 4


# --- a bad row in the outbox -----------------------------------------------------------------
def test_a_row_that_cannot_be_published_is_dead_lettered_and_the_sweep_goes_on(
    clean_redis, fresh_relay, caplog
):
    # given: a row of a job whose signature changed since it was written, between good rows
    before = outbox_row("tests.prioritized", ["k", "before"])
    bad = outbox_row("tests.add", [5])
    after = outbox_row("tests.prioritized", ["k", "after"])

    # when: the relay sweeps, twice
    with caplog.at_level(logging.ERROR, logger="jobs.flow.relay"):
        assert job_relay() == 2
    assert job_relay() == 0

    # then: the good rows are published, the bad one is dead with the reason
    assert Job.objects.filter(id__in=[before.id, after.id], published_at__isnull=False).count() == 2
    assert messages_waiting() == 2
    bad.refresh_from_db()
    assert bad.state == JobState.DEAD and bad.published_at is None
    letter = DeadLetter.objects.get(job_id_value=bad.id)
    assert letter.exception_class == "jobs.core.exceptions.InvalidArguments"
    assert "missing 1 required positional argument: 'b'" in letter.exception_message
    assert letter.attempts == 0 and letter.args == [5]
    assert [r.getMessage() for r in caplog.records if r.name == "jobs.flow.relay"] == [
        f"Job {bad.id} (tests.add) cannot be published (InvalidArguments): dead-lettered"
    ]
    # a bulk replay skips it with the reason; a replay with fixed arguments sends it
    outcome = dead_letter_replay_many(queryset=DeadLetter.objects.filter(pk=letter.pk))
    assert (outcome.done, outcome.skipped) == (0, 1)
    assert outcome.errors == [
        f"dead letter {letter.pk}: tests.add: add() missing 1 required positional argument: "
        "'b'; nothing was enqueued"
    ]
    fixed = dead_letter_replay(dead_letter=letter, args=[5, 1])
    assert Job.objects.get(id=fixed.id).args == [5, 1]
    # and the relay command, the way `make run` runs it, no longer fails its sweeps
    out = io.StringIO()
    call_command("jobs", "relay", "--once", stdout=out)
    assert "sweep failed" not in out.getvalue()


def test_a_retry_its_worker_publishes_is_never_sent_again_by_the_relay(clean_redis, fresh_relay):
    # given: a run that failed and records its retry, due at once, which its worker publishes
    # itself (a self.retry(countdown=0.2) on a loaded host: the relay swept in between)
    row = outbox_row("tests.prioritized", ["k", "retried"])
    claimed = ledger.claim(job_id=str(row.id), lease_seconds=60)
    assert claimed is not None
    due = ledger.retry_later(
        job_id=str(row.id),
        attempt=claimed.attempt,
        failures=[],
        exc=ConnectionError("flaky upstream"),
        delay=0,
        run_seconds=0.1,
        lease_owner=claimed.lease_owner,
        publishing=True,
    )
    assert due is not None

    # when: the relay sweeps before the worker's message is out
    sent = job_relay()

    # then: it sends no copy (two messages claimed two runs: retries read 5 on a 3rd run)
    assert sent == 0 and messages_waiting() == 0
    row.refresh_from_db()
    assert row.state == JobState.RETRYING and row.published_at is not None
    # and a message its worker could not hand over goes back to the outbox: the relay sends it
    assert ledger.unpublish(row.id) == 1
    assert job_relay() == 1 and messages_waiting() == 1


def test_a_job_of_an_unknown_task_is_reported_once_and_in_health_and_metrics(
    client, clean_redis, fresh_relay, caplog, settings
):
    settings.BACKLOT = {**settings.BACKLOT, "METRICS_TOKEN": "scrape-me"}
    gone = [outbox_row("billing.removed_job", [1]) for _ in range(2)]
    good = outbox_row("tests.prioritized", ["k", "good"])

    with caplog.at_level(logging.ERROR, logger="jobs.flow.relay"):
        sent = [job_relay() for _ in range(3)]

    assert sent == [1, 0, 0]
    assert Job.objects.get(id=good.id).published_at is not None
    assert Job.objects.filter(id__in=[g.id for g in gone], state=JobState.QUEUED).count() == 2
    logged = [r.getMessage() for r in caplog.records if r.name == "jobs.flow.relay"]
    assert len(logged) == 1 and "unknown task billing.removed_job" in logged[0], logged
    status, details = health_report()
    assert status == "degraded"
    assert details["checks"]["unknown_tasks"] == {"billing.removed_job": 2}
    assert (
        "2 job(s) wait for unknown task billing.removed_job: deploy it, or cancel them"
        in (details["checks"]["problems"])
    )
    text = client.get("/metrics", HTTP_AUTHORIZATION="Bearer scrape-me").content.decode()
    assert 'backlot_jobs_unknown_task{task="billing.removed_job"} 2.0' in text

    # once they are cancelled, the report clears at the next sweep
    call_command("jobs", "cancel", *[str(g.id) for g in gone], stdout=io.StringIO())
    job_relay()
    assert health_report()[1]["checks"]["unknown_tasks"] == {}


# --- revoked jobs ----------------------------------------------------------------------------
def test_a_revoked_job_is_never_re_sent_by_the_relay(worker, fresh_relay, unique):
    # given: a queued and a scheduled job (on `reports`, which no worker here consumes)
    queued = tasks.prioritized.enqueue(unique, "queued")
    scheduled = tasks.prioritized.using(delay=1).enqueue(unique, "scheduled")
    ids = [queued.id, scheduled.id]

    # when: both are revoked the Celery way, and their messages are lost long enough for
    # the relay's reconcile to re-send a waiting job (published minutes ago, queue empty)
    celery_app.control.revoke(ids)
    wait_until(
        lambda: Job.objects.filter(id__in=ids, state=JobState.CANCELLED).count() == 2,
        timeout=30,
        what="the revokes to land in the ledger",
    )
    redis_client().delete(*queue_keys("reports"))
    Job.objects.filter(id__in=ids).update(
        published_at=timezone.now() - timedelta(minutes=10),
        enqueued_at=timezone.now() - timedelta(minutes=10),
        scheduled_for=timezone.now() - timedelta(minutes=9),
    )

    # then: the relay sends neither, and neither ever ran
    assert [job_relay() for _ in range(2)] == [0, 0]
    assert messages_waiting() == 0
    assert set(Job.objects.filter(id__in=ids).values_list("state", flat=True)) == {"cancelled"}
    assert marks(unique) == []


# --- the relay process alone publishes what every domain app accepted ------------------------
def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class _Process:
    """A process of the project (web server, relay), logging to a file, stopped by its PID."""

    def __init__(self, name: str, command: list[str], env: dict[str, str]) -> None:
        LOG_DIR.mkdir(parents=True, exist_ok=True)
        self.log_path = LOG_DIR / f"relay-robustness-{name}-{uuid.uuid4().hex[:6]}.log"
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                command,
                cwd=ROOT,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        if self.process.poll() is not None:
            raise AssertionError(f"process exited:\n{self.output()[-3000:]}")
        return True

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)


def test_the_relay_process_publishes_every_apps_jobs_accepted_while_redis_was_down(
    worker_env, transactional_db, django_user_model, tmp_path, settings
):
    from tests.media_pipeline.conftest import make_clip
    from tests.reports.conftest import REQUEST_BOTH_KINDS, grant
    from tests.system.faults.conftest import PrivateRedis
    from web.models import ApiToken

    # given: a Redis of our own, stopped, and a web server and a relay that use it
    private = PrivateRedis(tmp_path / "redis")
    user = grant(
        django_user_model.objects.create_user("relay-user", password="not-used"),
        *REQUEST_BOTH_KINDS,
    )
    _, key = ApiToken.issue(user=user, name="relay-test")
    media = tmp_path / "media"
    env = {**worker_env, "REDIS_URL": private.url, "MEDIA_ROOT": str(media)}
    port = _free_port()
    web = _Process(
        "web",
        [sys.executable, "manage.py", "runserver", "--noreload", f"127.0.0.1:{port}"],
        env,
    )
    relay_process: _Process | None = None
    base = f"http://127.0.0.1:{port}"
    auth = {"Authorization": f"Bearer {key}"}
    try:

        def web_up() -> bool:
            web.alive()
            try:
                return requests.get(f"{base}/api/openapi.json", timeout=2).ok
            except requests.ConnectionError:
                return False

        wait_until(web_up, timeout=60, interval=0.25, what="the web server")

        # when: one job of each app is accepted through the API while Redis is down
        today = timezone.localdate()
        answers = [
            requests.post(
                f"{base}/api/emails/",
                json={"to": "jane@example.com", "template": "test", "context": {"name": "J"}},
                headers=auth,
                timeout=30,
            ),
            requests.post(
                f"{base}/api/reports/",
                json={
                    "kind": "sales",
                    "params": {"start": str(today - timedelta(days=6)), "end": str(today)},
                },
                headers=auth,
                timeout=30,
            ),
            requests.post(
                f"{base}/api/videos/",
                files={"file": ("clip.mp4", _clip(make_clip, tmp_path).read_bytes(), "video/mp4")},
                headers=auth,
                timeout=30,
            ),
        ]
        assert [a.status_code for a in answers] == [202, 202, 202], [a.text for a in answers]
        ids = [a.json()["job_id"] for a in answers]
        rows = list(Job.objects.filter(id__in=ids))
        assert sorted(j.queue for j in rows) == ["emails", "media", "reports"]
        assert all(j.published_at is None for j in rows), "Redis was down at enqueue"

        # and: the relay process starts while Redis is still down (its sweeps fail, nothing is
        # dead-lettered), then Redis comes up; no worker, no beat
        relay_process = _Process("relay", [sys.executable, "manage.py", "jobs", "relay"], env)
        wait_until(
            lambda: relay_process.alive() and "stays in the outbox" in relay_process.output(),
            timeout=60,
            what="a relay sweep against the stopped Redis",
        )
        private.start()

        # then: the relay publishes all three, each into its queue in Redis
        wait_until(
            lambda: (
                relay_process.alive()
                and Job.objects.filter(id__in=ids, published_at__isnull=False).count() == 3
            ),
            timeout=60,
            interval=0.25,
            what="the relay to publish the three jobs",
        )
        queued = {
            queue: {
                json.loads(raw)["headers"]["id"]
                for name in queue_keys(queue)
                for raw in private.client.lrange(name, 0, -1)
            }
            for queue in ("emails", "reports", "media")
        }
        by_queue = {j.queue: str(j.id) for j in Job.objects.filter(id__in=ids)}
        assert all(by_queue[q] in queued[q] for q in queued), (queued, by_queue)
        assert not Job.objects.filter(id__in=ids).exclude(state=JobState.QUEUED).exists()
        assert not DeadLetter.objects.exists()
        assert "unknown task" not in relay_process.output()
    finally:
        if relay_process is not None:
            relay_process.stop()
        web.stop()
        private.stop()


def _clip(make_clip: Any, folder: Path) -> Path:
    return make_clip(folder / "clip.mp4", size=(160, 90), seconds=1.0, audio=False)
