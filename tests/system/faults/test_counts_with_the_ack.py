"""A `-P solo` worker's metric counts go to Redis in the MULTI/EXEC that acknowledges the job's
message (jobs.broker.counters.carry, jobs.broker.reservations.ReservingQoS._settle), not in a
round trip of their own; a prefork worker's pool processes, which do not acknowledge, flush
theirs themselves. Either way every delivery and finish is counted once.

What each worker sent is read from Redis' MONITOR of the worker's private Redis.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

import pytest
import redis

from jobs.worker.outcomes import DELIVERIES
from jobs.worker.telemetry import FINISHED
from tests.conftest import wait_until
from tests.system.faults.conftest import runs, wait_finished

STOP = "backlot-test-monitor-stop"


class Monitor:
    """Every command the Redis at `url` runs, by client connection, until stop()."""

    def __init__(self, url: str) -> None:
        self.client = redis.Redis.from_url(url, socket_timeout=60)
        self.commands: list[tuple[str, str]] = []  # (client address, command)
        ready = threading.Event()
        self.thread = threading.Thread(target=self._listen, args=(ready,), daemon=True)
        self.thread.start()
        assert ready.wait(10), "MONITOR did not start"

    def _listen(self, ready: threading.Event) -> None:
        with self.client.monitor() as monitor:  # MONITOR is on once its OK is read
            ready.set()
            for line in monitor.listen():
                if STOP in line["command"]:
                    return
                address = f"{line['client_address']}:{line['client_port']}"
                self.commands.append((address, line["command"]))

    def stop(self, client: redis.Redis) -> list[tuple[str, str]]:
        """What was seen until now (`client` sends the command that ends the MONITOR)."""
        client.get(STOP)
        self.thread.join(10)
        assert not self.thread.is_alive(), "MONITOR did not stop"
        return self.commands


def count_writes(commands: list[tuple[str, str]]) -> Counter:
    """The job counts' HINCRBYs (deliveries and finishes), by where they were sent: inside an
    acknowledgement's MULTI/EXEC (one that drops a message's owner record) or outside one.
    The counts go in a script (jobs.broker.counters.write): MONITOR shows the commands a script
    runs right after its EVAL, from the client "lua"; they count where the EVAL was sent."""
    blocks: dict[str, list[str]] = {}
    placed: Counter = Counter()
    scripting: str | None = None  # the client whose EVAL the "lua" lines that follow are
    for sender, command in commands:
        address = scripting or sender if sender.startswith("lua") else sender
        if not sender.startswith("lua"):
            scripting = sender if command[:5].upper() == "EVAL " else None
        verb = command.split(" ", 1)[0].upper()
        if verb == "MULTI":
            blocks[address] = []
        elif verb == "EXEC":
            block = blocks.pop(address, [])
            acked = any(c.startswith("HDEL backlot:reserved ") for c in block)
            for c in block:
                if _job_count(c):
                    placed["with the ack" if acked else "in another transaction"] += 1
        elif address in blocks:
            blocks[address].append(command)
        elif _job_count(command):
            placed["on its own"] += 1
    return placed


def _job_count(command: str) -> bool:
    return command.startswith((f"HINCRBY {DELIVERIES} ", f"HINCRBY {FINISHED} "))


@pytest.mark.parametrize("pool", ["solo", "prefork"])
def test_job_counts_reach_redis_with_the_ack_on_a_solo_worker(
    pool, private_redis, start_fault_worker, client_procs, run_id
):
    # given a worker of that pool, and a MONITOR of its Redis
    start_fault_worker(f"counts-{pool}", pool=pool, concurrency=1)
    monitor = Monitor(private_redis.url)

    # when short jobs run
    ids = client_procs.enqueue("quick", run_id, 6)
    wait_finished(ids, timeout=60, what="the short jobs")

    # then each delivery and finish is counted once in Redis: on a solo worker as a run that
    # did not write its claim (DEFER_CLAIM, the default), on a prefork one as a claim
    outcome = "deferred" if pool == "solo" else "claimed"

    def counts() -> tuple[int, int]:
        client: Any = private_redis.client
        deliveries = int(client.hget(DELIVERIES, outcome) or 0)
        finished = sum(
            int(v) for k, v in client.hgetall(FINISHED).items() if k.endswith(b"\tsucceeded")
        )
        return deliveries, finished

    wait_until(lambda: counts() == (6, 6), timeout=20, interval=0.1, what="the 12 counts")
    assert runs(run_id) == Counter(dict.fromkeys(range(6), 1))
    commands = monitor.stop(private_redis.client)

    # on a solo worker in the acknowledgements' MULTI/EXEC; a prefork worker's pool process
    # (which does not acknowledge) in pipelines of its own
    placed = count_writes(commands)
    if pool == "solo":
        assert placed == Counter({"with the ack": 12}), placed
    else:
        assert placed == Counter({"on its own": 12}), placed
