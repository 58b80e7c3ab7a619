"""Adopt mode: a project's plain Celery tasks on the ledger without a decorator changed
(jobs.flow.adopt), on a real worker and a real caller process, both with adopt mode on."""

from __future__ import annotations

import functools
import json
import subprocess
import sys

import pytest

from jobs.models import DeadLetter, Job, JobState
from jobs.testing import Worker as PlatformWorker
from tests.conftest import LOG_DIR, ROOT, wait_until
from tests.support.adopt_tasks import redis_client

ADOPT = {"BACKLOT_ADOPT_CELERY_TASKS": "1"}
TIMEOUT = 60


def marks(key: str) -> list[str]:
    values = redis_client().lrange(f"test:adopt:{key}", 0, -1)
    return [v.decode() if isinstance(v, bytes) else v for v in values]


@pytest.fixture
def adopt_worker(worker_env, clean_redis, transactional_db):
    """A real worker in adopt mode that imports the plain tasks, on the `reports` queue."""
    worker = PlatformWorker(
        "config",
        queues="reports",
        concurrency=2,
        name="adopt",
        env={**worker_env, **ADOPT},
        cwd=ROOT,
        log_dir=LOG_DIR,
        extra_args=["-I", "tests.support.adopt_tasks", "--without-gossip", "--without-mingle",
                    "--without-heartbeat", "-l", "INFO"],
    )  # fmt: skip
    yield worker
    worker.stop()


