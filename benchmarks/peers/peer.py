"""One peer's cases, in the peers venv: python -m benchmarks.peers.peer NAME OUT.json [--full].

Needs PEERS_REDIS_URL, PEERS_PROCRASTINATE_URL and PEERS_DJTASKS_URL (scripts/bench-peers.sh
sets them). Each peer runs with its defaults except where the comparison needs one setting
(two worker processes; django-tasks' idle poll interval), said in `workers_what`.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import traceback
from typing import Any

from benchmarks.peers.common import Adapter, Proc, log, run_cases, sizes

BIN = os.path.dirname(sys.executable)
WORKERS = 2


def _redis() -> Any:
    from benchmarks.peers import _stamp

    return _stamp.client()


class Dramatiq(Adapter):
    name = "dramatiq"
    what = "Dramatiq, Redis broker (actor.send)"
    workers_what = "dramatiq --processes 2 --threads 1 (two worker processes, one job at a time)"
    bulk_what = "group(...).run(): Dramatiq has no bulk enqueue, one send per message"

    def __init__(self) -> None:
        self.app = importlib.import_module("benchmarks.peers.dramatiq_app")
        import dramatiq

        self.group = dramatiq.group

    def redis(self) -> Any:
        return _redis()

    def reset(self) -> None:
        self.redis().flushdb()

    def enqueue_one(self, i: int) -> None:
        self.app.noop.send(i)

    def enqueue_bulk(self, count: int) -> None:
        self.group(self.app.noop.message(i) for i in range(count)).run()

    def enqueue_stamp(self, key: str) -> None:
        self.app.stamp.send(key)

    def backlog(self) -> int:
        # A message's body stays in the queue's .msgs hash until its ack.
        pipe = self.redis().pipeline(transaction=False)
        pipe.hlen("dramatiq:default.msgs")
        pipe.hlen("dramatiq:default.DQ.msgs")
        return int(sum(pipe.execute()))

    def start_workers(self) -> list[Proc]:
        argv = [f"{BIN}/dramatiq", "benchmarks.peers.dramatiq_app", "--queues", "default"]
        argv += ["--processes", str(WORKERS), "--threads", "1"]
        return [Proc("dramatiq", argv)]


class RQ(Adapter):
    name = "rq"
    what = "RQ (queue.enqueue), default Worker: forks a work horse per job"
    workers_what = "rq worker-pool -n 2 (two workers, default Worker class)"
    bulk_what = "queue.enqueue_many (one Redis pipeline)"
    drain_factor = 0.1  # a fork per job: tens of jobs/s here

    def __init__(self) -> None:
        from rq import Queue

        self.app = importlib.import_module("benchmarks.peers.rq_app")
        self.Queue = Queue
        self.queue = Queue("default", connection=self.redis())

    def redis(self) -> Any:
        return _redis()

    def reset(self) -> None:
        self.redis().flushdb()

    def enqueue_one(self, i: int) -> None:
        self.queue.enqueue(self.app.noop, i)

    def enqueue_bulk(self, count: int) -> None:
        prepare = self.Queue.prepare_data
        for start in range(0, count, 1000):
            self.queue.enqueue_many(
                [prepare(self.app.noop, (i,)) for i in range(start, min(count, start + 1000))]
            )

    def enqueue_stamp(self, key: str) -> None:
        self.queue.enqueue(self.app.stamp, key)

    def backlog(self) -> int:
        return int(self.queue.count + self.queue.started_job_registry.count)

    def start_workers(self) -> list[Proc]:
        argv = [f"{BIN}/rq", "worker-pool", "-n", str(WORKERS), "-u", os.environ["PEERS_REDIS_URL"]]
        return [Proc("rq", [*argv, "-q", "default"])]


class Huey(Adapter):
    name = "huey"
    what = "Huey, RedisHuey (task call)"
    workers_what = "huey_consumer -k process -w 2 (two worker processes)"
    bulk_what = "task.map(...): one enqueue per job (Huey has no pipelined bulk enqueue)"

    def __init__(self) -> None:
        self.app = importlib.import_module("benchmarks.peers.huey_app")

    def redis(self) -> Any:
        return _redis()

    def reset(self) -> None:
        self.redis().flushdb()

    def enqueue_one(self, i: int) -> None:
        self.app.noop(i)

    def enqueue_bulk(self, count: int) -> None:
        self.app.noop.map(range(count))

    def enqueue_stamp(self, key: str) -> None:
        self.app.stamp(key)

    def backlog(self) -> int:
        # Huey pops a message when it starts the job: nothing marks it running, so the drain's
        # end is the last job taken (at most 2 no-ops still running).
        return int(self.app.huey.pending_count())

    def notes(self) -> list[str]:
        return ["Huey's drain ends at the last job taken: it keeps no record of running jobs"]

    def start_workers(self) -> list[Proc]:
        argv = [f"{BIN}/huey_consumer", "benchmarks.peers.huey_app.huey", "-k", "process"]
        return [Proc("huey", [*argv, "-w", str(WORKERS)])]


class _Postgres(Adapter):
    poll = 0.02  # a count(*) per poll: not too often

    def __init__(self, url: str) -> None:
        import psycopg

        self.url = url
        self.conn = psycopg.connect(url, autocommit=True)

    def redis(self) -> Any:
        return _redis()

    def scalar(self, sql: str) -> int:
        row = self.conn.execute(sql).fetchone()
        return int(row[0]) if row else 0


class Procrastinate(_Postgres):
    name = "procrastinate"
    what = "Procrastinate, PostgreSQL (task.defer)"
    workers_what = (
        "two `procrastinate worker --concurrency 1` processes (sync tasks, LISTEN/NOTIFY on)"
    )
    bulk_what = "task.batch_defer(...) per 1,000 (one INSERT of many rows)"

    def __init__(self) -> None:
        super().__init__(os.environ["PEERS_PROCRASTINATE_URL"])
        self.app_module = importlib.import_module("benchmarks.peers.procrastinate_app")
        self.app = self.app_module.app
        self.app.open()
        if self.scalar("select count(*) from pg_tables where tablename = 'procrastinate_jobs'"):
            return
        self.app.schema_manager.apply_schema()

    def reset(self) -> None:
        self.conn.execute("truncate procrastinate_jobs cascade")
        _redis().flushdb()

    def enqueue_one(self, i: int) -> None:
        self.app_module.noop.defer(i=i)

    def enqueue_bulk(self, count: int) -> None:
        for start in range(0, count, 1000):
            self.app_module.noop.batch_defer(
                *({"i": i} for i in range(start, min(count, start + 1000)))
            )

    def enqueue_stamp(self, key: str) -> None:
        self.app_module.stamp.defer(key=key)

    def backlog(self) -> int:
        return self.scalar(
            "select count(*) from procrastinate_jobs where status in ('todo', 'doing')"
        )

    def start_workers(self) -> list[Proc]:
        argv = [f"{BIN}/procrastinate", "--app=benchmarks.peers.procrastinate_app.app", "worker"]
        argv += ["--concurrency", "1", "--queues", "default"]
        return [Proc(f"procrastinate{n}", argv) for n in range(WORKERS)]


class DjangoTasks(_Postgres):
    name = "django_tasks_db"
    what = "django-tasks, database backend (django-tasks-db, task.enqueue)"
    workers_what = "two `manage.py db_worker --interval 0.05` processes (default idle poll: 1 s)"
    bulk_what = "task.enqueue per job in one transaction (no bulk enqueue in django-tasks)"

    def __init__(self) -> None:
        os.environ["DJANGO_SETTINGS_MODULE"] = "benchmarks.peers.djtasks_settings"
        import django

        django.setup()
        from django.core.management import call_command
        from django.db import transaction

        call_command("migrate", verbosity=0, interactive=False)
        super().__init__(os.environ["PEERS_DJTASKS_URL"])
        self.atomic = transaction.atomic
        self.app = importlib.import_module("benchmarks.peers.djtasks_app")

    def reset(self) -> None:
        self.conn.execute("truncate django_tasks_database_dbtaskresult")
        _redis().flushdb()

    def enqueue_one(self, i: int) -> None:
        self.app.noop.enqueue(i)

    def enqueue_bulk(self, count: int) -> None:
        for start in range(0, count, 1000):
            with self.atomic():
                for i in range(start, min(count, start + 1000)):
                    self.app.noop.enqueue(i)

    def enqueue_stamp(self, key: str) -> None:
        self.app.stamp.enqueue(key)

    def backlog(self) -> int:
        return self.scalar(
            "select count(*) from django_tasks_database_dbtaskresult"
            " where status in ('READY', 'RUNNING')"
        )

    def start_workers(self) -> list[Proc]:
        argv = [sys.executable, "-m", "django", "db_worker", "--interval", "0.05"]
        argv += ["--no-startup-delay", "--no-reload"]
        env = {"DJANGO_SETTINGS_MODULE": "benchmarks.peers.djtasks_settings"}
        return [Proc(f"djtasks{n}", argv, env) for n in range(WORKERS)]


PEERS: dict[str, type[Adapter]] = {
    "dramatiq": Dramatiq,
    "rq": RQ,
    "huey": Huey,
    "procrastinate": Procrastinate,
    "django_tasks_db": DjangoTasks,
}


def versions() -> dict[str, str]:
    from importlib import metadata

    out = {}
    for dist in ("dramatiq", "rq", "huey", "procrastinate", "django-tasks", "django-tasks-db"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "not installed"
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("peer", choices=list(PEERS))
    parser.add_argument("out")
    parser.add_argument("--full", action="store_true")
    parser.add_argument("--cases", default="enqueue,bulk,drain,latency")
    parser.add_argument("--per-round", action="store_true", help="one round of the run")
    opts = parser.parse_args()
    try:
        adapter = PEERS[opts.peer]()
        result = run_cases(adapter, sizes(opts.full, opts.per_round), opts.cases.split(","))
        result["versions"] = versions()
    except Exception:  # noqa: BLE001 (a failing peer is reported, the run goes on)
        traceback.print_exc()
        result = {"error": traceback.format_exc(limit=8)}
        log(f"{opts.peer} FAILED")
    with open(opts.out, "w") as fh:
        json.dump(result, fh, indent=1)
    return 1 if "error" in result else 0


if __name__ == "__main__":
    sys.exit(main())
