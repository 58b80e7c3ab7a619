"""Huey on Redis (peers venv only): `huey_consumer benchmarks.peers.huey_app.huey`."""

from __future__ import annotations

import os

from huey import RedisHuey

from benchmarks.peers import _stamp

huey = RedisHuey("peers", url=os.environ["PEERS_REDIS_URL"])


@huey.task()
def noop(i: int) -> None:
    """Nothing: what the drain measures is the queue."""


@huey.task()
def stamp(key: str) -> None:
    _stamp.stamp(key)
