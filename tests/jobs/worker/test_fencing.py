"""Fencing: a run that lost its claim changes nothing, and stops itself before its lease lapses.

Real worker processes, Redis and PostgreSQL: a stopped worker whose job another worker took
over (SIGSTOP past a short lease, the relay re-queues it, a second worker runs it, SIGCONT),
and a worker cut off from the database (through a TCP proxy the test closes) whose job learns
it lost its claim before the lease expires. The ledger's fenced writes are checked directly
too, against the real database.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from functools import partial
from typing import Any

import pytest
from django.conf import settings
from django.db import connection
from django.utils import timezone

from jobs import LeaseLost, ledger
from jobs.broker.redis import redis_client, redis_text
from jobs.flow.relay import MISSING_RESENT, job_relay
from jobs.models import Effect, Job, JobState
from jobs.testing import Worker as PlatformWorker
from jobs.worker.effects import effect_once
from jobs.worker.lease import FENCING, Hold, holding
from jobs.worker.outcomes import DELIVERIES
from tests.conftest import LOG_DIR, ROOT, marks, set_flag, wait_until
from tests.support import fencing_jobs

# Short leases so the takeover happens in seconds: the stopped run's lease lapses after LEASE.
LEASE = "3"


class FencingWorker(PlatformWorker):
    """A real worker of the project that loads the fencing jobs besides the test jobs."""

    def __init__(self, name: str, env: dict[str, str], concurrency: int = 1) -> None:
        super().__init__(
            "config",
            queues="reports",
            concurrency=concurrency,
            name=name,
            env=env,
            cwd=ROOT,
            log_dir=LOG_DIR,
            extra_args=[
                "-I",
                "tests.support.tasks,tests.support.fencing_jobs",
                "--without-gossip",
                "--without-mingle",
                "--without-heartbeat",
                "-l",
                "INFO",
            ],
        )

    def signal_all(self, sig: int) -> None:
        """The main process and its pool (the worker leads its own process group)."""
        os.killpg(self.process.pid, sig)


@pytest.fixture
def fencing_worker(
    worker_env: dict[str, str], clean_redis: None, transactional_db: None
) -> Iterator[Callable[..., FencingWorker]]:
    started: list[FencingWorker] = []

    def start(name: str, concurrency: int = 1, **env: str) -> FencingWorker:
        worker = FencingWorker(name, {**worker_env, **env}, concurrency)
        started.append(worker)
        return worker

    yield start
    for worker in started:
        if worker.process.poll() is None:
            worker.signal_all(signal.SIGCONT)  # a stopped worker cannot stop itself
            worker.stop()


def fencing_counts() -> dict[str, int]:
    raw = redis_client().hgetall(FENCING)
    return {redis_text(k): int(v) for k, v in raw.items()}


def relay_until(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    """Run the relay's sweep (what `manage.py jobs relay` and beat run) until `predicate`."""

    def swept() -> Any:
        job_relay()
        return predicate()

    return wait_until(swept, timeout=timeout, interval=0.25, what=what)


