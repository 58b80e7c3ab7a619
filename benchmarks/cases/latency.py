"""Case 4: end-to-end latency with an idle worker, enqueue -> the job's first line.

One job at a time: the caller notes the wall clock, enqueues, and waits (BLPOP) for the
stamp the job writes first thing; the worker then gets a moment to go idle. Variants are
interleaved job by job, so a noisy neighbour hits them alike.

Two workers: the issue's `worker -c 2` (prefork) and the Procfile's default-queue line (`-P
solo`, the shipped layout), each on a queue of its own, bare Celery and ledger-on Backlot on
each. On both, a fresh first delivery writes nothing before the job runs (DEFER_CLAIM; prefork's
pool processes too since issue 26's stop 45).

Each job is enqueued after an idle gap, so the caller, Redis, PostgreSQL and the worker all
start cold: an enqueue there costs 2.5-3 x its time in a tight loop (benchmarks/README.md,
stop 51).
"""

from __future__ import annotations

import time
import uuid

from django.db import connection

from benchmarks import jobs as bench
from benchmarks.cases.drain import shipped_worker_lines, without_option
from benchmarks.harness import CaseResult, Workers, empty_queues, percentile, wait_stamp
from benchmarks.sizes import SIZES

IDLE_GAP = 0.02  # seconds between jobs: the worker finishes acking and is idle again
# The shipped line's worker consumes this queue only: one of the project's (its settings
# declare every queue), which nothing else in this case uses.
SHIPPED_QUEUE = "emails"


def run(*, full: bool = False) -> CaseResult:
    size = SIZES["latency"]
    count = size.count(full)
    result = CaseResult(
        case="latency",
        title="4. End-to-end latency, enqueue -> job start, idle worker -c 2 (PostgreSQL ledger)",
        params={"jobs_per_variant": count, "idle_gap_s": IDLE_GAP},
    )
    if count != size.issue:
        result.notes.append(f"scaled: {count} sequential jobs per variant instead of {size.issue}")
    variants = {
        "bare": (bench.bare_stamp.delay, "bare Celery delay()"),
        "ledger_off": (
            bench.untracked_stamp.enqueue,
            "Backlot enqueue(), track=False",
        ),
        "ledger_on": (bench.tracked_stamp.enqueue, "Backlot enqueue(), ledger on"),
        "shipped_bare": (
            lambda key: bench.bare_stamp.apply_async((key,), queue=SHIPPED_QUEUE),
            "bare Celery delay() to the Procfile's default-queue worker line",
        ),
        "shipped_ledger_on": (
            lambda key: bench.tracked_stamp.using(queue=SHIPPED_QUEUE).enqueue(key),
            "Backlot enqueue(), ledger on, to the Procfile's default-queue worker line",
        ),
    }
    shipped = _on_queue(shipped_worker_lines()[0], SHIPPED_QUEUE)
    result.params["shipped"] = " ".join(shipped)
    empty_queues()
    samples: dict[str, list[float]] = {name: [] for name in variants}
    with Workers() as workers:
        workers.start("latency", concurrency=2).wait_ready()
        workers.start("latency-shipped", argv=shipped).wait_ready()
        key = f"lat-{uuid.uuid4().hex[:8]}"
        for i in range(count + 10):  # the first 10 rounds warm up
            for name, (send, _) in variants.items():
                sent = time.time()
                send(key)
                started = wait_stamp(key, 30)
                if started is None:
                    raise TimeoutError(f"{name}: job {i} did not start within 30 s")
                if i >= 10:
                    samples[name].append((started - sent) * 1000)
                time.sleep(IDLE_GAP)
    connection.close()
    for name, (_, what) in variants.items():
        values = samples[name]
        thirds = [values[len(values) * k // 3 : len(values) * (k + 1) // 3] for k in range(3)]
        result.figure(
            f"{name} p50",
            [percentile(block, 50) for block in thirds],
            "ms",
            higher_is_better=False,
            what=what + " (p50 of each third of the run)",
        )
        result.figure(
            f"{name} p99",
            [percentile(values, 99)],
            "ms",
            higher_is_better=False,
            what=what + " (over the whole run)",
        )
        result.extra.setdefault("distribution_ms", {})[name] = {
            q: round(percentile(values, q), 3) for q in (0, 10, 25, 50, 75, 90, 95, 99, 100)
        }
    overall = result.extra["distribution_ms"]
    bare50, off50, on50 = (overall[name][50] for name in ("bare", "ledger_off", "ledger_on"))
    result.extra["p50_over_bare_ms"] = {
        "ledger_off": round(off50 - bare50, 3),
        "ledger_on": round(on50 - bare50, 3),
    }
    result.target(
        "ledger off: e2e p50 minus bare p50 (ms)", off50 - bare50, "<= 1 ms", off50 - bare50 <= 1
    )
    result.target(
        "ledger on: e2e p50 minus bare p50 (ms)", on50 - bare50, "<= 1 ms", on50 - bare50 <= 1
    )
    shipped_bare50, shipped_on50 = (overall[n][50] for n in ("shipped_bare", "shipped_ledger_on"))
    result.extra["p50_over_bare_ms"]["shipped_ledger_on"] = round(shipped_on50 - shipped_bare50, 3)
    result.target(
        "ledger on, the shipped default-queue worker: e2e p50 minus bare p50 on it (ms)",
        shipped_on50 - shipped_bare50,
        "<= 1 ms",
        shipped_on50 - shipped_bare50 <= 1,
    )
    return result


def _on_queue(args: list[str], queue: str) -> list[str]:
    """A worker line's arguments consuming `queue` instead of its own queues."""
    return ["-Q", queue, *without_option(args, "-Q", "--queues")]
