"""How big each case is: the issue's size, and the one `make bench` runs.

The whole suite must finish in under 15 minutes on a 2-core machine, where the drain case
alone would take about 10 minutes at the issue's 20,000 jobs per drain (six variants, three
rounds, ~450-1,000 jobs/s); the counts below are scaled down so that every case still repeats
(median and spread) and A/B alternate. `--full` runs the issue's sizes (each case's timeout
grows 20-fold). Each scaled figure is printed with the result it produced.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Size:
    issue: int
    bench: int
    repeats: int

    def count(self, full: bool) -> int:
        """The issue's size with --full, else the budget size (times --scale, for smoke runs)."""
        if full:
            return self.issue
        return max(1, round(self.bench * float(os.environ.get("BENCH_SCALE", "1"))))


SIZES = {
    # jobs per drain, per variant and round (a PostgreSQL ledger drain runs at ~450 jobs/s)
    "drain_pg": Size(issue=20_000, bench=3_000, repeats=3),
    "drain_sqlite": Size(issue=20_000, bench=3_000, repeats=3),
    # no-op jobs per round for the worker-layout comparison
    "layout": Size(issue=20_000, bench=5_000, repeats=3),
    # jobs enqueued one by one per variant and round
    "enqueue": Size(issue=5_000, bench=1_000, repeats=3),
    # the brokers compared (case amqp, not in the default run): jobs enqueued one by one per
    # variant and round, and jobs per drain (bare and ledger-on, on Redis and on RabbitMQ)
    "amqp_enqueue": Size(issue=5_000, bench=1_000, repeats=3),
    "amqp_drain": Size(issue=20_000, bench=3_000, repeats=3),
    # fan-out recipients per round (Celery's group is sized separately: it is 10x slower)
    "bulk": Size(issue=100_000, bench=20_000, repeats=3),
    "bulk_group": Size(issue=20_000, bench=4_000, repeats=3),
    # members of the one batch enqueued per round (batches case; its drain uses drain_pg)
    "batches": Size(issue=100_000, bench=20_000, repeats=3),
    # sequential jobs per variant (interleaved job by job)
    "latency": Size(issue=500, bench=300, repeats=1),
    # requests per view (interleaved request by request)
    "http": Size(issue=2_000, bench=1_000, repeats=1),
    # dead letters replayed per round
    "deadletters": Size(issue=10_000, bench=10_000, repeats=3),
    # seconds of rate-limited load per round (jobs = seconds x 50)
    "ratelimit": Size(issue=20, bench=10, repeats=3),
    "acquire": Size(issue=10_000, bench=5_000, repeats=3),
    # queued jobs per variant for bytes/job
    "memory": Size(issue=10_000, bench=2_000, repeats=3),
    # progress loop steps
    "progress": Size(issue=100_000, bench=100_000, repeats=3),
    # finished ledger rows under the relay's sweep (plus 10,000 active at every scale); the
    # server-side fill of a million takes about a minute; repeats = timed sweeps
    "relay_sweep": Size(issue=1_000_000, bench=1_000_000, repeats=20),
}
