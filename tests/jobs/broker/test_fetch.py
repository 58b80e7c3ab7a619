"""jobs.broker.fetch on real workers and a real Redis: the atomic fetch takes messages in kombu's
order, wakes on bells and polls for messages pushed without one, survives a flushed script cache,
gives kombu's BRPOP back when turned off, and costs one round trip per message.

The `reports` queue is these tests' own (the suite's session worker does not consume it). What
a worker sends Redis is read with MONITOR, kept to the connections of the worker's processes
(their sockets, from /proc), so that other clients of the same Redis do not count.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import redis
from celery.signals import before_task_publish
from django.test import override_settings
from kombu import Connection, Exchange, Queue
from kombu.asynchronous import Hub
from kombu.asynchronous import hub as kombu_hub
from kombu.transport import redis as kombu_redis

from jobs.broker import counters, fetch, reservations, running
from jobs.broker.protocol import BELL, BELL_CAP
from jobs.broker.queues import queue_keys
from jobs.broker.redis import redis_client
from jobs.broker.reservations import OWNERS, ReservingQoS
from jobs.core.conf import backlot_settings
from jobs.enqueue.fanout import enqueue_many
from jobs.models import Job, JobState
from tests.conftest import Worker, marks, wait_until
from tests.jobs.broker.test_redis_sentinel import MASTER
from tests.jobs.broker.test_redis_sentinel import sentinel_setup as sentinel_setup  # a fixture
from tests.support import redis_clients, tasks
from tests.support.redis_clients import socket_ports, waiting_for_a_bell

QUEUE = "reports"
# What names jobs.broker.fetch's script in a MONITOR line: its SHAs, or a line of its body.
FETCH_MARKS = (*fetch._SHAS, "local n = tonumber(ARGV[1])")


def worker_ports(worker: Worker, *, pool: bool = False) -> set[int]:
    pids = [worker.process.pid, *(worker.pool_pids() if pool else [])]
    return set().union(*(socket_ports(pid) for pid in pids))


class Monitor(redis_clients.Monitor):
    """What the platform's Redis runs while it is open (MONITOR), counted by command name."""

    def __init__(self) -> None:
        super().__init__(backlot_settings().REDIS_URL)

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop(redis_client())

    def calls(self, ports: set[int]) -> Counter[str]:
        """The commands clients on `ports` sent, by name (FETCH: jobs.broker.fetch's script;
        kombu runs scripts of its own)."""
        counted: Counter[str] = Counter()
        for _, port, text in list(self.lines):
            if not port.isdigit() or int(port) not in ports:
                continue
            name = text.split(" ", 1)[0].strip('"').upper()
            if name in ("EVALSHA", "EVAL") and any(sha in text for sha in FETCH_MARKS):
                name = "FETCH"
            counted[name] += 1
        return counted


def fetch_waiting(worker: Worker) -> bool:
    """The worker's consumer waits for a bell (BRPOP on `backlot:bell:<queue>`)."""
    return waiting_for_a_bell(worker.process.pid)


def in_queue(job_id: str) -> bool:
    client = redis_client()
    keys = [QUEUE, *(f"{QUEUE}:{step}" for step in range(1, 10))]
    return any(job_id.encode() in raw for key in keys for raw in client.lrange(key, 0, -1))


def scripts_loaded() -> list[bool]:
    return [bool(found) for found in redis_client().script_exists(*fetch._SHAS)]


def errors(kind: str) -> int:
    stats = redis_client().info("errorstats")
    return int(stats.get(f"errorstat_{kind}", {}).get("count", 0))


@pytest.fixture(autouse=True)
def atomic_fetch(settings: Any) -> None:
    """This process publishes with bells, whatever the project's default."""
    settings.BACKLOT = {**settings.BACKLOT, "ATOMIC_FETCH": True}


