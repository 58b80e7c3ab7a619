"""Durable steps (jobs.worker.steps) on real worker processes, Redis and PostgreSQL: a finished
step runs once per job across retries, a kill -9 of its worker and a dead letter's replay from
the admin; a changed step order is a clear error; a durable sleep holds no worker and resumes
once."""

from __future__ import annotations

import functools
import os
import signal
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta

import pytest
from django.utils import timezone

import jobs
from jobs.broker.redis import redis_client
from jobs.core.exceptions import StepResultTooLarge
from jobs.flow.relay import job_relay
from jobs.models import DeadLetter, Job, JobState, JobStep, StepState
from jobs.testing import Worker as PlatformWorker
from jobs.worker.steps import stored_result
from tests.conftest import LOG_DIR, ROOT, marks, wait_until
from tests.support import step_tasks

TIMEOUT = 60


class StepWorker(PlatformWorker):
    """A real worker of the project on the `reports` queue, with the step jobs loaded."""

    def __init__(
        self, name: str, env: dict[str, str], concurrency: int, imports: tuple[str, ...] = ()
    ) -> None:
        modules = ",".join(("tests.support.tasks", "tests.support.step_tasks", *imports))
        super().__init__(
            "config",
            queues="reports",
            concurrency=concurrency,
            name=name,
            env=env,
            cwd=ROOT,
            log_dir=LOG_DIR,
            extra_args=["-I", modules, "--without-gossip", "--without-mingle",
                        "--without-heartbeat", "-l", "INFO"],
        )  # fmt: skip

    def kill(self) -> None:
        """kill -9 of the main process and its pool (the worker leads its process group)."""
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=10)


@pytest.fixture
def step_worker(
    worker_env: dict[str, str], clean_redis: None, transactional_db: None
) -> Iterator[Callable[..., StepWorker]]:
    started: list[StepWorker] = []

    def start(
        name: str = "steps", concurrency: int = 1, imports: tuple[str, ...] = (), **env: str
    ) -> StepWorker:
        """A worker; `imports`: more modules it loads (-I), e.g. receivers of the events."""
        worker = StepWorker(name, {**worker_env, **env}, concurrency, imports)
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.stop()


def ended(job_id: str) -> Job | None:
    job = Job.objects.filter(id=job_id).first()
    return job if job is not None and job.state in (JobState.SUCCEEDED, JobState.DEAD) else None


def runs(key: str) -> int:
    return len(marks(key))


def history(job_id: str) -> list[tuple[str, str, int]]:
    return [(s.name, s.state, s.attempts) for s in JobStep.objects.of_job(job_id)]


def test_a_failing_third_step_is_retried_without_running_the_first_two(step_worker, unique):
    # given: a worker and a 3-step job whose third step fails twice, then succeeds
    step_worker()
    handle = step_tasks.three.enqueue(unique, fail_times=2)

    # when: it runs to its end
    job = wait_until(functools.partial(ended, handle.id), timeout=TIMEOUT, what="the job")

    # then: it succeeded on its third attempt, steps 1 and 2 ran once each, step 3 three times
    assert job.state == JobState.SUCCEEDED, job.error
    assert job.attempts == 3 and len(job.failures) == 2
    assert job.result == [{"rows": [1, 2, 3]}, 6, "total 6"]
    assert (runs(f"{unique}:one"), runs(f"{unique}:two"), runs(f"{unique}:three")) == (1, 1, 3)
    # and the history shows each step's attempts
    assert history(handle.id) == [
        ("fetch", StepState.SUCCEEDED, 1),
        ("sum", StepState.SUCCEEDED, 1),
        ("post", StepState.SUCCEEDED, 3),
    ]
    post = JobStep.objects.get(job_id=handle.id, name="post")
    assert post.job_attempt == 3 and post.result == "total 6" and post.error == ""
    assert post.result_bytes == len('"total 6"') and post.duration is not None


def test_a_worker_killed_during_step_two_does_not_rerun_step_one(step_worker, unique):
    # given: a worker with short leases, whose job stalls in its second step
    first = step_worker("steps-killed", BACKLOT_LEASE_SECONDS="3")
    handle = step_tasks.three.enqueue(unique, stall=120)
    wait_until(lambda: runs(f"{unique}:two"), timeout=TIMEOUT, what="step 2 to start")
    assert JobStep.objects.get(job_id=handle.id, name="sum").state == StepState.RUNNING

    # when: kill -9 of the worker; another one starts, and the relay sweeps the lapsed lease
    first.kill()
    step_worker("steps-after", BACKLOT_LEASE_SECONDS="3")

    def swept() -> Job | None:
        job_relay()
        return ended(handle.id)

    job = wait_until(swept, timeout=90, interval=0.5, what="the job to end on the second worker")

    # then: step 1 ran once, step 2 twice (the killed run and the next), the job succeeded
    assert job.state == JobState.SUCCEEDED, job.error
    assert (runs(f"{unique}:one"), runs(f"{unique}:two"), runs(f"{unique}:three")) == (1, 2, 1)
    assert history(handle.id) == [
        ("fetch", StepState.SUCCEEDED, 1),
        ("sum", StepState.SUCCEEDED, 2),
        ("post", StepState.SUCCEEDED, 1),
    ]