def run_in_adopt_mode(worker_env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    """A Python process in adopt mode (as a host's web process is), run to its end: `args`
    after the interpreter."""
    done = subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        env={**worker_env, **ADOPT},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def finished(job_id: str) -> Job | None:
    job = Job.objects.filter(id=job_id).first()
    return job if job is not None and job.finished_at is not None else None


def test_plain_celery_tasks_are_platform_tasks_in_adopt_mode(
    adopt_worker, worker_env, unique, admin_client
):
    # when: a caller process in adopt mode sends them as Celery code does
    done = run_in_adopt_mode(worker_env, "-m", "tests.jobs.flow.adopt_caller", unique)
    ids = json.loads(done.stdout.strip().splitlines()[-1])

    # then: each has a ledger row, moved by the worker to its end
    rows = {
        name: wait_until(functools.partial(finished, job_id), timeout=TIMEOUT, what=name)
        for name, job_id in ids.items()
        if name not in ("opted_out", "group")
    }
    assert rows["add"].state == JobState.SUCCEEDED and rows["add"].result == 5
    assert rows["retrying"].state == JobState.SUCCEEDED
    assert rows["retrying"].attempts == rows["retrying"].max_attempts == 3
    # autoretry_for + retry_backoff + max_retries=1: two runs, then the job is dead
    auto = rows["auto_retrying"]
    assert auto.state == JobState.DEAD and auto.attempts == auto.max_attempts == 2
    assert rows["ignored"].state == JobState.SUCCEEDED
    # a chain's last step and a group's members: rows of their own, results as Celery's
    assert rows["chain"].state == JobState.SUCCEEDED and rows["chain"].result == 13
    members = [wait_until(functools.partial(finished, i), timeout=TIMEOUT) for i in ids["group"]]
    assert [(m.state, m.result) for m in members] == [(JobState.SUCCEEDED, 2 * i) for i in range(3)]
    # an exception Celery does not retry: dead at once, a dead letter
    failed = rows["always_fails"]
    assert failed.state == JobState.DEAD and failed.attempts == 1
    letter = DeadLetter.objects.get(job_id_value=failed.id)
    assert letter.exception_class == "ValueError"
    # the API shows them as platform jobs, max_attempts as they ran
    shown = admin_client.get(f"/api/jobs/{auto.id}/").json()
    assert shown["state"] == "dead" and shown["attempts"] == shown["max_attempts"] == 2
    # delay_on_commit: a row too, run once
    wait_until(lambda: marks(f"{unique}-commit") == ["add"], timeout=TIMEOUT, what="on commit")
    assert Job.objects.filter(task_name="tests.support.adopt_tasks.add").count() >= 2

    # the opted-out task ran as plain Celery: no row
    wait_until(lambda: "opted_out" in marks(unique), timeout=TIMEOUT, what="the opted-out task")
    assert not Job.objects.filter(id=ids["opted_out"]).exists()

    # when: the dead letter is replayed with `manage.py jobs retry`, in adopt mode
    # the command, in a process that imports the task module (a host's app tasks.py is
    # autodiscovered; this test's module is not an installed app's)
    replay = run_in_adopt_mode(
        worker_env,
        "-c",
        "import django; django.setup(); import tests.support.adopt_tasks; "
        "from django.core.management import call_command; "
        f"call_command('jobs', 'retry', '--task', {failed.task_name!r})",
    )

    # then: a new job on the ledger, linked to the dead letter, runs it again and gives up again
    letter.refresh_from_db()
    assert letter.replayed_job_id is not None, replay.stdout
    replayed = wait_until(
        lambda: finished(str(letter.replayed_job_id)), timeout=TIMEOUT, what="the replay"
    )
    assert replayed.state == JobState.DEAD
    assert marks(unique).count("failed") == 2


def test_a_message_sent_before_adoption_is_adopted_once(adopt_worker, unique):
    from tests.support import adopt_tasks

    # given: this process has adopt mode off: a plain message, no ledger row
    assert not getattr(adopt_tasks.add, "adopted", False)
    result = adopt_tasks.add.delay(1, 2, key=unique)
    assert not Job.objects.filter(id=result.id).exists()

    # then: the adopting worker gives it a row at its claim and runs it once
    job = wait_until(lambda: finished(result.id), timeout=TIMEOUT, what="the adopted message")
    assert job.state == JobState.SUCCEEDED and job.result == 3 and job.attempts == 1
    assert marks(unique) == ["add"]


def test_celerys_own_and_backlots_tasks_are_not_adopted(worker_env):
    # in an adopt-mode process: Celery's built-in tasks stay Celery's, Backlot's are @job's
    code = (
        "import django; django.setup()\n"
        "from config.celery import app\n"
        "from jobs.worker.task import PlatformTask\n"
        "import tests.support.adopt_tasks as t\n"
        "app.loader.import_default_modules()\n"
        "tasks = app.tasks\n"
        "print(repr({\n"
        "  'chord_unlock': (tasks['celery.chord_unlock'].adopted,\n"
        "                   tasks['celery.chord_unlock'].track),\n"
        "  'backend_cleanup': tasks['celery.backend_cleanup'].adopted,\n"
        "  'relay': tasks['jobs.relay'].adopted,\n"
        "  'relay_platform': isinstance(tasks['jobs.relay'], PlatformTask),\n"
        "  'add': (t.add.adopted, t.add.track, t.add.queue_name, t.add.policy.max_attempts),\n"
        "  'opted_out': (t.opted_out.adopted, t.opted_out.track),\n"
        "}))\n"
    )
    done = run_in_adopt_mode(worker_env, "-c", code)
    seen = eval(done.stdout.strip().splitlines()[-1])
    assert seen == {
        "chord_unlock": (False, False),
        "backend_cleanup": False,
        "relay": False,
        "relay_platform": True,
        "add": (True, True, "reports", 4),
        "opted_out": (False, False),
    }


@pytest.mark.parametrize(
    ("max_retries", "backoff_max", "attempts", "max_delay"),
    [(3, None, 4, 600.0), (None, None, 4, 600.0), (0, None, 1, 600.0), (5, 3600, 6, 3600.0)],
)
def test_celerys_retry_options_map_onto_the_policy(max_retries, backoff_max, attempts, max_delay):
    from jobs.flow.adopt import adopted_policy

    policy = adopted_policy(max_retries, backoff_max)

    # Celery's max_retries (None: Celery's "no limit", kept at Celery's default 3) + 1 runs
    assert policy.max_attempts == attempts
    assert policy.max_delay == max_delay  # retry_backoff_max, when longer than the policy's
    assert policy.retry_on == ()  # as in Celery, only self.retry()/autoretry_for retry


def test_a_beat_schedule_of_a_plain_task_runs_it_on_the_ledger(adopt_worker, worker_env, unique):
    from django_celery_beat.models import IntervalSchedule, PeriodicTask

    from tests.system.test_beat import start_beat

    # given: a schedule of a plain Celery task, as a project's beat schedule has it
    every_second = IntervalSchedule.objects.create(every=1, period=IntervalSchedule.SECONDS)
    PeriodicTask.objects.create(
        name=f"adopted tick {unique}",
        task="tests.support.adopt_tasks.add",
        interval=every_second,
        args=json.dumps([20, 22]),
        kwargs=json.dumps({"key": unique}),
        queue="reports",
    )
    beat = start_beat(f"adopt-{unique}", {**worker_env, **ADOPT})
    try:
        # then: its runs are jobs on the ledger, succeeded with the task's result
        ran = wait_until(
            lambda: Job.objects.filter(
                task_name="tests.support.adopt_tasks.add",
                kwargs__key=unique,
                state=JobState.SUCCEEDED,
            ).first(),
            timeout=TIMEOUT,
            what="a beat-sent run on the ledger",
        )
    finally:
        beat.terminate()
        beat.wait(timeout=20)
    assert ran.result == 42 and ran.attempts == 1
    assert "add" in marks(unique)


RETRIED = 24  # jobs at once, two runs of the pool: retries overlap other jobs' runs


def test_each_run_of_a_retried_task_reads_its_own_retry_number(adopt_worker, worker_env, unique):
    """self.request.retries is the number of runs before this one, for every run: a retry is
    one message, never two (a CI run once read `after 5` on the third of three runs)."""
    code = (
        "import django, json; django.setup(); from tests.support import adopt_tasks as t; "
        f"print(json.dumps([t.retrying.delay('{unique}-' + str(i)).id for i in range({RETRIED})]))"
    )
    sent = run_in_adopt_mode(worker_env, "-c", code)
    ids = json.loads(sent.stdout.strip().splitlines()[-1])

    rows = [wait_until(functools.partial(finished, i), timeout=TIMEOUT) for i in ids]

    assert [(r.state, r.attempts, r.result) for r in rows] == [
        (JobState.SUCCEEDED, 3, "done after 2")
    ] * RETRIED
    assert [marks(f"{unique}-{i}") for i in range(RETRIED)] == [["0", "1", "2"]] * RETRIED