@pytest.fixture
def fetch_worker(
    start_worker: Callable[..., Worker], clean_redis: None, transactional_db: None
) -> Iterator[Callable[..., Worker]]:
    started: list[Worker] = []

    def start(name: str, concurrency: int = 1, **env: str) -> Worker:
        env = {"BACKLOT_ATOMIC_FETCH": "1", **env}
        worker = start_worker(name, queues=QUEUE, concurrency=concurrency, **env)
        started.append(worker)
        return worker

    redis_client().script_flush()
    yield start
    for worker in started:
        worker.stop()


@contextmanager
def publishing_without_bells() -> Iterator[None]:
    """This process publishes as kombu does (no bell), as another client of the queue would."""
    from django.conf import settings

    with override_settings(BACKLOT={**settings.BACKLOT, "ATOMIC_FETCH": False}):
        yield


@pytest.mark.parametrize("atomic", ["1", "0"], ids=["atomic-fetch", "kombu-brpop"])
def test_messages_of_every_priority_step_come_out_in_kombus_order(
    fetch_worker: Callable[..., Worker], unique: str, atomic: str
) -> None:
    # given: a backlog of two jobs per priority, enqueued out of order, no worker on the queue
    shuffled = [3, 9, 0, 5, 7, 1, 8, 2, 6, 4]
    for n in range(2):
        for priority in shuffled:
            tasks.prioritized.using(priority=priority).enqueue(unique, f"{priority}-{n}")

    # when: one single-process worker (prefetch 1: it takes one message at a time) drains it
    fetch_worker(f"order-{atomic}", BACKLOT_ATOMIC_FETCH=atomic)
    wait_until(lambda: len(marks(unique)) == 20, timeout=60, what="the backlog to drain")

    # then: highest priority first, first in first out within a priority, as kombu's BRPOP
    order = [label for _, label in marks(unique)]
    assert order == [f"{p}-{n}" for p in range(9, -1, -1) for n in range(2)]
    # and the fetch script ran (it took them). With the setting off, whether it is loaded says
    # nothing: the session's other workers share this Redis (test_with_the_setting_off_... reads
    # this worker's own calls instead).
    if atomic == "1":
        assert scripts_loaded()[0]


def test_a_message_pushed_without_a_bell_is_taken_within_the_poll(
    fetch_worker: Callable[..., Worker], unique: str
) -> None:
    # given: an idle worker waiting for a bell
    worker = fetch_worker("poll")
    wait_until(lambda: fetch_waiting(worker), timeout=30, what="the consumer waiting for a bell")
    # when: a message arrives with no bell (a client that is not Backlot's, or kombu's restore)
    with publishing_without_bells():
        pushed = time.monotonic()
        handle = tasks.prioritized.enqueue(unique, "quiet")
    # then: the worker's next fetch (its bell wait times out after 1 s) takes it
    wait_until(lambda: not in_queue(handle.id), timeout=10, interval=0.02, what="the fetch")
    quiet = time.monotonic() - pushed
    wait_until(lambda: marks(unique), timeout=30, what="the job to run")
    # and one with its bell is taken at once
    wait_until(lambda: fetch_waiting(worker), timeout=30, what="the consumer waiting again")
    pushed = time.monotonic()
    rung = tasks.prioritized.enqueue(unique, "rung")
    wait_until(lambda: not in_queue(rung.id), timeout=10, interval=0.02, what="the fetch")
    woken = time.monotonic() - pushed
    print(f"\ntaken {quiet:.2f}s after a push without a bell, {woken:.2f}s after one with it")
    assert quiet < 1.0 + 1.5, quiet  # the bell wait (1 s) and a loaded machine's slack
    assert woken < quiet, (woken, quiet)


def test_a_flushed_script_cache_is_reloaded_and_fetching_goes_on(
    fetch_worker: Callable[..., Worker], unique: str
) -> None:
    # given: a worker that has fetched with the script loaded
    worker = fetch_worker("noscript")
    tasks.prioritized.enqueue(unique, "before")
    wait_until(lambda: marks(unique), timeout=30, what="the first job")
    assert scripts_loaded()[0]
    # when: Redis loses its scripts (a restart, SCRIPT FLUSH)
    refused = errors("NOSCRIPT")
    redis_client().script_flush()
    tasks.prioritized.enqueue(unique, "after")
    # then: the fetch is refused once (NOSCRIPT), sent again in full, and the job runs
    wait_until(lambda: len(marks(unique)) == 2, timeout=30, what="the job after the flush")
    assert errors("NOSCRIPT") > refused
    assert scripts_loaded()[0]
    tasks.prioritized.enqueue(unique, "again")
    wait_until(lambda: len(marks(unique)) == 3, timeout=30, what="a job after the reload")
    assert worker.process.poll() is None
    assert "Traceback" not in worker.output()