def test_a_stopped_run_whose_job_was_taken_over_has_its_effect_and_finish_refused(
    fencing_worker: Callable[..., FencingWorker], unique: str
) -> None:
    # given: worker A (3 s leases) runs two jobs that stall; one will re-raise LeaseLost, the
    # other swallows it and returns, so that its finish reaches the ledger and is refused there.
    # Their runs write their claims as they start (DEFER_CLAIM off): this is the claimed run's
    # fence; an unclaimed run's takeover is tests/system/faults/test_deferred_claim.py's.
    first = fencing_worker(
        "fence-a", concurrency=2, BACKLOT_LEASE_SECONDS=LEASE, BACKLOT_DEFER_CLAIM="0"
    )
    raising, swallowing = f"{unique}-r", f"{unique}-s"
    jobs = {
        raising: fencing_jobs.stalls.enqueue(raising),
        swallowing: fencing_jobs.stalls.using().enqueue(swallowing, swallow=True),
    }
    for key in jobs:
        wait_until(partial(marks, f"{key}:stalling"), timeout=60, what=f"{key} to start")
    claims = {key: Job.objects.get(id=handle.id).lease_owner for key, handle in jobs.items()}

    # when: A stops (main process and pool) past its lease; the relay re-queues both jobs and
    # worker B runs them to success
    first.signal_all(signal.SIGSTOP)
    stopped_at = time.monotonic()
    ids = [handle.id for handle in jobs.values()]
    relay_until(
        lambda: Job.objects.filter(id__in=ids, state=JobState.QUEUED).count() == 2,
        timeout=60,
        what="the lapsed leases to be re-queued",
    )
    assert time.monotonic() - stopped_at >= float(LEASE) - 0.5  # not before the lease lapsed
    second = fencing_worker("fence-b", concurrency=2)
    relay_until(
        lambda: Job.objects.filter(id__in=ids, state=JobState.SUCCEEDED).count() == 2,
        timeout=90,
        what="worker B to run both jobs",
    )
    # then A resumes: its runs go on from where they stopped
    first.signal_all(signal.SIGCONT)
    for key in jobs:
        set_flag(f"{key}:resume")
    for key in jobs:
        wait_until(partial(marks, f"{key}:lost"), timeout=60, what=f"{key}'s LeaseLost")
    wait_until(
        lambda: (
            fencing_counts().get("refused:succeed", 0) >= 1
            and fencing_counts().get("refused:finish", 0) >= 1
        ),
        timeout=30,
        what="the stopped runs' finishes to be refused",
    )

    # then: each effect happened once, by the second run; the jobs end as the second runs left
    # them; the first runs' effect_once and finishes were refused, logged and counted
    for key, handle in jobs.items():
        job = Job.objects.get(id=handle.id)
        assert job.state == JobState.SUCCEEDED
        assert job.result == "run 2", (key, job.result)
        assert job.attempts == 2
        assert job.lease_owner is None or job.lease_owner != claims[key]
        assert [value for _, value in marks(f"{key}:applied")] == ["2"]
        assert [value for _, value in marks(f"{key}:lost")] == ["1:renewals failed"]
        assert Effect.objects.filter(key=f"fencing:{key}").count() == 1
    counts = fencing_counts()
    assert counts.get("refused:effect", 0) >= 2, counts
    assert counts.get("lost:renewals_failed", 0) >= 2, counts
    log = first.output()
    assert "lost its claim" in log and "was refused" in log
    # A is alive and well: it goes on taking jobs
    after = fencing_jobs.stalls.enqueue(f"{unique}-after")
    set_flag(f"{unique}-after:resume")
    wait_until(
        lambda: Job.objects.get(id=after.id).state == JobState.SUCCEEDED,
        timeout=60,
        what="a later job",
    )
    second.stop()


def test_a_run_that_stopped_itself_in_time_frees_its_claim_and_the_job_runs_again(
    fencing_worker: Callable[..., FencingWorker], unique: str
) -> None:
    # given: a worker with 3 s leases running a job that stalls
    worker = fencing_worker("fence-d", BACKLOT_LEASE_SECONDS=LEASE)
    handle = fencing_jobs.stalls.enqueue(unique)
    wait_until(partial(marks, f"{unique}:stalling"), timeout=60, what="the job to start")

    # when: the worker is stopped past 80 % of its lease, and nobody takes the job over (no
    # relay sweeps, no other worker)
    worker.signal_all(signal.SIGSTOP)
    time.sleep(float(LEASE))  # the stop itself: what is measured is what the job does after it
    worker.signal_all(signal.SIGCONT)
    set_flag(f"{unique}:resume")

    # then: the run stops on LeaseLost, frees the claim it still held and hands its message
    # back; the next run applies the effect and the job succeeds, without waiting for a relay
    wait_until(
        lambda: Job.objects.get(id=handle.id).state == JobState.SUCCEEDED,
        timeout=60,
        what="the job to run again",
    )
    job = Job.objects.get(id=handle.id)
    assert job.result == "run 2" and job.attempts == 2
    assert [value for _, value in marks(f"{unique}:lost")] == ["1:renewals failed"]
    assert [value for _, value in marks(f"{unique}:applied")] == ["2"]
    assert int(redis_client().hget(DELIVERIES, "released_lost") or 0) == 1


