"""A `-P solo` worker's metric counts go to Redis with the acknowledgement of the job's message
(jobs.broker.counters.carry), which rides with the worker's next fetch: the fetch script drops
the message's entries and writes the counts before it pops the next message
(jobs.broker.reservations.RIDE_WAIT, jobs.broker.fetch), not in a round trip of their own; a
prefork worker's pool processes, which do not acknowledge, write theirs themselves, on a timer
(jobs.broker.counters.hold). Either way every delivery and finish is counted once.

What each worker sent is read from Redis' MONITOR of the worker's private Redis.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from jobs.broker.reservations import OWNERS
from jobs.worker.outcomes import DELIVERIES
from jobs.worker.telemetry import FINISHED
from tests.conftest import wait_until
from tests.support.redis_clients import Monitor
from tests.system.faults.conftest import runs, wait_finished


def count_writes(commands: list[tuple[str, str]]) -> Counter:
    """The job counts' HINCRBYs (deliveries and finishes), by where they were sent: with an
    acknowledgement (in a MULTI/EXEC, or a script, that drops a message's owner record) or
    without one."""
    placed: Counter = Counter()
    for _, unit in _units(commands):
        acked = any(_ack(c) for c in unit)
        for c in unit:
            if _job_count(c):
                placed["with the ack" if acked else "on its own"] += 1
    return placed


def ack_places(commands: list[tuple[str, str]]) -> Counter:
    """The acknowledgements (a message's owner record dropped), by what sent them: a fetch
    script (EVALSHA), a MULTI/EXEC or a lone command."""
    return Counter(kind for kind, unit in _units(commands) for c in unit if _ack(c))


def _units(commands: list[tuple[str, str]]) -> list[tuple[str, list[str]]]:
    """Each MULTI/EXEC, each script call with the commands it ran, each lone command. MONITOR
    shows the commands a script runs right after its EVAL/EVALSHA, from the client "lua"."""
    units: list[tuple[str, list[str]]] = []
    blocks: dict[str, list[str]] = {}
    script: list[str] | None = None  # the call whose "lua" lines follow
    for sender, command in commands:
        if sender.startswith("lua"):
            if script is not None:
                script.append(command)
            continue
        script = None
        verb = command.split(" ", 1)[0].upper()
        if verb == "MULTI":
            blocks[sender] = []
        elif verb == "EXEC":
            units.append(("MULTI/EXEC", blocks.pop(sender, [])))
        elif sender in blocks:
            blocks[sender].append(command)
            if verb in ("EVAL", "EVALSHA"):  # a script in the block: its commands are the block's
                script = blocks[sender]
        elif verb in ("EVAL", "EVALSHA"):
            script = [command]
            units.append((verb, script))
        else:
            units.append(("command", [command]))
    return units


def _ack(command: str) -> bool:
    return command.startswith("HDEL backlot:reserved ")


def _job_count(command: str) -> bool:
    return command.startswith((f"HINCRBY {DELIVERIES} ", f"HINCRBY {FINISHED} "))


def job_counts(client: Any, outcome: str) -> tuple[int, int]:
    """Deliveries counted as `outcome`, and finished attempts that succeeded, in Redis."""
    deliveries = int(client.hget(DELIVERIES, outcome) or 0)
    finished = sum(
        int(v) for k, v in client.hgetall(FINISHED).items() if k.endswith(b"\tsucceeded")
    )
    return deliveries, finished


@pytest.mark.parametrize(("pool", "batch"), [("solo", "1"), ("solo", "32"), ("prefork", "32")])
def test_job_counts_reach_redis_with_the_ack_on_a_solo_worker(
    pool, batch, private_redis, start_fault_worker, client_procs, run_id
):
    # given a worker of that pool (a prefork one's pool process holding its counts for a timer,
    # as shipped; a solo one writing its successes one by one, or together as shipped), and a
    # MONITOR of its Redis
    start_fault_worker(
        f"counts-{pool}",
        pool=pool,
        concurrency=1,
        BACKLOT_METRICS_HOLD_SECONDS="1.0",
        BACKLOT_SUCCESS_BATCH=batch,
    )
    monitor = Monitor(private_redis.url)

    # when short jobs run
    ids = client_procs.enqueue("quick", run_id, 6)
    wait_finished(ids, timeout=60, what="the short jobs")

    # then each delivery and finish is counted once in Redis, as a run that did not write its
    # claim (DEFER_CLAIM, the default; a prefork pool process's too)

    def counts() -> tuple[int, int]:
        return job_counts(private_redis.client, "deferred")

    wait_until(lambda: counts() == (6, 6), timeout=20, interval=0.1, what="the 12 counts")
    assert runs(run_id) == Counter(dict.fromkeys(range(6), 1))
    commands = [
        (f"{address}:{port}", command)
        for address, port, command in monitor.stop(private_redis.client)
    ]

    # on a solo worker with the acknowledgements (in the fetch script that settles them); a
    # prefork worker's pool process (which does not acknowledge) on their own, added up over
    # the finishes its timer waited for
    placed = count_writes(commands)
    if pool == "solo" and batch == "1":
        assert placed == Counter({"with the ack": 12}), placed
        # each acknowledgement rode with the worker's next fetch: no round trip of its own
        assert ack_places(commands) == Counter({"EVALSHA": 6}), ack_places(commands)
    elif pool == "solo":
        # acknowledged once their rows were written: with a fetch, or together once the
        # worker waited for its next message a round (RIDE_WAIT), never one by one
        places = ack_places(commands)
        assert places.total() == 6 and set(places) <= {"EVALSHA", "MULTI/EXEC"}, places
        # the counts with them, added up over the jobs acknowledged together
        assert set(placed) == {"with the ack"}, placed
    else:
        assert set(placed) == {"on its own"} and placed["on its own"] <= 12, placed


def test_a_pool_process_holds_its_counts_and_writes_them_as_it_stops(
    private_redis, start_fault_worker, client_procs, run_id
):
    # given a prefork worker whose pool process holds its counts longer than this test lasts
    worker = start_fault_worker(
        "counts-held", pool="prefork", concurrency=1, BACKLOT_METRICS_HOLD_SECONDS="600"
    )
    client: Any = private_redis.client

    def counts() -> tuple[int, int]:
        return job_counts(client, "deferred")

    # when short jobs run and the worker acknowledges their messages (after each run's end:
    # a finish that wrote its counts had written them by then)
    ids = client_procs.enqueue("quick", run_id, 6)
    wait_finished(ids, timeout=60, what="the short jobs")
    wait_until(lambda: client.hlen(OWNERS) == 0, timeout=20, what="the acknowledgements")

    # then no count was written yet
    assert counts() == (0, 0)

    # when the worker stops (a deploy's warm shutdown)
    worker.stop()

    # then its pool process wrote them as it ended: each delivery and finish once
    assert worker.process.returncode == 0, worker.log_path.read_text()[-3000:]
    wait_until(lambda: counts() == (6, 6), timeout=20, interval=0.1, what="the 12 counts")
    assert runs(run_id) == Counter(dict.fromkeys(range(6), 1))
