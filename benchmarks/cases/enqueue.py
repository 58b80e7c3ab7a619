"""Cases 2 and 3: how fast one process hands jobs to Redis, one by one and in bulk.

No worker runs: the queue only grows, and is emptied between rounds.
"""

from __future__ import annotations

import base64
import json
import uuid
from collections.abc import Callable
from typing import Any

from celery import group
from django.db import connection, transaction

from benchmarks import jobs as bench
from benchmarks.harness import CaseResult, clock, empty_queues, queue_keys, queued, redis_client
from benchmarks.sizes import SIZES
from jobs import enqueue_many as job_enqueue_many
from jobs.worker.task import PlatformTask

# --------------------------------------------------------------------------- case 2


def run_enqueue(*, full: bool = False) -> CaseResult:
    size = SIZES["enqueue"]
    count = size.count(full)
    result = CaseResult(
        case="enqueue",
        title="2. Enqueue rate from one process, one call per job (PostgreSQL ledger)",
        params={"jobs_per_round": count, "rounds": size.repeats},
    )
    variants: dict[str, tuple[Callable[[int], object], str]] = {
        "bare_delay": (bench.bare_noop.delay, "bare Celery task.delay()"),
        "enqueue_ledger_off": (
            bench.noop_untracked.enqueue,
            "Backlot enqueue(), track=False",
        ),
        "enqueue_ledger_on": (
            bench.noop.enqueue,
            "Backlot enqueue(), ledger row + publish + published_at (outbox)",
        ),
    }
    rates = _alternate(variants, count, size.repeats + 1)  # round 0 warms up
    for name, (_, what) in variants.items():
        result.figure(name, rates[name][1:], "jobs/s", what=what)
    off = result.ratio(
        "enqueue_ledger_off / bare_delay", rates["enqueue_ledger_off"][1:], rates["bare_delay"][1:]
    )
    on = result.ratio(
        "enqueue_ledger_on / bare_delay", rates["enqueue_ledger_on"][1:], rates["bare_delay"][1:]
    )
    result.target("single enqueue, ledger on / bare delay()", on, ">= 1.0", on >= 1.0)
    result.target("single enqueue, ledger off / bare delay()", off, ">= 2.0", off >= 2.0)
    trips = {name: round_trips(send) for name, (send, _) in variants.items()}
    result.extra["round_trips_per_call"] = trips
    for name, (db, redis) in trips.items():
        result.figure(f"{name} database round trips", [db], "per call", what="psycopg waits")
        result.figure(f"{name} Redis round trips", [redis], "per call", what="redis-py sends")
    db, redis = trips["enqueue_ledger_on"]
    result.target(
        "round trips per ledger-on enqueue (database + Redis)",
        db + redis,
        "<= 2 (1 + 1)",
        db <= 1 and redis <= 1,
        detail=f"database {db:.2f}, Redis {redis:.2f} (bare delay(): "
        f"{trips['bare_delay'][0]:.2f} + {trips['bare_delay'][1]:.2f})",
    )
    # Python calls per call (cProfile's count: load-independent), .delay() as well as enqueue()
    counted = {name: send for name, (send, _) in variants.items()}
    counted["delay_ledger_on"] = bench.noop.delay
    calls = {name: python_calls(send) for name, send in counted.items()}
    result.extra["python_calls_per_call"] = calls
    for name, per_call in calls.items():
        result.figure(f"{name} Python calls", [per_call], "per call", what="cProfile total_calls")
    most = max(calls["enqueue_ledger_on"], calls["delay_ledger_on"])  # the dearer of the two
    result.target(
        "Python calls per ledger-on enqueue (enqueue() and .delay()) < bare delay()",
        most,
        f"< {calls['bare_delay']:.0f}",
        most < calls["bare_delay"],
        detail=f"enqueue() {calls['enqueue_ledger_on']:.0f}, .delay() "
        f"{calls['delay_ledger_on']:.0f}, bare delay() {calls['bare_delay']:.0f}",
    )
    return result


def python_calls(send: Callable[[int], object], calls: int = 200) -> float:
    """Python function calls per call of `send` (cProfile's total_calls), after a warm-up."""
    import cProfile
    import pstats

    for i in range(20):
        send(i)
    profile = cProfile.Profile()
    profile.enable()
    try:
        for i in range(calls):
            send(i)
    finally:
        profile.disable()
    empty_queues()
    return pstats.Stats(profile).total_calls / calls  # type: ignore[attr-defined]