class CuttableProxy:
    """A TCP proxy to PostgreSQL that the test can cut (every connection closed, new ones
    refused: the database is unreachable for the processes behind it) and restore."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.port = 0
        self.pairs: list[tuple[socket.socket, socket.socket]] = []
        self.lock = threading.Lock()
        self.listener: socket.socket | None = None
        self.open()

    def open(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self.port = listener.getsockname()[1]
        self.listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # cut
            try:
                server = socket.create_connection(self.upstream, timeout=5)
                server.settimeout(None)
            except OSError:
                client.close()
                continue
            with self.lock:
                self.pairs.append((client, server))
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for end in (source, sink):
                with contextlib.suppress(OSError):
                    end.shutdown(socket.SHUT_RDWR)

    def cut(self) -> None:
        assert self.listener is not None
        self.listener.close()
        self.listener = None
        with self.lock:
            pairs, self.pairs = self.pairs, []
        for pair in pairs:
            for end in pair:
                with contextlib.suppress(OSError):
                    end.shutdown(socket.SHUT_RDWR)
                end.close()

    def close(self) -> None:
        if self.listener is not None:
            self.cut()


@pytest.fixture
def db_proxy() -> Iterator[CuttableProxy]:
    db = settings.DATABASES["default"]
    proxy = CuttableProxy((db["HOST"], int(db["PORT"])))
    yield proxy
    proxy.close()


def test_a_run_whose_renewals_fail_raises_lease_lost_before_its_lease_expires(
    fencing_worker: Callable[..., FencingWorker], db_proxy: CuttableProxy, unique: str
) -> None:
    # given: a worker that reaches PostgreSQL through a proxy, with 6 s leases, running a job
    # that reports progress every 50 ms
    db = settings.DATABASES["default"]
    url = f"postgres://{db['USER']}:{db['PASSWORD']}@127.0.0.1:{db_proxy.port}/{db['NAME']}"
    worker = fencing_worker("fence-c", DATABASE_URL=url, BACKLOT_LEASE_SECONDS="6")
    handle = fencing_jobs.watches.enqueue(unique)
    wait_until(lambda: marks(f"{unique}:running"), timeout=60, what="the job to run")
    wait_until(
        lambda: Job.objects.get(id=handle.id).progress_done >= 20,
        timeout=30,
        what="a second of progress",
    )  # a renewal has gone through (every 2 s) by the time of the cut, more or less

    # when: the database becomes unreachable for that worker (connections cut, new ones
    # refused); the lease in the ledger is what the last renewal left
    db_proxy.cut()
    cut_at = time.time()
    expires = Job.objects.get(id=handle.id).lease_expires_at
    assert expires is not None

    # then: the job raises LeaseLost inside itself before its lease expires
    lost = wait_until(lambda: marks(f"{unique}:lost"), timeout=30, what="LeaseLost in the job")
    learnt_at, reason = lost[0]
    assert reason == "renewals failed"
    assert learnt_at < expires.timestamp(), (
        f"learnt {learnt_at - cut_at:.2f}s after the cut, lease expired "
        f"{expires.timestamp() - cut_at:.2f}s after it"
    )
    margin = expires.timestamp() - learnt_at
    # and once the database is back, the relay re-queues the job after its lease and the
    # worker runs it again to success
    db_proxy.open()
    relay_until(
        lambda: Job.objects.get(id=handle.id).state == JobState.SUCCEEDED,
        timeout=90,
        what="the job to run again",
    )
    job = Job.objects.get(id=handle.id)
    assert job.result == "run 2" and job.attempts == 2
    assert fencing_counts().get("lost:renewals_failed", 0) >= 1
    assert "Could not renew the lease" in worker.output()
    print(
        f"\nfencing: LeaseLost {learnt_at - cut_at:.2f}s after the cut, {margin:.2f}s before expiry"
    )


# --- the ledger's fence, directly against the database -----------------------------------
def _taken_over(job_id: str) -> tuple[ledger.Claim, ledger.Claim]:
    """Claim the job, let its lease lapse, claim it again: (the lost claim, the new one)."""
    old = ledger.claim(job_id=job_id, lease_seconds=30)
    assert old is not None
    Job.objects.filter(id=job_id).update(lease_expires_at=timezone.now() - timedelta(seconds=1))
    new = ledger.claim(job_id=job_id, lease_seconds=30)
    assert new is not None and new.lease_owner != old.lease_owner
    return old, new


@pytest.fixture
def queued_job(transactional_db: None) -> str:
    job = Job.objects.create(id=uuid.uuid4(), task_name="tests.add", args=[1, 2], queue="default")
    return str(job.id)


def test_every_write_of_a_lost_claim_is_refused_and_the_new_claim_holds(queued_job: str) -> None:
    old, new = _taken_over(queued_job)
    same: dict[str, Any] = {"job_id": queued_job, "lease_owner": old.lease_owner}
    # the lost claim (even with the attempt number matched) changes nothing
    for attempt in (old.attempt, new.attempt):
        args: dict[str, Any] = {**same, "attempt": attempt}
        assert not ledger.renew(**args, lease_seconds=30)
        assert not ledger.progress(**args, done=1, total=2, message="m")
        assert not ledger.succeed(**args, run_seconds=0.1, result="stale")
        assert (
            ledger.retry_later(
                **args, failures=[], exc=ConnectionError("x"), delay=1, run_seconds=0.1
            )
            is None
        )
        assert not ledger.run_cancelled(**args)
        ledger.release(**args)
        assert (
            ledger.give_up(
                job_id=queued_job,
                defaults=ledger.Defaults("tests.add", "default", 5),
                args=[1, 2],
                kwargs={},
                attempt=attempt,
                exc=ConnectionError("x"),
                claimed_attempt=attempt,
                lease_owner=old.lease_owner,
            )
            is None
        )
    job = Job.objects.get(id=queued_job)
    assert job.state == JobState.RUNNING and str(job.lease_owner) == new.lease_owner
    assert job.progress_total is None and job.result is None
    # the new one writes
    assert ledger.progress(
        job_id=queued_job, attempt=new.attempt, lease_owner=new.lease_owner, done=1, total=2,
        message="m",
    )  # fmt: skip
    assert ledger.succeed(
        job_id=queued_job, attempt=new.attempt, lease_owner=new.lease_owner, run_seconds=0.1,
        result=3,
    )  # fmt: skip
    assert Job.objects.get(id=queued_job).result == 3


def test_effect_once_of_a_lost_claim_rolls_back_with_its_writes(queued_job: str) -> None:
    # given: a run whose process still believes it holds the claim (its renewals were fine),
    # while the ledger gave the job to another run
    old, new = _taken_over(queued_job)
    hold = Hold(queued_job, old.attempt, old.lease_owner, 30.0, time.monotonic())

    # when: it applies an effect with a database write of its own
    with holding(hold), pytest.raises(LeaseLost), effect_once(f"fence:{queued_job}") as effect:
        assert not effect.done
        Effect.objects.create(key=f"domain-write:{queued_job}")  # the block's own write

    # then: neither the effect record nor the block's write committed; the new run applies it
    assert not Effect.objects.filter(key__in=[f"fence:{queued_job}", f"domain-write:{queued_job}"])
    assert hold.lost == "taken over"
    current = Hold(queued_job, new.attempt, new.lease_owner, 30.0, time.monotonic())
    with holding(current), effect_once(f"fence:{queued_job}") as effect:
        assert not effect.done
    assert Effect.objects.filter(key=f"fence:{queued_job}").count() == 1
    assert connection.in_atomic_block is False


def test_a_run_past_its_deadline_is_lost_without_asking_the_database(queued_job: str) -> None:
    claim = ledger.claim(job_id=queued_job, lease_seconds=30)
    assert claim is not None
    # confirmed 25 s ago: 80 % of a 30 s lease has passed with no renewal
    hold = Hold(queued_job, claim.attempt, claim.lease_owner, 30.0, time.monotonic() - 25)
    with (
        holding(hold),
        pytest.raises(LeaseLost, match="renewals failed"),
        effect_once(f"late:{queued_job}"),
    ):
        pass
    assert not Effect.objects.filter(key=f"late:{queued_job}").exists()


# --- the lost message (issue 17, item 3) ---------------------------------------------------
def _held_back(pid: int) -> str | None:
    """The command a client of process `pid` sent and Redis holds back (CLIENT PAUSE WRITE
    postpones the fetch script and the BRPOP on the bells): "evalsha", "brpop" or None."""
    from tests.support.redis_clients import clients_of

    for client in clients_of(pid):
        if client.get("cmd") in ("evalsha", "brpop") and "b" in client["flags"]:
            return str(client["cmd"])
    return None


def _stop_with_its_fetch_sent(worker: FencingWorker) -> None:
    """Stop the worker's main process right after it sent the fetch, with Redis paused for
    writes (the fetch waits in Redis unrun): the caller unpauses, Redis runs the fetch and its
    reply waits in the stopped worker's socket. The worker is stopped when this is called, a
    message and its bell published."""
    client, pid = redis_client(), worker.process.pid
    for _ in range(3):
        os.kill(pid, signal.SIGCONT)
        sent = wait_until(lambda: _held_back(pid), timeout=20, what="the consumer's next call")
        os.kill(pid, signal.SIGSTOP)
        if sent == "evalsha":
            return
        # it was about to wait for a bell: let that BRPOP run (its reply, a bell or the 1 s
        # timeout, waits in the stopped worker's socket); then the next call is the fetch
        client.client_unpause()
        wait_until(lambda: _held_back(pid) is None, timeout=10, what="the bell wait to end")
        client.client_pause(60_000, all=False)
    raise AssertionError("the worker never sent its fetch")


def _held_anywhere(job_id: str) -> bool:
    """Whether Redis holds a message of the job: waiting in a list, or taken and unacked."""
    return _in_lists(job_id) or _unacked_tag(job_id) is not None


def _in_lists(job_id: str) -> bool:
    from jobs.broker.queues import queue_keys

    client = redis_client()
    return any(
        job_id.encode() in raw for key in queue_keys("reports") for raw in client.lrange(key, 0, -1)
    )


def _unacked_tag(job_id: str) -> str | None:
    """The delivery tag under which `unacked` holds the job's message, if it does."""
    for tag, stored in redis_client().hgetall("unacked").items():
        if job_id.encode() in stored:
            return redis_text(tag)
    return None


