"""The platform's own Redis connection (rate limits, counters, beat's lock, queue depths)."""

from __future__ import annotations

import functools

import redis

from .conf import backlot_settings


@functools.cache
def redis_client() -> redis.Redis:
    """The platform's Redis connection pool (redis-py resets it in forked children).

    Bounded timeouts: a dead or frozen Redis fails a call in 2 s, it never hangs a job.
    """
    return redis.Redis.from_url(
        backlot_settings().REDIS_URL,
        socket_timeout=2,
        socket_connect_timeout=2,
        health_check_interval=25,
    )


def redis_text(value: bytes | str) -> str:
    """A reply of redis_client() as text: it answers bytes, redis-py types replies bytes | str."""
    return value.decode() if isinstance(value, bytes) else value
