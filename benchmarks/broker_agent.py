"""A process bound to one broker, driven by a case over a pipe: python -m benchmarks.broker_agent.

Celery and Backlot read their broker from the settings once, at start-up (BROKER_URL in the
environment: empty for Redis, amqp://... for RabbitMQ), so a case comparing the brokers runs one
agent per broker and asks each in turn: enqueue jobs one by one and time it, queue a backlog,
ping, pause and resume workers on this broker, time a drain. One JSON object per line each way
on stdin and on what was stdout; stdout itself goes to stderr, so that nothing a library prints
can garble a reply.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import Any

QUEUE = "default"
# What a case may ask (Agent's methods of these names).
REQUESTS = frozenset({"hello", "purge", "enqueue", "backlog", "ping", "pause", "drain"})
CHUNK = 1000  # rows per job_enqueue_many call, as benchmarks.cases.drain queues a backlog


class Agent:
    def __init__(self) -> None:
        from config.celery import app
        from jobs.broker import amqp

        self.app = app
        self.on_amqp = amqp.enabled()
        self.channel: Any = None
        if self.on_amqp:
            # One connection and channel for every depth read and purge (a passive declare each):
            # jobs.broker.amqp.queue_depths opens a connection per call, too slow to poll with.
            self.connection = app.connection_for_write()
            self.connection.ensure_connection(max_retries=3)
            self.channel = self.connection.channel()
            app.amqp.queues[QUEUE](self.channel).declare()  # as workers and publishes declare it

    # ------------------------------------------------------------------ the queue

    def depth(self) -> int:
        """Messages in the queue not yet delivered to a worker."""
        if self.on_amqp:
            return int(self.channel.queue_declare(queue=QUEUE, passive=True).message_count)
        from benchmarks.harness import queued

        return queued(QUEUE)

    def purge(self) -> dict[str, Any]:
        if self.on_amqp:
            self.channel.queue_purge(QUEUE)
        else:
            from benchmarks.harness import queue_keys, redis_client

            redis_client().delete(*queue_keys(QUEUE))
        return {}

    # ------------------------------------------------------------------ requests

    def hello(self) -> dict[str, Any]:
        if self.on_amqp:
            version = self.connection.connection.server_properties.get("version", "?")
            return {"broker": "rabbitmq", "version": str(version)}
        from benchmarks.harness import redis_client

        return {"broker": "redis", "version": str(redis_client().info("server")["redis_version"])}

    def enqueue(self, variant: str, count: int) -> dict[str, Any]:
        """`count` jobs enqueued one call each (as benchmarks.cases.enqueue), then dropped."""
        from benchmarks import jobs as bench

        send = {"bare": bench.bare_noop.delay, "ledger_on": bench.noop.enqueue}[variant]
        self.purge()
        started = time.monotonic()
        for i in range(count):
            send(i)
        seconds = time.monotonic() - started
        depth = self.depth()
        if depth != count:
            raise AssertionError(f"{variant}: {depth} messages queued, expected {count}")
        self.purge()
        return {"seconds": seconds}

    def backlog(self, variant: str, count: int, key: str) -> dict[str, Any]:
        """Queue `count` counting jobs the way each flavour is queued in bulk (as
        benchmarks.cases.drain.queue_backlog) while no worker consumes the queue."""
        from django.db import connection, transaction

        from benchmarks import jobs as bench
        from jobs import enqueue_many

        if variant == "bare":
            with self.app.producer_or_acquire() as producer:
                for i in range(count):
                    bench.bare_count.apply_async((key, i), producer=producer)
        else:
            for start in range(0, count, CHUNK):
                with transaction.atomic():
                    enqueue_many(
                        task=bench.tracked_count,
                        calls=[((key, i), {}) for i in range(start, min(count, start + CHUNK))],
                    )
        connection.close()
        depth = self.depth()
        if depth != count:
            raise AssertionError(f"{variant}: {depth} messages queued, expected {count}")
        return {}

    def ping(self, workers: list[str]) -> dict[str, Any]:
        replies = self.app.control.ping(destination=workers, timeout=0.5) or []
        return {"answered": sorted(name for reply in replies for name in reply)}

    def pause(self, workers: list[str]) -> dict[str, Any]:
        self.app.control.cancel_consumer(QUEUE, destination=workers, reply=True, timeout=5)
        return {}

    def drain(
        self, variant: str, workers: list[str], count: int, key: str, timeout: float
    ) -> dict[str, Any]:
        """Let `workers` consume the backlog and time it, from the first message taken until
        the counter reaches `count` and, ledger on, every row of the backlog succeeded; then
        stop them consuming again."""
        from django.db import connection

        from benchmarks import jobs as bench
        from benchmarks.harness import redis_client

        counter = bench.COUNTS + key
        client = redis_client()
        client.delete(counter)
        tracked = variant == "ledger_on"
        before = self._succeeded() if tracked else 0
        waiting = self.depth()
        self.app.control.add_consumer(QUEUE, destination=workers, reply=True, timeout=5)
        deadline = time.monotonic() + 30
        while self.depth() >= waiting:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no worker took a message from {QUEUE} within 30 s")
            time.sleep(0.002)
        started = time.monotonic()
        deadline = started + timeout
        while int(client.get(counter) or 0) < count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{client.get(counter)} of {count} jobs ran in {timeout:.0f} s")
            time.sleep(0.005)
        # The ledger's finish comes after the job's body: a ledger-on drain is done when the
        # rows say so (polled only now, so the polls do not load the database during the drain).
        while tracked and self._succeeded() - before < count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"ledger rows not all succeeded after {timeout:.0f} s")
            time.sleep(0.005)
        seconds = time.monotonic() - started
        self.pause(workers)
        ran = int(client.get(counter) or 0)
        connection.close()
        return {"seconds": seconds, "ran": ran, "depth_after": self.depth()}

    @staticmethod
    def _succeeded() -> int:
        from benchmarks import jobs as bench
        from jobs.models import Job, JobState

        return Job.objects.filter(
            task_name=bench.tracked_count.name, state=JobState.SUCCEEDED
        ).count()


def main() -> int:
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    import django

    django.setup()
    import benchmarks.jobs  # noqa: F401  (registers the bench.* tasks in this process)

    agent = Agent()
    for line in sys.stdin:
        request = json.loads(line)
        op = request.pop("op")
        if op == "quit":
            replies.write(json.dumps({"ok": True}) + "\n")
            break
        try:
            if op not in REQUESTS:
                raise ValueError(f"unknown request {op!r}")
            reply = {"ok": True, **getattr(agent, op)(**request)}
        except Exception:  # noqa: BLE001 (the case gets the traceback and fails)
            reply = {"ok": False, "error": traceback.format_exc(limit=8)}
        replies.write(json.dumps(reply) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