def test_with_the_setting_off_the_worker_takes_messages_with_kombus_brpop(
    fetch_worker: Callable[..., Worker], unique: str
) -> None:
    worker = fetch_worker("kombu", BACKLOT_ATOMIC_FETCH="0")
    with Monitor() as monitor:
        tasks.prioritized.enqueue(unique, "plain")
        wait_until(lambda: marks(unique), timeout=30, what="the job")
        # the two-step record (BRPOP, then the MULTI) still names its holder
        ports = worker_ports(worker)
        wait_until(lambda: monitor.calls(ports)["BRPOP"] >= 2, timeout=10, what="the next BRPOP")
    calls = monitor.calls(ports)
    assert calls["FETCH"] == 0, calls  # this worker's own sockets: no fetch script, ever
    assert calls["MULTI"] >= 2, calls  # the unacked record, then the ack


def test_an_idle_worker_makes_few_redis_calls(fetch_worker: Callable[..., Worker]) -> None:
    # given: a worker on an empty queue, waiting for a bell
    worker = fetch_worker("idle")
    wait_until(lambda: fetch_waiting(worker), timeout=30, what="the consumer waiting")
    ports = worker_ports(worker)
    # when: it idles through 5 bell waits
    with Monitor() as monitor:
        started = time.monotonic()
        wait_until(lambda: monitor.calls(ports)["BRPOP"] >= 5, timeout=30, what="five bell waits")
        waited = time.monotonic() - started
    calls = monitor.calls(ports)
    print(f"\nidle worker over {waited:.1f}s: {dict(calls)}")
    # then: one fetch per wait (and kombu's own housekeeping), not a busy loop
    assert calls["FETCH"] <= calls["BRPOP"] + 1, calls
    housekeeping = sum(calls.values()) - calls["BRPOP"] - calls["FETCH"]
    assert housekeeping <= 10 * waited, calls


@pytest.mark.parametrize("atomic", ["1", "0"], ids=["atomic-fetch", "kombu-brpop"])
def test_round_trips_per_job_on_the_worker(
    fetch_worker: Callable[..., Worker], atomic: str
) -> None:
    jobs = int(os.environ.get("FETCH_DRAIN_JOBS", "200"))
    worker = fetch_worker(f"drain-{atomic}", BACKLOT_ATOMIC_FETCH=atomic)
    wait_until(lambda: worker_ports(worker), timeout=30, what="the worker's connections")
    with Monitor() as monitor:
        ids = enqueue_many(tasks.add, [((n, 1), {}) for n in range(jobs)], queue=QUEUE)
        wait_until(
            lambda: Job.objects.filter(id__in=ids, state=JobState.SUCCEEDED).count() == jobs,
            timeout=300,
            interval=0.5,
            what="the drain",
        )
        main = worker_ports(worker)
    calls = monitor.calls(main)
    per_job = {name: round(count / jobs, 2) for name, count in sorted(calls.items())}
    print(f"\nworker main process, {jobs} jobs, fetch={atomic}: per job {per_job}")
    assert redis_client().hlen(OWNERS) == 0  # every record went with its ack
    if atomic == "1":
        assert jobs <= calls["FETCH"] <= jobs * 1.1 + 20, calls  # one fetch per message
        assert calls["BRPOP"] <= jobs * 0.1 + 20, calls  # no bell wait in a backlog
        assert calls["MULTI"] <= jobs * 1.05 + 30, calls  # the ack only (and heartbeats)
    else:
        assert calls["BRPOP"] >= jobs and calls["FETCH"] == 0, calls
        assert calls["MULTI"] >= 2 * jobs, calls  # the unacked record, then the ack