def round_trips(send: Callable[[int], object], calls: int = 200) -> tuple[float, float]:
    """Database and Redis round trips per call of `send`, counted where each one waits: every
    psycopg exchange with the server goes through Connection.wait (a statement, BEGIN, COMMIT),
    every redis-py command or pipeline is one send_packed_command."""
    import psycopg
    from redis.connection import AbstractConnection

    counts = {"db": 0, "redis": 0}
    wait, send_packed = psycopg.Connection.wait, AbstractConnection.send_packed_command

    def counted_wait(self: Any, *args: Any, **kwargs: Any) -> Any:
        counts["db"] += 1
        return wait(self, *args, **kwargs)

    def counted_send(self: Any, *args: Any, **kwargs: Any) -> Any:
        counts["redis"] += 1
        return send_packed(self, *args, **kwargs)

    for i in range(20):  # connections opened and warm before counting
        send(i)
    psycopg.Connection.wait = counted_wait  # type: ignore[method-assign]
    AbstractConnection.send_packed_command = counted_send  # type: ignore[method-assign]
    try:
        for i in range(calls):
            send(i)
    finally:
        psycopg.Connection.wait = wait  # type: ignore[method-assign]
        AbstractConnection.send_packed_command = send_packed  # type: ignore[method-assign]
    empty_queues()
    return counts["db"] / calls, counts["redis"] / calls


def _alternate(
    variants: dict[str, tuple[Callable[[int], object], str]], count: int, rounds: int
) -> dict[str, list[float]]:
    rates: dict[str, list[float]] = {name: [] for name in variants}
    for round_no in range(rounds):
        names = list(variants) if round_no % 2 == 0 else list(reversed(variants))
        for name in names:
            send = variants[name][0]
            empty_queues()
            started = clock()
            for i in range(count):
                send(i)
            seconds = clock() - started
            if queued() != count:
                raise AssertionError(f"{name}: {queued()} messages queued, expected {count}")
            rates[name].append(count / seconds)
    empty_queues()
    connection.close()
    return rates


# --------------------------------------------------------------------------- case 3

FANOUT_CHUNK = 1000  # emails.services.CHUNK: recipients per transaction in a campaign fan-out


def fan_out(task: PlatformTask, count: int) -> None:
    """A campaign-style fan-out: per chunk of recipients one transaction, one
    job_enqueue_many (ledger rows, then the messages after commit)."""
    for start in range(0, count, FANOUT_CHUNK):
        with transaction.atomic():
            job_enqueue_many(
                task=task,
                calls=[((i,), {}) for i in range(start, min(count, start + FANOUT_CHUNK))],
            )


def kombu_batch_publish(count: int) -> None:
    """The same task messages, built by Celery's own message builder and published through
    kombu's pipelined Producer.batch() (one Redis round trip per 1,000 messages).

    To the queue directly (the anonymous exchange): through the "default" exchange, kombu's
    Redis transport reads the exchange's bindings (SMEMBERS) once per message, a round trip
    that no pipeline removes and that halves the rate.
    """
    from config.celery import app

    amqp = app.amqp
    queue = amqp.queues["default"]
    with app.producer_or_acquire() as producer, producer.batch(1000):
        for i in range(count):
            task_id = str(uuid.uuid4())
            headers, properties, body, _ = amqp.as_task_v2(
                task_id,
                bench.noop.name,
                args=(i,),
                kwargs={},
                argsrepr=repr((i,)),
                kwargsrepr="{}",
            )
            producer.publish(
                body,
                exchange="",
                routing_key=queue.name,
                serializer="json",
                headers=headers,
                priority=4,
                retry=False,
                declare=None,
                **properties,
            )


