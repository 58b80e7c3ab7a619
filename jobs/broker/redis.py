"""The platform's own Redis connection (rate limits, concurrency slots, counters, beat's lock,
worker heartbeats, queue depths) and the broker URL Celery gets, on one Redis or through
Redis Sentinel.

With ``BACKLOT['REDIS_SENTINELS']`` and ``REDIS_SENTINEL_MASTER`` set (jobs.core.conf), every
connection asks the Sentinels where the primary is, as redis-py's
``Sentinel(...).master_for(name)`` and kombu's ``sentinel://`` transport do: after a failover
the next connection goes to the promoted replica. A connection that finds no primary (the
Sentinels have not agreed on one yet) fails like a dead Redis (``MasterNotFoundError`` is a
``ConnectionError``), which every caller already survives.
"""

from __future__ import annotations

import functools
from typing import Any
from urllib.parse import quote, unquote, urlsplit

import redis
from redis.sentinel import Sentinel

from jobs.core.conf import backlot_settings

# Bounded timeouts: a dead or frozen Redis fails a call in 2 s, it never hangs a job.
SOCKET_TIMEOUT = 2.0
HEALTH_CHECK_INTERVAL = 25


@functools.cache
def redis_client() -> redis.Redis:
    """The platform's Redis connection pool (redis-py resets it in forked children)."""
    return connect(timeout=SOCKET_TIMEOUT, health_check_interval=HEALTH_CHECK_INTERVAL)


def connect(*, timeout: float, health_check_interval: int = 0) -> redis.Redis:
    """A new client of the configured Redis (the Sentinels' current primary when they are set)
    whose calls and connects give up after ``timeout`` seconds."""
    conf = backlot_settings()
    timeouts: dict[str, Any] = {"socket_timeout": timeout, "socket_connect_timeout": timeout}
    if not conf.REDIS_SENTINELS:
        return redis.Redis.from_url(
            conf.REDIS_URL, health_check_interval=health_check_interval, **timeouts
        )
    sentinel = Sentinel(
        sentinel_addresses(),
        sentinel_kwargs={**timeouts, **_sentinel_auth()},
        **timeouts,
    )
    client: redis.Redis = sentinel.master_for(
        conf.REDIS_SENTINEL_MASTER,
        redis_class=redis.Redis,
        health_check_interval=health_check_interval,
        **_primary_params(),
    )
    return client


def sentinel_addresses() -> list[tuple[str, int]]:
    """(host, port) of each configured Sentinel; empty without Sentinel."""
    addresses = []
    for address in backlot_settings().REDIS_SENTINELS:
        host, _, port = address.rpartition(":")
        addresses.append((host.strip("[]"), int(port)))
    return addresses


def broker_url() -> str:
    """The broker URL for Celery: REDIS_URL, or with Sentinels kombu's
    ``sentinel://[:password@]host:port/db;sentinel://...`` (the master name goes in the
    transport options, broker_transport_options())."""
    conf = backlot_settings()
    if not conf.REDIS_SENTINELS:
        return conf.REDIS_URL
    params = _primary_params()
    auth = ""
    if params.get("password") is not None or params.get("username") is not None:
        auth = f"{quote(params.get('username') or '', safe='')}:"
        auth += f"{quote(params.get('password') or '', safe='')}@"
    return ";".join(
        f"sentinel://{auth}{address}/{params['db']}" for address in conf.REDIS_SENTINELS
    )


def broker_transport_options() -> dict[str, Any]:
    """What kombu's Sentinel transport needs beside the URL: the master's name, and the
    Sentinels' own password and timeouts (kombu would otherwise derive them from the
    primary's). Empty without Sentinel."""
    conf = backlot_settings()
    if not conf.REDIS_SENTINELS:
        return {}
    timeouts = {"socket_timeout": SOCKET_TIMEOUT, "socket_connect_timeout": SOCKET_TIMEOUT}
    return {
        "master_name": conf.REDIS_SENTINEL_MASTER,
        "sentinel_kwargs": {**timeouts, **_sentinel_auth()},
    }


def _sentinel_auth() -> dict[str, str]:
    password = backlot_settings().REDIS_SENTINEL_PASSWORD
    return {"password": password} if password else {}


def _primary_params() -> dict[str, Any]:
    """The primary's user, password and database, from REDIS_URL (its first part when it is a
    sentinel:// list); the host in it is not used with Sentinels."""
    url = backlot_settings().REDIS_URL.split(";")[0].strip()
    parts = urlsplit(url)
    params: dict[str, Any] = {"db": 0}
    path = parts.path.strip("/")
    if path.isdigit():
        params["db"] = int(path)
    if parts.username:
        params["username"] = unquote(parts.username)
    if parts.password is not None:
        params["password"] = unquote(parts.password)
    return params


def redis_text(value: bytes | str) -> str:
    """A reply of redis_client() as text: it answers bytes, redis-py types replies bytes | str."""
    return value.decode() if isinstance(value, bytes) else value