def test_a_job_dead_at_step_three_replayed_does_not_rerun_steps_one_and_two(
    step_worker, unique, admin_client
):
    # given: a job that dies at its third step (two attempts, both failing there)
    step_worker()
    handle = step_tasks.three_dies.enqueue(unique, fail_times=2)
    dead = wait_until(functools.partial(ended, handle.id), timeout=TIMEOUT, what="the job")
    assert dead.state == JobState.DEAD
    assert (runs(f"{unique}:one"), runs(f"{unique}:two"), runs(f"{unique}:three")) == (1, 1, 2)
    letter = DeadLetter.objects.get(job_id_value=handle.id)

    # when: an operator replays its dead letter from the admin's dead-letter list
    response = admin_client.post(
        "/admin/jobs/deadletter/",
        {"action": "replay_selected", "_selected_action": [letter.pk]},
        follow=True,
    )
    assert response.status_code == 200
    letter.refresh_from_db()
    assert letter.replayed_job_id is not None
    job = wait_until(
        functools.partial(ended, str(letter.replayed_job_id)), timeout=TIMEOUT, what="the replay"
    )

    # then: the new job succeeded with the first two steps' stored results, not run again
    assert job.state == JobState.SUCCEEDED, job.error
    assert job.result == [{"rows": [1, 2, 3]}, 6, "total 6"]
    assert (runs(f"{unique}:one"), runs(f"{unique}:two"), runs(f"{unique}:three")) == (1, 1, 3)
    copied = {s.name: s.copied_from for s in JobStep.objects.of_job(job.id)}
    assert copied == {"fetch": dead.id, "sum": dead.id, "post": None}


def test_a_changed_step_order_is_an_error_naming_the_step(step_worker, unique):
    # given: a job whose first run asks for steps a, b and fails; its retry asks for b first
    step_worker()
    handle = step_tasks.reordered.enqueue(unique)

    # when: it runs
    job = wait_until(functools.partial(ended, handle.id), timeout=TIMEOUT, what="the job")

    # then: the retry gives up at once, with an error naming the step and the stored one
    assert job.state == JobState.DEAD and job.attempts == 2
    assert "StepOrderChanged" in job.error
    assert "step 'b' is step 1 of this run" in job.error and "step 'a' there" in job.error
    assert (runs(f"{unique}:a"), runs(f"{unique}:b")) == (1, 1)

    # and a step asked for inside another step's function is refused the same way
    nested = step_tasks.nested.enqueue(unique)
    job = wait_until(functools.partial(ended, nested.id), timeout=TIMEOUT, what="nested")
    assert job.state == JobState.DEAD and job.attempts == 1
    assert "step 'inner' was asked for inside step 'outer'" in job.error
    assert not runs(f"{unique}:inner")


def test_the_decorator_form_and_the_size_check(step_worker, unique):
    # given: a worker, a job using the decorator form and one whose step returns too much
    step_worker()
    decorated = step_tasks.decorated.enqueue(unique)
    large = step_tasks.too_large.enqueue(70 * 1024)

    # then: the decorated step ran once though the job ran twice
    job = wait_until(functools.partial(ended, decorated.id), timeout=TIMEOUT, what="decorated")
    assert job.state == JobState.SUCCEEDED and job.result == 1 and job.attempts == 2
    assert runs(f"{unique}:count") == 1

    # and the oversized result is refused like an oversized payload: dead at once, not stored
    job = wait_until(functools.partial(ended, large.id), timeout=TIMEOUT, what="too large")
    assert job.state == JobState.DEAD and job.attempts == 1
    assert "StepResultTooLarge" in job.error and "MAX_PAYLOAD_BYTES" in job.error
    step = JobStep.objects.get(job_id=large.id, name="big")
    assert step.state == StepState.FAILED and step.result is None


def test_a_step_result_must_be_small_json():
    assert stored_result("ok", ("a", 1)) == ["a", 1]  # what a later run reads back
    with pytest.raises(StepResultTooLarge, match="not JSON-serializable"):
        stored_result("bad", object())
    with pytest.raises(StepResultTooLarge, match="over the 65536-byte limit"):
        stored_result("big", "x" * 65536)


