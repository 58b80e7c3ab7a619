"""jobs.broker.reservations' sweep against real Redis: what a dead holder had taken goes back to its
queue, a live holder's messages are never touched (tests/system/faults/test_lost_worker.py
runs it with real workers)."""

from __future__ import annotations

import json
import os
import time
import uuid
from typing import Any

import pytest
from celery import current_app

from jobs.broker import heartbeat, restore, running
from jobs.broker.heartbeat import HEARTBEAT, WORKERS
from jobs.broker.redis import redis_client
from jobs.broker.reservations import DROPPED, OWNERS, RESTORED
from jobs.broker.restore import restore_lost

# No worker consumes it: a session worker of the suite would take the restored messages.
QUEUE = "test-reservations"


def message(job_id: str, queue: str = QUEUE, priority: int = 0, **headers: Any) -> dict[str, Any]:
    """A Celery message as kombu keeps it in `unacked` (the parts the sweep reads)."""
    return {
        "body": "W1tdLCB7fSwge31d",
        "headers": {"id": job_id, "task": "tests.noop", **headers},
        "properties": {
            "priority": priority,
            "delivery_tag": f"tag-{job_id}",
            "delivery_info": {"exchange": "", "routing_key": queue},
        },
    }


def hold(holder: str, job_id: str, queue: str = QUEUE, priority: int = 0, **headers: Any) -> str:
    """What ReservingQoS.append writes for a message `holder` took."""
    tag = f"tag-{job_id}"
    client = redis_client()
    payload = json.dumps([message(job_id, queue, priority, **headers), "", queue])
    client.hset("unacked", tag, payload)
    client.zadd("unacked_index", {tag: time.time()})
    client.hset(OWNERS, tag, holder)
    client.sadd(WORKERS, holder)
    return tag


def beat(holder: str) -> None:
    redis_client().set(f"{HEARTBEAT}{holder}", 1, ex=30)


def queued(name: str) -> list[dict[str, Any]]:
    return [json.loads(raw) for raw in redis_client().lrange(name, 0, -1)]


@pytest.fixture
def broker(clean_redis: None) -> Any:
    assert current_app.conf.broker_url.startswith("redis://")
    return redis_client()


def test_a_dead_holders_messages_go_back_to_the_head_of_their_queue(broker: Any) -> None:
    # given: a live and a dead holder, each with two messages, and a message already waiting
    broker.lpush(QUEUE, json.dumps(message("waiting")))
    beat("live:1:a/1")
    mine = [hold("live:1:a/1", "live-1"), hold("live:1:a/1", "live-2")]
    theirs = [hold("dead:2:b/1", "dead-1"), hold("dead:2:b/1", "dead-2", priority=9)]

    # when
    restored = restore_lost()

    # then: the dead holder's are back (kombu pops from the right: they come next), marked
    # redelivered, in the list of their priority; the live holder's stay where they were
    assert restored == 2
    assert [m["headers"]["id"] for m in queued(QUEUE)] == ["waiting", "dead-1"]
    assert [m["headers"]["id"] for m in queued(f"{QUEUE}:9")] == ["dead-2"]
    assert queued(QUEUE)[-1]["headers"]["redelivered"] is True
    for tag in mine:
        assert broker.hexists("unacked", tag) and broker.zscore("unacked_index", tag)
        assert broker.hget(OWNERS, tag) == b"live:1:a/1"
    for tag in theirs:
        assert not broker.hexists("unacked", tag) and not broker.zscore("unacked_index", tag)
        assert not broker.hexists(OWNERS, tag)
    assert int(broker.get(RESTORED)) == 2
    # and the dead holder leaves the registry once it holds nothing
    restore_lost()
    assert b"dead:2:b/1" not in broker.smembers(WORKERS)
    assert b"live:1:a/1" in broker.smembers(WORKERS)


def test_running_or_finished_jobs_messages_are_dropped_not_restored(broker: Any) -> None:
    tags = [hold("dead:2:b/1", "waiting-job"), hold("dead:2:b/1", "running-job")]

    restored = restore_lost(settled=lambda ids: {i for i in ids if i.startswith("running")})

    assert restored == 1
    assert [m["headers"]["id"] for m in queued(QUEUE)] == ["waiting-job"]
    assert not any(broker.hexists("unacked", t) or broker.hexists(OWNERS, t) for t in tags)
    assert int(broker.get(DROPPED)) == 1


def test_a_stamped_message_goes_back_unstamped_and_its_holders_own_copy_reads_the_row(
    broker: Any,
) -> None:
    # given: a dead holder's two stamped messages (sent right after their rows were written):
    # one whose run started (its record, DEFER_CLAIM), one it had only prefetched
    born: dict[str, Any] = {running.BORN: [int(time.time() * 1000), None]}
    hold("dead:2:b/1", "started", **born)
    hold("dead:2:b/1", "prefetched", **born)
    token = str(uuid.uuid4())
    assert running.start("started", token, 30) == "ok"

    # when the sweep gives them back
    assert restore_lost() == 2

    # then the copies carry no `born`: whichever worker takes them reads the row first
    assert all(running.BORN not in m["headers"] for m in queued(QUEUE))
    # the run that started keeps its record (its lease decides: a copy meanwhile is busy)
    assert running.start("started", str(uuid.uuid4()), 30) == "busy"
    assert broker.hget(f"{running.PREFIX}started", "token") == token.encode()
    # the holder's own copy of the prefetched one, should it wake up and run it, reads the
    # row too: the job has a claimed record, which expires
    assert running.start("prefetched", str(uuid.uuid4()), 30) == "claimed"
    assert 0 < broker.pttl(f"{running.PREFIX}prefetched") <= running.KEEP_MS


