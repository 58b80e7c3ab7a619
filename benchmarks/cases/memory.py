"""Case 8: Redis memory per queued job with a 200-byte payload, and what stays afterwards.

No worker while measuring: jobs are queued and Redis's INFO used_memory is read before and
after (the delta over the count is bytes per job); MEMORY USAGE of the queue lists and the
length of one message say where the bytes go. Then a worker drains everything and the
memory left over is compared with the empty baseline.
"""

from __future__ import annotations

import json
import time

from django.db import connection

from benchmarks import jobs as bench
from benchmarks.harness import (
    CaseResult,
    Workers,
    clock,
    drain_seconds,
    empty_queues,
    queue_keys,
    queued,
    redis_client,
)
from benchmarks.sizes import SIZES

PAYLOAD = "x" * 191  # json.dumps([[PAYLOAD], {}]) is exactly 200 bytes
# Jobs per variant run before looking at what stays in Redis (the shipped worker drains
# ledger jobs at ~100/s, so more would only cost time).
AFTER_DRAIN_JOBS = 300


def used_memory() -> int:
    client = redis_client()
    client.execute_command("MEMORY", "PURGE")
    return int(client.info("memory")["used_memory"])


def list_bytes() -> int:
    client = redis_client()
    total = 0
    for key in queue_keys("default"):
        if client.exists(key):
            total += int(client.execute_command("MEMORY", "USAGE", key, "SAMPLES", "0") or 0)
    return total


def one_message() -> bytes:
    client = redis_client()
    for key in queue_keys("default"):
        if client.llen(key):
            return bytes(client.lindex(key, 0))
    return b""


def run(*, full: bool = False) -> CaseResult:
    size = SIZES["memory"]
    count = size.count(full)
    assert len(json.dumps([[PAYLOAD], {}], separators=(",", ":"))) == 200
    result = CaseResult(
        case="memory",
        title="8. Redis memory per queued job, 200-byte payload (no worker)",
        params={"jobs_per_round": count, "rounds": size.repeats, "payload_bytes": 200},
    )
    variants = {
        "bare": (lambda: bench.bare_noop.delay(PAYLOAD), "bare Celery delay()"),
        "backlot": (lambda: bench.noop.enqueue(PAYLOAD), "Backlot enqueue(), ledger on"),
        "backlot_untracked": (
            lambda: bench.noop_untracked.enqueue(PAYLOAD),
            "Backlot enqueue(), track=False",
        ),
    }
    per_job: dict[str, list[float]] = {name: [] for name in variants}
    list_per_job: dict[str, list[float]] = {name: [] for name in variants}
    message: dict[str, dict] = {}
    empty_queues()
    for round_no in range(size.repeats):
        names = list(variants) if round_no % 2 == 0 else list(reversed(variants))
        for name in names:
            send = variants[name][0]
            empty_queues()
            before = used_memory()
            for _ in range(count):
                send()
            after = used_memory()
            assert queued() == count
            per_job[name].append((after - before) / count)
            list_per_job[name].append(list_bytes() / count)
            raw = one_message()
            decoded = json.loads(raw)
            message[name] = {
                "message_bytes": len(raw),
                "headers_bytes": len(json.dumps(decoded["headers"])),
                "body_bytes": len(decoded["body"]),
                "argsrepr_bytes": len(decoded["headers"].get("argsrepr") or ""),
                "kwargsrepr_bytes": len(decoded["headers"].get("kwargsrepr") or ""),
            }
    connection.close()
    for name, (_, what) in variants.items():
        result.figure(
            name,
            per_job[name],
            "bytes/job",
            higher_is_better=False,
            what=what + " (INFO used_memory delta / jobs)",
        )
        result.figure(
            f"{name} (list only)",
            list_per_job[name],
            "bytes/job",
            higher_is_better=False,
            what="MEMORY USAGE of the queue lists / jobs",
        )
    result.extra["one_message"] = message
    ratio = result.ratio("backlot / bare", per_job["backlot"], per_job["bare"])
    result.ratio("backlot_untracked / bare", per_job["backlot_untracked"], per_job["bare"])
    result.target("Redis bytes per queued job, Backlot / bare", ratio, "<= 0.7", ratio <= 0.7)

    # After the jobs ran: what is left in Redis compared with the empty baseline.
    empty_queues()
    baseline = used_memory()
    with Workers() as workers:
        worker = workers.start("memory", concurrency=2).wait_ready()
        for name in variants:
            for _ in range(AFTER_DRAIN_JOBS):
                variants[name][0]()
        drain_seconds(clock(), 300)
        time.sleep(1)
        worker.stop()
    connection.close()
    leftover = used_memory() - baseline
    keys = [
        k.decode()
        for k in redis_client().scan_iter(count=1000)
        if not k.startswith(b"_kombu.binding.")
    ]
    result.figure(
        "left after draining",
        [leftover],
        "bytes",
        higher_is_better=False,
        what=f"used_memory after {3 * AFTER_DRAIN_JOBS:,} jobs ran, minus the empty baseline",
    )
    result.target(
        "Redis memory after the jobs ran, above the empty baseline (bytes)",
        leftover,
        "<= 10 KB (allocator noise)",
        leftover <= 10_000,
        detail="keys left: " + ", ".join(sorted(keys)[:10]),
    )
    result.extra["keys_left_after_drain"] = sorted(keys)[:50]
    result.extra["ttl_of_keys_left"] = {k: redis_client().ttl(k) for k in sorted(keys)[:50]}
    result.notes.append(
        "retention window: not waited for (days); "
        "'left after draining' lists what would have to expire"
    )
    return result