def _succeeded(job_id: str) -> bool:
    return Job.objects.get(id=job_id).state == JobState.SUCCEEDED


def test_a_worker_killed_between_its_fetch_and_the_delivery_loses_no_message(
    fencing_worker: Callable[..., FencingWorker], unique: str, settings: Any
) -> None:
    from jobs.broker.reservations import OWNERS, RESTORED

    settings.BACKLOT = {
        **settings.BACKLOT,
        "ATOMIC_FETCH": True,
    }  # jobs.broker.fetch, and its bells
    # given: an idle worker, stopped, and a job published (its bell wakes the stopped
    # consumer's BRPOP); Redis then holds back every write (CLIENT PAUSE WRITE)
    taker = fencing_worker("lost-a", BACKLOT_ATOMIC_FETCH="1")
    os.kill(taker.process.pid, signal.SIGSTOP)
    handle = fencing_jobs.noted.enqueue(unique)
    client = redis_client()
    client.client_pause(60_000, all=False)
    try:
        # when: the worker, woken, sends its fetch and is stopped; Redis runs the fetch (the
        # message moves from its list to `unacked`, recorded as the worker's) and its reply
        # waits in the stopped worker's socket: the moment between the fetch and the delivery
        _stop_with_its_fetch_sent(taker)
    finally:
        client.client_unpause()
    tag = wait_until(lambda: _unacked_tag(handle.id), timeout=10, what="the fetch to run")
    taker.signal_all(signal.SIGKILL)
    taker.process.wait(timeout=10)
    lost_at = time.monotonic()

    # then: the message is in `unacked`, with its holder, not in any list
    assert not _in_lists(handle.id)
    assert redis_text(client.hget(OWNERS, tag) or b"").startswith(taker.name)
    job = Job.objects.get(id=handle.id)
    assert job.state == JobState.QUEUED and job.published_at is not None
    # and with another worker busy (a long job keeps `unacked` non-empty), the relay gives it
    # back once the dead worker's heartbeat lapsed (15 s), and it runs once
    busy = fencing_worker("lost-b", concurrency=2)
    fencing_jobs.sleeps.enqueue(f"{unique}:busy", 120)
    wait_until(lambda: marks(f"{unique}:busy"), timeout=30, what="the long job to start")
    busy_after = time.monotonic() - lost_at  # the second worker's start, on a loaded machine
    # (its mark is written before the run's finish: the finish is waited for as well)
    relay_until(lambda: marks(unique), timeout=90, what="the job to run")
    recovered = time.monotonic() - lost_at
    wait_until(lambda: _succeeded(handle.id), timeout=30, what="the job's finish")
    assert len(marks(unique)) == 1
    assert int(client.get(RESTORED) or 0) == 1  # restore_lost brought it back
    assert int(client.get(MISSING_RESENT) or 0) == 0  # not the relay's re-send
    # the heartbeat's 15 s from the kill and the sweep, or the sweep once the worker that
    # keeps `unacked` busy has started (which took 10-30 s on a loaded 2-core machine)
    assert recovered < max(45, busy_after + 30), (recovered, busy_after)
    print(f"\nfetched message restored and run {recovered:.1f}s after the kill")
    busy.signal_all(signal.SIGKILL)


