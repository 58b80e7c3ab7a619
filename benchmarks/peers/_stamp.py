"""The stamp every peer's latency job writes first thing (peers venv and .venv alike)."""

from __future__ import annotations

import functools
import os
import time
from typing import Any

import redis

from benchmarks.peers.common import STAMPS


@functools.cache
def client() -> Any:
    """One pool per process (redis-py gives a forked child a fresh pool)."""
    return redis.Redis.from_url(
        os.environ["PEERS_REDIS_URL"], socket_timeout=5, socket_connect_timeout=2
    )


def stamp(key: str) -> None:
    client().rpush(STAMPS + key, repr(time.time()))
