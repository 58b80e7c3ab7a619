"""jobs.broker.counters: a process's metric counts reach Redis together, at the flush, at its exit,
after a failed write, and never twice through a fork."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from jobs.broker import counters
from jobs.broker.redis import redis_client, redis_text
from tests.conftest import wait_until


@pytest.fixture
def key(clean_redis, unique):
    counters.flush()  # nothing of another test's
    return f"backlot:test:counters:{unique}"


def _read(key: str) -> dict[str, str]:
    return {redis_text(k): redis_text(v) for k, v in redis_client().hgetall(key).items()}


def test_counts_add_up_in_the_process_and_reach_redis_at_the_flush(key):
    counters.add(key, "claimed")
    counters.add(key, "claimed", 2)
    counters.add_float(key, "sum", 0.25)
    counters.add_float(key, "sum", 0.5)
    assert _read(key) == {}

    counters.flush()

    assert _read(key) == {"claimed": "3", "sum": "0.75"}
    counters.flush()  # nothing held: nothing written again
    assert _read(key) == {"claimed": "3", "sum": "0.75"}


def test_a_failed_write_keeps_the_counts_for_the_next(key, monkeypatch):
    counters.add(key, "claimed")

    def unreachable():
        raise RedisConnectionError("Redis is down")

    monkeypatch.setattr(counters, "redis_client", unreachable)
    counters.flush()  # does not raise
    monkeypatch.undo()
    counters.add(key, "claimed")
    counters.flush()

    assert _read(key) == {"claimed": "2"}


def test_counts_left_to_an_ack_wait_for_it_and_a_failed_ack_gives_them_back(key):
    # given a run whose acknowledgement is to write its counts (a -P solo worker's)
    counters.carry()
    counters.add(key, "claimed")

    # when its finish flushes, nothing is written: the ack carries them
    counters.flush_unless_carried()
    assert _read(key) == {}

    # when the ack takes them and its MULTI/EXEC fails, they are held again, and the next
    # flush (no ack pending now) writes them
    taken = counters.take()
    assert taken is not None and counters.take() is None
    counters.give_back(taken)
    counters.flush_unless_carried()
    assert _read(key) == {"claimed": "1"}


def test_a_process_writes_what_it_holds_when_it_exits(key):
    code = (
        f"import django; django.setup(); from jobs import counters; counters.add({key!r}, 'n', 5)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env=os.environ.copy(), timeout=60)

    assert _read(key) == {"n": "5"}


def test_a_forked_child_does_not_write_its_parents_counts(key):
    counters.add(key, "n")
    pid = os.fork()
    if pid == 0:  # the child: holds nothing, writes its own count only
        counters.add(key, "child")
        counters.flush()
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert _read(key) == {"child": "1"}

    counters.flush()

    assert _read(key) == {"child": "1", "n": "1"}


def test_an_expiry_is_written_with_the_counts(key):
    counters.add(key, "n")
    counters.expire(key, 600)
    assert redis_client().ttl(key) == -2  # nothing written before the flush

    counters.flush()

    assert _read(key) == {"n": "1"}
    assert 0 < redis_client().ttl(key) <= 600


def test_a_count_redis_refuses_loses_only_itself(key):
    # given a metrics key that another program made a string, and counts for it and another
    broken = f"{key}:broken"
    redis_client().set(broken, "not a hash")
    counters.add(broken, "n")
    counters.add(key, "n")
    counters.add_float(key, "sum", 0.125)

    # when they are flushed, twice
    counters.flush()
    counters.flush()

    # then the good ones were written once, and the refused one was not kept to be retried
    assert _read(key) == {"n": "1", "sum": "0.125"}
    assert counters.take() is None
    assert redis_client().get(broken) == b"not a hash"


@pytest.fixture
def holding():
    """This process holds its counts like a prefork pool process (counters.hold), until the
    test ends."""
    yield counters.hold
    counters.hold(0)
    counters.flush()


def test_a_pool_process_leaves_its_finishes_counts_to_one_timer(key, holding):
    # given: a process that holds its counts (a pool process, from worker_process_init)
    holding(600)

    # when: three runs finish
    for _ in range(3):
        counters.add(key, "finished")
        counters.flush_unless_carried()

    # then: none wrote them; one timer will, for all three
    assert _read(key) == {}
    timer = counters._State.timer
    assert timer is not None and timer.is_alive()
    counters.add(key, "finished")
    counters.flush_unless_carried()
    assert counters._State.timer is timer
    timer.cancel()
    counters._State.timer = None


def test_held_counts_reach_redis_by_their_timer_with_nothing_else_to_write_them(key, holding):
    # given: a process that holds its counts a moment
    holding(0.1)

    # when: two runs finish and nothing else happens in the process
    counters.add(key, "finished")
    counters.flush_unless_carried()
    counters.add(key, "finished")
    counters.add_float(key, "sum", 0.5)
    counters.flush_unless_carried()

    # then: the timer wrote them, once
    wait_until(lambda: _read(key) == {"finished": "2", "sum": "0.5"}, what="the held counts")
    # and a later finish arms it again
    counters.add(key, "finished")
    counters.flush_unless_carried()
    wait_until(lambda: _read(key) == {"finished": "3", "sum": "0.5"}, what="the next count")