def test_a_message_redis_lost_is_sent_again_by_the_relay(
    fencing_worker: Callable[..., FencingWorker], unique: str
) -> None:
    # given: a job published to a queue no worker consumes yet, whose message is then removed
    # by hand (what a failover to a replica that missed it, or a flush, does)
    handle = fencing_jobs.noted.enqueue(unique)
    client = redis_client()
    from jobs.broker.queues import queue_keys

    removed = 0
    for key in queue_keys("reports"):
        for raw in client.lrange(key, 0, -1):
            if handle.id.encode() in raw:
                removed += int(client.lrem(key, 0, redis_text(raw)))
    assert removed == 1 and not _held_anywhere(handle.id)
    lost_at = time.monotonic()
    # when: a worker starts on the queue, busy with a long job (`unacked` is never empty)
    busy = fencing_worker("resend", concurrency=2)
    fencing_jobs.sleeps.enqueue(f"{unique}:busy", 120)
    wait_until(lambda: marks(f"{unique}:busy"), timeout=30, what="the long job to start")
    # then: the relay finds the job's message missing and sends it again; it runs once
    relay_until(lambda: marks(unique), timeout=90, what="the lost job to run")
    recovered = time.monotonic() - lost_at
    wait_until(lambda: _succeeded(handle.id), timeout=30, what="the job's finish")
    assert len(marks(unique)) == 1
    assert recovered < 30, recovered  # MISSING_AFTER (4 s) after its publish, plus a run
    assert int(client.get(MISSING_RESENT) or 0) == 1
    print(f"\nlost message re-sent and run {recovered:.1f}s after its removal")
    busy.signal_all(signal.SIGKILL)