def test_a_message_another_holder_took_since_is_not_touched(broker: Any) -> None:
    # the dead holder's record was overwritten: the message went back and a live one took it
    tag = hold("dead:2:b/1", "job")
    beat("live:1:a/1")
    broker.hset(OWNERS, tag, "live:1:a/1")

    assert restore_lost() == 0
    assert broker.hexists("unacked", tag) and not broker.llen(QUEUE)


def test_a_holder_whose_heartbeat_comes_back_keeps_its_messages(
    broker: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    tag = hold("slow:3:c/1", "job")
    real = restore._alive

    def alive_then_back(client: Any, prefix: str, workers: list[str]) -> dict[str, bool]:
        found = real(client, prefix, workers)
        beat("slow:3:c/1")  # its thread beat between the check and the move
        return found

    monkeypatch.setattr(restore, "_alive", alive_then_back)
    assert restore_lost() == 0
    assert broker.hexists("unacked", tag) and not broker.llen(QUEUE)


def test_a_record_whose_message_was_acknowledged_is_cleaned_up(broker: Any) -> None:
    tag = hold("dead:2:b/1", "job")
    live = hold("live:1:a/1", "other")
    kept = hold("live:1:a/1", "kept")
    beat("live:1:a/1")
    broker.hdel("unacked", tag, live)  # acked by a path that left the records

    assert restore_lost() == 0  # the first sweep of a minute reads every record
    assert not broker.hexists(OWNERS, tag) and not broker.llen(QUEUE)
    assert not broker.hexists(OWNERS, live)
    assert broker.hget(OWNERS, kept) == b"live:1:a/1" and broker.hexists("unacked", kept)


def test_a_holder_outside_the_registry_is_left_alone(broker: Any) -> None:
    # Redis lost the registry and the heartbeats (a flush), not the holder's records: whether
    # it lives is unknown until it beats again (it re-registers with each beat)
    tag = hold("unknown:4:d/1", "job")
    broker.srem(WORKERS, "unknown:4:d/1")

    assert restore_lost() == 0
    assert broker.hexists("unacked", tag) and broker.hexists(OWNERS, tag)


def test_a_heartbeat_covers_every_open_channel_of_the_worker(broker: Any) -> None:
    class Holder:
        def __init__(self) -> None:
            self.open = True
            self.owner: str | None = None

    keeper = heartbeat.Heartbeat()
    keeper.worker_id = "node@host:1:abcd"
    keeper._app, keeper._pid = current_app, os.getpid()
    first, second = Holder(), Holder()
    first.owner = keeper.register(first)
    second.owner = keeper.register(second)
    assert (first.owner, second.owner) == ("node@host:1:abcd/1", "node@host:1:abcd/2")
    # a holder's first beat lasts until the thread runs (STARTUP_TTL)
    assert broker.ttl(f"{HEARTBEAT}{first.owner}") > heartbeat.HEARTBEAT_TTL

    second.open = False  # its channel closed with a lost connection
    broker.delete(f"{HEARTBEAT}{first.owner}", f"{HEARTBEAT}{second.owner}")
    keeper.beat()

    assert 0 < broker.ttl(f"{HEARTBEAT}{first.owner}") <= heartbeat.HEARTBEAT_TTL
    assert not broker.exists(f"{HEARTBEAT}{second.owner}")


def test_a_beat_while_a_channel_registers_covers_it(broker: Any) -> None:
    # given: the heartbeat thread beating while a new channel's first beat waits on Redis (a
    # reconnect after an outage); in CI this race killed the thread (AttributeError 'owner'),
    # so the live worker's holders lapsed and its messages were given back as a dead one's
    class Holder:
        def __init__(self) -> None:
            self.open = True

    keeper = heartbeat.Heartbeat()
    keeper.worker_id = "node@host:2:beef"
    keeper._app, keeper._pid = current_app, os.getpid()
    first_beat = keeper._beat
    beaten: list[list[str]] = []

    def beat_meanwhile(owners: list[str], ttl: int) -> None:
        beaten.append(owners)
        if len(beaten) == 1:
            keeper.beat()  # what the thread does while register() waits here
        first_beat(owners, ttl)

    keeper._beat = beat_meanwhile  # type: ignore[method-assign]

    # when
    owner = keeper.register(Holder())  # type: ignore[arg-type]

    # then: register's beat and the thread's beat in between both covered the new holder
    assert owner == "node@host:2:beef/1"
    assert beaten == [[owner], [owner]]
    assert broker.ttl(f"{HEARTBEAT}{owner}") > 0


def test_metrics_count_what_the_sweep_gave_back_and_dropped(broker: Any) -> None:
    from jobs.web.metrics import _processes

    hold("dead:2:b/1", "waiting-job")
    hold("dead:2:b/1", "running-job")
    restore_lost(settled=lambda ids: {"running-job"})

    values = {
        family.name: family.samples[0].value
        for family in _processes()
        if family.name.startswith("backlot_reservations")
    }
    assert values == {"backlot_reservations_restored": 1, "backlot_reservations_dropped": 1}
