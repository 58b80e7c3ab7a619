"""Dramatiq on Redis (peers venv only): `dramatiq benchmarks.peers.dramatiq_app`."""

from __future__ import annotations

import os

import dramatiq
from dramatiq.brokers.redis import RedisBroker

from benchmarks.peers import _stamp

broker = RedisBroker(url=os.environ["PEERS_REDIS_URL"])
dramatiq.set_broker(broker)


@dramatiq.actor(queue_name="default")
def noop(i: int) -> None:
    """Nothing: what the drain measures is the queue."""


@dramatiq.actor(queue_name="default")
def stamp(key: str) -> None:
    _stamp.stamp(key)