def test_a_durable_sleep_holds_no_worker_and_resumes_once(step_worker, unique):
    # given: a worker of one process, and a job that sleeps 5 s between two steps
    step_worker("steps-sleep", concurrency=1)
    handle = step_tasks.napper.enqueue(unique, 5)
    wait_until(lambda: runs(f"{unique}:before"), timeout=TIMEOUT, what="the first step")
    slept = wait_until(
        lambda: Job.objects.filter(id=handle.id, state=JobState.SCHEDULED).first(),
        timeout=TIMEOUT,
        what="the job to sleep",
    )
    assert slept.scheduled_for > timezone.now() + timedelta(seconds=2)
    assert slept.attempts == 0  # the sleep gave its attempt back

    # when: another job is sent while it sleeps
    step_tasks.quick.enqueue(f"{unique}:other")

    # then: the one worker process runs it meanwhile
    wait_until(lambda: runs(f"{unique}:other"), timeout=TIMEOUT, what="the other job")
    assert not runs(f"{unique}:after")
    # and the sleeper resumes once, ~5 s later, at its next step
    job = wait_until(functools.partial(ended, handle.id), timeout=TIMEOUT, what="the sleeper")
    assert job.state == JobState.SUCCEEDED and job.result == "rested"
    assert job.attempts == 1 and job.failures == []
    (before,), (after,), (other,) = (
        marks(f"{unique}:before"),
        marks(f"{unique}:after"),
        marks(f"{unique}:other"),
    )
    assert before[0] < other[0] < after[0]
    assert after[0] - before[0] >= 5  # never early
    assert history(handle.id) == [
        ("before", StepState.SUCCEEDED, 1),
        ("sleep-2", StepState.SUCCEEDED, 1),
        ("after", StepState.SUCCEEDED, 1),
    ]


def test_a_sleep_survives_its_worker_stopping_and_a_redis_flush(step_worker, unique):
    # given: a job asleep for 5 s between two steps
    first = step_worker("steps-nap-a")
    handle = step_tasks.napper.enqueue(unique, 5)
    slept = wait_until(
        lambda: Job.objects.filter(id=handle.id, state=JobState.SCHEDULED).first(),
        timeout=TIMEOUT,
        what="the job to sleep",
    )

    # when: its worker stops, Redis loses every message (its wake-up's countdown with them),
    # and a new worker starts once the wake-up time has passed
    first.stop()
    client = redis_client()
    kept = (b"_kombu.", b"test:")  # exchange bindings, and the test's own counts
    client.delete(*[k for k in client.scan_iter(count=1000) if not k.startswith(kept)])
    wait_until(lambda: timezone.now() > slept.scheduled_for, timeout=10, what="the wake-up time")
    step_worker("steps-nap-b")

    # then: the relay finds the due row's message missing and sends it; it resumes once
    def swept() -> Job | None:
        job_relay()
        return ended(handle.id)

    job = wait_until(swept, timeout=90, interval=0.5, what="the sleeper to resume")
    assert job.state == JobState.SUCCEEDED and job.attempts == 1
    assert (runs(f"{unique}:before"), runs(f"{unique}:after")) == (1, 1)


def parked(job_id: str) -> Job | None:
    return Job.objects.filter(id=job_id, state=JobState.SCHEDULED).first()


def test_a_signal_wakes_a_job_parked_in_wait_for(step_worker, unique):
    # given: a job parked in wait_for("approved"), no worker held
    step_worker()
    handle = step_tasks.waiter.enqueue(unique)
    wait_until(functools.partial(parked, handle.id), timeout=TIMEOUT, what="the job to wait")
    assert runs(f"{unique}:before") == 1

    # when: the event is signalled
    assert jobs.signal(handle.id, "approved", {"by": 7}) is True

    # then: the job resumes at once with the payload, its first step not run again
    job = wait_until(functools.partial(ended, handle.id), timeout=TIMEOUT, what="the job")
    assert job.state == JobState.SUCCEEDED and job.result == {"by": 7}
    assert job.attempts == 1
    assert (runs(f"{unique}:before"), runs(f"{unique}:after")) == (1, 1)
    # and a signal to a finished job, or to no job, is refused
    with pytest.raises(jobs.SignalRefused, match="finished"):
        jobs.signal(handle.id, "approved", {"by": 8})
    with pytest.raises(Job.DoesNotExist):
        jobs.signal(str(uuid.uuid4()), "approved")


def test_a_signal_sent_before_the_wait_is_kept_and_a_second_is_refused(step_worker, unique):
    # given: a job no worker has run yet, signalled twice
    handle = step_tasks.waiter.enqueue(unique)
    assert jobs.signal(handle.id, "approved", "first") is False  # kept for its wait
    with pytest.raises(jobs.SignalRefused, match="already got signal 'approved'"):
        jobs.signal(handle.id, "approved", "second")

    # when: a worker runs it
    step_worker()
    job = wait_until(functools.partial(ended, handle.id), timeout=TIMEOUT, what="the job")

    # then: its wait returns the first signal's payload without parking
    assert job.state == JobState.SUCCEEDED and job.result == "first" and job.attempts == 1
    assert [s.state for s in JobStep.objects.of_job(handle.id)] == [StepState.SUCCEEDED] * 3


def test_a_wait_for_times_out(step_worker, unique):
    step_worker()
    handle = step_tasks.waiter.enqueue(unique, 2)

    job = wait_until(functools.partial(ended, handle.id), timeout=TIMEOUT, what="the job")

    assert job.state == JobState.SUCCEEDED and job.result == "timed out"
    (before,), (after,) = marks(f"{unique}:before"), marks(f"{unique}:after")
    assert after[0] - before[0] >= 2
    wait = JobStep.objects.get(job_id=handle.id, name="wait:approved")
    assert (wait.kind, wait.result) == ("wait", {"timed_out": True})
