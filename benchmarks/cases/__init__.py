"""The benchmark cases, in the order `python -m benchmarks` runs them.

Each entry: case name -> (module, the database its process uses, a timeout in seconds).
A case runs in its own process (benchmarks.run_case) so that it can use SQLite or PostgreSQL
and cannot leave workers behind when it fails.
"""

from __future__ import annotations

CASES: dict[str, tuple[str, str, int]] = {
    "drain_pg": ("benchmarks.cases.drain:run_pg", "pg", 420),
    "drain_sqlite": ("benchmarks.cases.drain:run_sqlite", "sqlite", 300),
    "layout": ("benchmarks.cases.drain:run_layout", "pg", 360),
    "enqueue": ("benchmarks.cases.enqueue:run_enqueue", "pg", 180),
    "bulk": ("benchmarks.cases.enqueue:run_bulk", "pg", 300),
    "latency": ("benchmarks.cases.latency:run", "pg", 180),
    "http": ("benchmarks.cases.http:run", "pg", 240),
    "deadletters": ("benchmarks.cases.deadletters:run", "pg", 240),
    "ratelimit": ("benchmarks.cases.ratelimit:run", "pg", 240),
    "memory": ("benchmarks.cases.memory:run", "pg", 240),
    "progress": ("benchmarks.cases.progress:run", "pg", 240),
    # ~60 s at 20,000 ledger jobs on a quiet machine (~320 s under a load average of 12);
    # --full (100,000 jobs, the size) ~5 min
    "worker_memory": ("benchmarks.cases.worker_memory:run", "pg", 480),
    # batch enqueue (20,000 members; --full 100,000) and drain (drain_pg size) vs no batch
    "batches": ("benchmarks.cases.batches:run", "pg", 600),
    # issue 26 item 4: the relay's sweep over 1,000,000 finished + 10,000 active rows (the
    # fill and VACUUM ANALYZE take most of it)
    "relay_sweep": ("benchmarks.cases.relay_sweep:run", "pg", 600),
}

# Run on request only (python -m benchmarks --cases NAME).
EXTRA: dict[str, tuple[str, str, int]] = {
    # py-spy on a ledger drain
    "profile": ("benchmarks.cases.profile:run", "pg", 600),
    # issue 28 item 5: bare Celery and Backlot on RabbitMQ beside the same on Redis, enqueue and
    # drain (about 3 min, estimated from 0.2-scale runs: the default run would pass 15 minutes)
    "amqp": ("benchmarks.cases.amqp:run", "pg", 480),
}

# Cases that need BENCH_AMQP_URL, a RabbitMQ of the suite's own (scripts/bench.sh starts one).
AMQP_CASES = frozenset({"amqp"})