def redis_pipeline_push(count: int) -> None:
    """The same messages, built by hand (Celery's protocol 2 envelope and headers) and pushed
    with LPUSH in a Redis pipeline: the floor for any publish path."""
    client = redis_client()
    key = queue_keys("default")[4]
    pipe = client.pipeline(transaction=False)
    for i in range(count):
        task_id = str(uuid.uuid4())
        body = json.dumps(
            [[i], {}, {"callbacks": None, "errbacks": None, "chain": None, "chord": None}]
        )
        message = {
            "body": base64.b64encode(body.encode()).decode(),
            "content-encoding": "utf-8",
            "content-type": "application/json",
            "headers": {
                "lang": "py",
                "task": bench.noop.name,
                "id": task_id,
                "shadow": None,
                "eta": None,
                "expires": None,
                "group": None,
                "group_index": None,
                "retries": 0,
                "timelimit": [None, None],
                "root_id": task_id,
                "parent_id": None,
                "argsrepr": f"({i},)",
                "kwargsrepr": "{}",
                "origin": "bench@localhost",
                "ignore_result": False,
                "replaced_task_nesting": 0,
                "stamped_headers": None,
                "stamps": {},
            },
            "properties": {
                "correlation_id": task_id,
                "reply_to": str(uuid.uuid4()),
                "delivery_mode": 2,
                "delivery_info": {"exchange": "default", "routing_key": "default"},
                "priority": 4,
                "body_encoding": "base64",
                "delivery_tag": str(uuid.uuid4()),
            },
        }
        pipe.lpush(key, json.dumps(message))
        if len(pipe) >= 1000:
            pipe.execute()
    pipe.execute()


def celery_group(count: int) -> None:
    group(bench.bare_noop.s(i) for i in range(count)).apply_async()


def run_bulk(*, full: bool = False) -> CaseResult:
    size, group_size = SIZES["bulk"], SIZES["bulk_group"]
    count, group_count = size.count(full), group_size.count(full)
    result = CaseResult(
        case="bulk",
        title="3. Bulk enqueue: campaign fan-out (job_enqueue_many) vs pipelined raw publish",
        params={
            "jobs_per_round": count,
            "group_jobs_per_round": group_count,
            "rounds": size.repeats,
            "fan_out_chunk": FANOUT_CHUNK,
        },
    )
    if count != size.issue:
        result.notes.append(
            f"scaled: {count:,} recipients per round instead of {size.issue:,}; "
            f"Celery's group with {group_count:,} jobs"
        )
    variants: dict[str, tuple[Callable[[], None], int, str]] = {
        "redis_pipeline": (
            lambda: redis_pipeline_push(count),
            count,
            "pre-built task messages, LPUSH in a Redis pipeline",
        ),
        "kombu_batch": (
            lambda: kombu_batch_publish(count),
            count,
            "Celery messages via kombu Producer.batch() (pipelined)",
        ),
        "fanout_ledger_on": (
            lambda: fan_out(bench.noop, count),
            count,
            "job_enqueue_many per 1,000 in a transaction, ledger on (PostgreSQL)",
        ),
        "fanout_ledger_off": (
            lambda: fan_out(bench.noop_untracked, count),
            count,
            "job_enqueue_many per 1,000, ledger off",
        ),
        "celery_group": (
            lambda: celery_group(group_count),
            group_count,
            "bare Celery group(...).apply_async()",
        ),
    }
    rates: dict[str, list[float]] = {name: [] for name in variants}
    warm = {
        "redis_pipeline": lambda: redis_pipeline_push(100),
        "kombu_batch": lambda: kombu_batch_publish(100),
        "fanout_ledger_on": lambda: fan_out(bench.noop, 100),
        "fanout_ledger_off": lambda: fan_out(bench.noop_untracked, 100),
        "celery_group": lambda: celery_group(100),
    }
    for fn in warm.values():
        fn()
    for round_no in range(size.repeats):
        names = list(variants) if round_no % 2 == 0 else list(reversed(variants))
        for name in names:
            send, n, _ = variants[name]
            empty_queues()
            started = clock()
            send()
            seconds = clock() - started
            if queued() != n:
                raise AssertionError(f"{name}: {queued()} messages queued, expected {n}")
            rates[name].append(n / seconds)
            connection.close()
    empty_queues()
    for name, (_, _, what) in variants.items():
        result.figure(name, rates[name], "jobs/s", what=what)
    on = rates["fanout_ledger_on"]
    result.ratio("kombu_batch / fanout_ledger_on", rates["kombu_batch"], on)
    result.ratio("redis_pipeline / fanout_ledger_on", rates["redis_pipeline"], on)
    vs_group = result.ratio("fanout_ledger_on / celery_group", on, rates["celery_group"])
    median_on = result.figures["fanout_ledger_on"]["median"]
    result.target(
        "campaign fan-out with ledger rows, jobs/s", median_on, ">= 20,000", median_on >= 20_000
    )
    result.target("fan-out / Celery group", vs_group, "> 10", vs_group > 10)
    slower = result.ratios["kombu_batch / fanout_ledger_on"]["median"]
    result.target(
        "raw pipelined kombu publish / fan-out (times slower)", slower, "<= 1.35", slower <= 1.35
    )
    return result