# --- the fetch in this process, on kombu's own consumer (the sync poller) ------------------
@pytest.fixture
def fetching_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process' kombu channels take messages as a worker's do (undone after the test);
    outside a worker a channel has no holder (ReservingQoS.owner is None)."""
    channel = kombu_redis.Channel
    monkeypatch.setattr(channel, "QoS", ReservingQoS)
    monkeypatch.setattr(channel, "_brpop_start", fetch._brpop_start)
    monkeypatch.setattr(channel, "_brpop_read", fetch._brpop_read)
    monkeypatch.setattr(channel, "basic_consume", fetch._basic_consume)
    monkeypatch.setitem(fetch._state, "fetch", True)


@contextmanager
def delivered(
    url: str,
    options: dict[str, Any],
    raw: redis.Redis,
    prefix: str = "",
    headers: dict[str, Any] | None = None,
) -> Iterator[tuple[Any, str]]:
    """A task message (with `headers`) published on a queue of its own through `url` and
    taken with the fetch: yields the message (not acknowledged) and its queue's name, inside
    the consumer."""
    name = f"fetch-here-{uuid.uuid4().hex[:8]}"
    queue = Queue(name, Exchange(name), routing_key=name)
    got: list[Any] = []
    with Connection(url, transport_options=options) as connection:
        with connection.Producer() as producer:
            producer.publish(
                {"n": 1},
                exchange=queue.exchange,
                routing_key=name,
                declare=[queue],
                headers={"task": "tests.fetch_here", **(headers or {})},
                serializer="json",
            )
        assert raw.llen(f"{prefix}{BELL}{name}") == 1  # rung with the message
        with connection.Consumer(
            queue, callbacks=[lambda body, m: got.append(m)], accept=["json"]
        ) as consumer:
            channel: Any = consumer.channel
            assert isinstance(channel.qos, ReservingQoS)
            wait_until(lambda: _drain(connection) or got, timeout=20, what="the message")
            yield got[0], name
            # an empty fetch clears the bells (their messages are taken)
            _drain(connection)
            assert not raw.exists(f"{prefix}{BELL}{name}")


def take_one(url: str, options: dict[str, Any], raw: redis.Redis, prefix: str = "") -> None:
    """Publish a task message on a queue of its own through `url`, consume it with the fetch,
    and check what Redis holds before and after the ack."""
    with delivered(url, options, raw, prefix) as (message, name):
        stored = raw.hget(f"{prefix}unacked", message.delivery_tag)
        assert stored is not None and json.loads(stored)[1:] == [name, name]
        assert json.loads(stored)[0]["properties"]["delivery_tag"] == message.delivery_tag
        assert raw.zscore(f"{prefix}unacked_index", message.delivery_tag)
        assert not raw.hexists(f"{prefix}{OWNERS}", message.delivery_tag)  # no holder here
        assert raw.llen(f"{prefix}{name}") == 0
        message.ack()
        assert not raw.hexists(f"{prefix}unacked", message.delivery_tag)


def test_an_ack_carrying_counts_survives_a_count_that_redis_refuses(
    fetching_here: None, clean_redis: None
) -> None:
    from jobs.worker.celery import PRIORITY_TRANSPORT_OPTIONS

    # given: a run's counts left to the ack (a -P solo worker's), one of them for a metrics key
    # that is no hash (another program wrote it)
    url = backlot_settings().REDIS_URL
    raw = redis.Redis.from_url(url)
    broken, fine = "backlot:test:counts:broken", "backlot:test:counts:fine"
    raw.set(broken, "not a hash")
    with delivered(url, PRIORITY_TRANSPORT_OPTIONS, raw) as (message, _):
        assert message.channel.qos.carries_counts  # the broker's Redis is the platform's
        counters.carry()
        counters.add(broken, "finished")
        counters.add(fine, "finished")

        # when the message is acknowledged
        message.ack()

        # then the ack went through, the good count was written once, and nothing is held
        # back to be written again by the next flush
        assert not raw.hexists("unacked", message.delivery_tag)
        counters.flush()
        assert raw.hgetall(fine) == {b"finished": b"1"}
        assert counters.take() is None
        assert raw.get(broken) == b"not a hash"


@pytest.mark.parametrize("case", ["fresh", "busy", "unstamped", "failed"])
def test_a_deferring_worker_takes_a_stamped_messages_run_record_with_it(
    fetching_here: None, clean_redis: None, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    from jobs.worker.celery import PRIORITY_TRANSPORT_OPTIONS

    # given: a worker that runs its jobs in its own process with DEFER_CLAIM, and a message
    # stamped at its enqueue (or not), of a job whose run record another run may hold
    monkeypatch.setitem(fetch._state, "runs", True)
    url = backlot_settings().REDIS_URL
    raw = redis.Redis.from_url(url)
    job_id, other = str(uuid.uuid4()), str(uuid.uuid4())
    record = f"{running.PREFIX}{job_id}"
    if case == "busy":
        assert running.start(job_id, other, 30) == "ok"
    stamp = {} if case == "unstamped" else {running.BORN: [int(time.time() * 1000), None]}

    # when the fetch takes it
    with delivered(url, PRIORITY_TRANSPORT_OPTIONS, raw, headers={"id": job_id, **stamp}) as (
        message,
        _,
    ):
        taken = message.properties.get(fetch.RUN)

        # then a stamped message comes with its record's answer and the token it was taken
        # under, in the same step; an unstamped one with none (its run takes it, or claims)
        if case == "unstamped":
            assert taken is None and not raw.exists(record)
        else:
            token, answer = taken
            assert answer == ("busy" if case == "busy" else "ok")
            holder = other if case == "busy" else token
            assert raw.hget(record, "token") == holder.encode()
            reservations.ran(message, job_id, token)  # as its request does
            if case == "failed":
                running.end(job_id, token)  # a run that did not succeed in its one write

        # when it is acknowledged (its outcome in the row)
        message.ack()

        # then its own short success's record goes with the acknowledgement; another run's
        # stays, and so does a claimed one (the job's next delivery takes the claim path)
        if case == "fresh":
            assert not raw.exists(record)
        elif case == "busy":
            assert raw.hget(record, "token") == other.encode()
        elif case == "failed":
            assert raw.hget(record, "claimed") == b"1"


@pytest.mark.parametrize("case", ["handed", "handed back", "holder died"])
def test_a_prefork_fetch_takes_the_record_reserved_until_the_message_is_handed_to_the_pool(
    fetching_here: None, clean_redis: None, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    from jobs.worker.celery import PRIORITY_TRANSPORT_OPTIONS

    # given: a prefork worker deferring claims, with a pool process free, and a stamped message
    monkeypatch.setitem(fetch._state, "runs", True)
    monkeypatch.setitem(fetch._free, "now", lambda: True)
    url = backlot_settings().REDIS_URL
    raw = redis.Redis.from_url(url)
    job_id = str(uuid.uuid4())
    record = f"{running.PREFIX}{job_id}"
    stamp = {running.BORN: [int(time.time() * 1000), None]}
    at_delivery: list[list[Any]] = []
    kombu_deliver = kombu_redis.Transport._deliver

    def deliver(transport: Any, message: dict[str, Any], queue: str) -> None:
        if running.BORN not in message["headers"]:  # a copy sent back
            return kombu_deliver(transport, message, queue)
        at_delivery.append(raw.hmget(record, "token", "reserved"))
        if case == "handed back":  # no consumer for its queue any more (a pause cancelled it)
            return transport._reject_inbound_message(message)
        if case == "holder died":  # the sweep of a dead holder, between its fetch and delivery
            running.hold_absent([job_id])
        return kombu_deliver(transport, message, queue)

    monkeypatch.setattr(kombu_redis.Transport, "_deliver", deliver)

    # when the fetch takes it
    with delivered(url, PRIORITY_TRANSPORT_OPTIONS, raw, headers={"id": job_id, **stamp}) as (
        message,
        name,
    ):
        # then its record was taken with it, reserved (the message's) until its delivery
        ((token, reserved),) = at_delivery
        assert reserved == b"1"
        if case == "handed":
            # and once it is handed to the pool (delivered, not sent back), the record is the
            # run's (marked without waiting for the reply: the event loop's timer reads it), so
            # a copy meeting it is dropped, and the status says running
            assert message.properties[fetch.RUN] == [token.decode(), "ok"]
            wait_until(lambda: not raw.hexists(record, "reserved"), timeout=5, what="the mark")
            reservations.unanswered.read()
            assert raw.hget(record, "token") == token
            assert running.live([job_id]) == {job_id}
            assert running.start(job_id, str(uuid.uuid4()), 30) == "busy"
        elif case == "handed back":
            # and a message sent back to its queue undelivered took its record with it: its
            # copy (unstamped, the one delivered here) is not dropped as a duplicate
            assert fetch.RUN not in message.properties
            assert not raw.exists(record)
            assert running.start(job_id, str(uuid.uuid4()), 30) == "ok"
        else:
            # and a dead holder's reserved record is turned claimed by the sweep: the copy reads
            # the row (it runs, and counts no crash for a run that never started)
            assert raw.hmget(record, "token", "claimed") == [b"", b"1"]
            assert not raw.hexists(record, "reserved")
            assert running.start(job_id, str(uuid.uuid4()), 30) == "claimed"
        message.ack()
        raw.delete(name)


def test_a_stamped_message_requeued_goes_back_without_born(
    fetching_here: None, clean_redis: None
) -> None:
    from jobs.worker.celery import PRIORITY_TRANSPORT_OPTIONS

    # given: a stamped message taken by a consumer
    url = backlot_settings().REDIS_URL
    raw = redis.Redis.from_url(url)
    stamp = {running.BORN: [int(time.time() * 1000), None]}
    with delivered(url, PRIORITY_TRANSPORT_OPTIONS, raw, headers=stamp) as (message, name):
        # when it is requeued (a reject with requeue, as at a channel's close)
        message.reject(requeue=True)

        # then its copy in the queue says when it was sent no more: its run reads the row
        (copy,) = [json.loads(m) for m in raw.lrange(name, 0, -1)]
        assert copy["headers"]["task"] == "tests.fetch_here"
        assert running.BORN not in copy["headers"]
        raw.delete(name)


def test_a_solo_workers_ack_rides_with_its_next_fetch(
    fetching_here: None, clean_redis: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from jobs.worker.celery import PRIORITY_TRANSPORT_OPTIONS

    # given: a worker that runs its jobs in its event loop's thread (-P solo), whose run left
    # its counts to the ack, and two messages on its queue
    monkeypatch.setitem(fetch._state, "ride", True)
    monkeypatch.setitem(reservations._riding, "on", True)
    hub = Hub()
    monkeypatch.setattr(kombu_hub, "_current_loop", hub)
    url = backlot_settings().REDIS_URL
    raw = redis.Redis.from_url(url)
    counted = "backlot:test:counts:ride"
    name = f"fetch-ride-{uuid.uuid4().hex[:8]}"
    queue = Queue(name, Exchange(name), routing_key=name)
    got: list[Any] = []
    with Connection(url, transport_options=PRIORITY_TRANSPORT_OPTIONS) as connection:
        with connection.Producer() as producer:
            for n in range(2):
                producer.publish(
                    {"n": n},
                    exchange=queue.exchange,
                    routing_key=name,
                    declare=[queue],
                    headers={"task": "tests.fetch_here"},
                    serializer="json",
                )
        with connection.Consumer(queue, callbacks=[lambda body, m: got.append(m)], accept=["json"]):
            wait_until(lambda: _drain(connection) or got, timeout=20, what="the first message")
            first = got[0]
            counters.carry()
            counters.add(counted, "finished")
            # and its run's record (DEFER_CLAIM), which goes with its acknowledgement
            run_id, token = str(uuid.uuid4()), str(uuid.uuid4())
            assert running.start(run_id, token, 30) == "ok"
            reservations.ran(first, run_id, token)
            record = f"{running.PREFIX}{run_id}"

            # when the first is acknowledged
            first.ack()

            # then it waits for the next fetch, which settles it with the counts and drops its
            # run's record as it takes the second message: no round trip of its own
            assert raw.hexists("unacked", first.delivery_tag) and raw.exists(record)
            wait_until(lambda: _drain(connection) or len(got) > 1, timeout=20, what="the second")
            assert not raw.hexists("unacked", first.delivery_tag)
            assert not raw.exists(record)
            assert raw.zscore("unacked_index", first.delivery_tag) is None
            assert raw.hgetall(counted) == {b"finished": b"1"}
            assert raw.hexists("unacked", got[1].delivery_tag)

            # when the second is acknowledged and no fetch follows, it is settled on its own
            # within two rounds of RIDE_WAIT
            got[1].ack()
            assert raw.hexists("unacked", got[1].delivery_tag)
            wait_until(
                lambda: (
                    hub.fire_timers() is not None
                    and not raw.hexists("unacked", got[1].delivery_tag)
                ),
                timeout=5,
                interval=0.05,
                what="the ack no fetch took",
            )
    assert raw.hgetall(counted) == {b"finished": b"1"}  # counted once


def _drain(connection: Connection) -> bool:
    with contextlib.suppress(socket.timeout, TimeoutError):
        connection.drain_events(timeout=1.5)
    return False


def test_a_global_keyprefix_prefixes_every_key_of_the_fetch(
    fetching_here: None, clean_redis: None
) -> None:
    from jobs.worker.celery import PRIORITY_TRANSPORT_OPTIONS

    url = backlot_settings().REDIS_URL
    options = {**PRIORITY_TRANSPORT_OPTIONS, "global_keyprefix": "pfx:"}
    take_one(url, options, redis.Redis.from_url(url), prefix="pfx:")


def test_the_fetch_works_through_redis_sentinel(
    fetching_here: None, sentinel_setup: dict[str, Any]
) -> None:
    from jobs.worker.celery import PRIORITY_TRANSPORT_OPTIONS

    primary, sentinel = sentinel_setup["primary"], sentinel_setup["sentinel"]
    options = {**PRIORITY_TRANSPORT_OPTIONS, "master_name": MASTER}
    take_one(f"sentinel://127.0.0.1:{sentinel.port}/0", options, primary.client)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("path", ["backlot", "kombu"])
def test_a_fan_out_rings_a_queue_bell_at_most_bell_cap_times_per_flush(
    clean_redis: None, path: str
) -> None:
    # given: no worker on the queue, and what this process sends Redis (MONITOR, kept to its
    # own sockets: the server-wide LPUSH count took in another test process's publish once);
    # a host's receiver of before_task_publish sends the fan-out through kombu's batch instead
    # of Backlot's own messages (jobs.broker.protocol)
    def host_receiver(**_: object) -> None:
        pass

    if path == "kombu":
        before_task_publish.connect(host_receiver, weak=False)
    try:
        with Monitor() as monitor:
            # when: 1,000 jobs go out in one pipelined publish (a campaign's fan-out)
            ids = enqueue_many(
                tasks.add, [((n, 1), {}) for n in range(1000)], queue=QUEUE, on_commit=False
            )
            ours = socket_ports(os.getpid())
    finally:
        before_task_publish.disconnect(host_receiver)
    # then: every message is in the queue, and the bells did not double the commands: at most
    # BELL_CAP bells per queue for each flush (1,000 messages each), not one each
    assert sum(redis_client().llen(key) for key in queue_keys(QUEUE)) == len(ids) == 1000
    pushes = monitor.calls(ours)["LPUSH"]
    if path == "kombu":  # one LPUSH per message, and the bells'
        assert 0 < pushes - 1000 <= 2 * BELL_CAP, pushes
    else:  # one LPUSH of the 1,000 messages, one of their bell's tokens
        assert pushes == 2, pushes
    assert 0 < redis_client().llen(f"{BELL}{QUEUE}") <= BELL_CAP
