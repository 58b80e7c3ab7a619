"""Redis Sentinel settings (jobs.core.conf, jobs.broker.redis, jobs.worker.celery) and a real
failover on this
machine: a primary, its replica and a Sentinel (`redis-server --sentinel`) on free local ports;
the platform's Redis client and the broker connection follow the primary the Sentinel names.

The multi-host test under load is tests/scale/test_failover.py.
"""

from __future__ import annotations

import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from django.core.exceptions import ImproperlyConfigured
from django.test import override_settings
from kombu import Connection

from jobs.broker.redis import broker_transport_options, broker_url, connect, sentinel_addresses
from jobs.core.conf import backlot_settings
from jobs.worker.celery import platform_settings, platform_transport_options
from tests.conftest import wait_until

MASTER = "backlot-test"


def backlot(**values: Any) -> Any:
    from django.conf import settings

    return override_settings(BACKLOT={**settings.BACKLOT, **values})


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_sentinels_without_a_master_name_are_refused() -> None:
    with (
        backlot(REDIS_SENTINELS=("s1:26379",), REDIS_SENTINEL_MASTER=""),
        pytest.raises(ImproperlyConfigured, match="REDIS_SENTINEL_MASTER"),
    ):
        backlot_settings()


def test_a_master_name_without_sentinels_is_refused() -> None:
    with (
        backlot(REDIS_SENTINELS=(), REDIS_SENTINEL_MASTER="mymaster"),
        pytest.raises(ImproperlyConfigured, match="REDIS_SENTINELS"),
    ):
        backlot_settings()


@pytest.mark.parametrize("address", ["s1", "s1:port", ":26379", "s1:70000"])
def test_a_sentinel_that_is_not_host_port_is_refused(address: str) -> None:
    with (
        backlot(REDIS_SENTINELS=(address,), REDIS_SENTINEL_MASTER="mymaster"),
        pytest.raises(ImproperlyConfigured, match=f"{address!r} is not host:port"),
    ):
        backlot_settings()


def test_the_broker_gets_kombus_sentinel_url_and_the_master_name() -> None:
    with backlot(
        REDIS_URL="redis://:s3cr%40t@ignored:6379/2",
        REDIS_SENTINELS=("s1:26379", "s2:26380"),
        REDIS_SENTINEL_MASTER="mymaster",
        REDIS_SENTINEL_PASSWORD="sentinel-pw",
    ):
        assert sentinel_addresses() == [("s1", 26379), ("s2", 26380)]
        assert broker_url() == "sentinel://:s3cr%40t@s1:26379/2;sentinel://:s3cr%40t@s2:26380/2"
        assert platform_settings()["broker_url"] == broker_url()
        options = platform_transport_options()
        assert options["master_name"] == "mymaster"
        assert options["sentinel_kwargs"]["password"] == "sentinel-pw"
        assert options["priority_steps"] == list(range(10))  # the platform's own stay


def test_a_sentinel_url_as_celery_users_write_it() -> None:
    """CELERY_BROKER_URL / REDIS_URL = "sentinel://...;sentinel://..." with the master name in
    the broker's transport options, as Celery's docs have it."""
    with override_settings(
        REDIS_URL="sentinel://:pw@s1:26379/1;sentinel://s2;sentinel://s3:26381",
        CELERY_BROKER_TRANSPORT_OPTIONS={"master_name": "mymaster", "visibility_timeout": 7200},
        BACKLOT={k: v for k, v in _settings_backlot().items() if not k.startswith("REDIS_")},
    ):
        conf = backlot_settings()
        assert conf.REDIS_SENTINELS == ("s1:26379", "s2:26379", "s3:26381")
        assert conf.REDIS_SENTINEL_MASTER == "mymaster"
        assert broker_transport_options()["master_name"] == "mymaster"
        assert broker_url().startswith("sentinel://:pw@s1:26379/1;")


def test_without_sentinels_nothing_changes() -> None:
    conf = backlot_settings()
    assert conf.REDIS_SENTINELS == ()
    assert broker_url() == conf.REDIS_URL
    assert broker_transport_options() == {}
    assert "master_name" not in platform_transport_options()


def _settings_backlot() -> dict[str, Any]:
    from django.conf import settings

    return dict(settings.BACKLOT)


class Server:
    """A redis-server (or Sentinel) process of this test, stopped by its PID."""

    def __init__(self, directory: Path, *args: str) -> None:
        self.port = free_port()
        directory.mkdir(parents=True, exist_ok=True)
        self.log = open(directory / "log", "wb")  # noqa: SIM115 (closed in stop())
        self.process = subprocess.Popen(
            ["redis-server", *args, "--port", str(self.port), "--bind", "127.0.0.1",
             "--dir", str(directory), "--save", "", "--daemonize", "no"],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
        self.client = redis.Redis(port=self.port, socket_timeout=2, decode_responses=True)
        wait_until(self.answers, timeout=30, interval=0.1, what=f"redis-server :{self.port}")

    def answers(self) -> bool:
        assert self.process.poll() is None, "redis-server exited"
        try:
            return bool(self.client.ping())
        except redis.ConnectionError:
            return False

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)
        self.log.close()


def sentinel_reply(sentinel: Server, *command: str) -> dict[str, str]:
    """A SENTINEL command's flat [field, value, ...] reply as a dict."""
    reply = sentinel.client.execute_command("SENTINEL", *command)
    if isinstance(reply, dict):
        return {str(k): str(v) for k, v in reply.items()}
    return dict(zip(reply[::2], reply[1::2], strict=True))


def master_port(sentinel: Server) -> int:
    _, port = sentinel.client.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", MASTER)
    return int(port)


@pytest.fixture
def sentinel_setup(tmp_path: Path) -> Iterator[dict[str, Server]]:
    servers: dict[str, Server] = {}
    try:
        servers["primary"] = primary = Server(tmp_path / "primary")
        servers["replica"] = replica = Server(
            tmp_path / "replica", "--replicaof", "127.0.0.1", str(primary.port)
        )
        wait_until(
            lambda: replica.client.info("replication")["master_link_status"] == "up",
            timeout=30,
            what="the replica to sync",
        )
        config = tmp_path / "sentinel.conf"
        config.write_text(
            f"sentinel monitor {MASTER} 127.0.0.1 {primary.port} 1\n"
            f"sentinel down-after-milliseconds {MASTER} 1000\n"
            f"sentinel failover-timeout {MASTER} 10000\n"
        )
        servers["sentinel"] = sentinel = Server(tmp_path / "sentinel", str(config), "--sentinel")
        wait_until(
            lambda: int(sentinel_reply(sentinel, "MASTER", MASTER)["num-slaves"]) == 1,
            timeout=30,
            interval=0.2,
            what="the Sentinel to find the replica",
        )
        yield servers
    finally:
        for server in servers.values():
            server.stop()


def test_the_platform_and_the_broker_follow_a_failover(sentinel_setup: dict[str, Server]) -> None:
    primary, replica, sentinel = (
        sentinel_setup["primary"],
        sentinel_setup["replica"],
        sentinel_setup["sentinel"],
    )
    with backlot(
        # Only the Sentinel leads to Redis: nothing listens at this URL's host and port.
        REDIS_URL="redis://127.0.0.1:1/0",
        REDIS_SENTINELS=(f"127.0.0.1:{sentinel.port}",),
        REDIS_SENTINEL_MASTER=MASTER,
    ):
        client = connect(timeout=2)
        client.set("backlot:test:before", "1")
        assert client.info("server")["tcp_port"] == primary.port
        with Connection(broker_url(), transport_options=platform_transport_options()) as broker:
            queue = broker.SimpleQueue("sentinel-test")
            queue.put({"n": 1})
            assert primary.client.llen("sentinel-test") == 1

            def failover() -> bool:
                try:
                    sentinel.client.execute_command("SENTINEL", "FAILOVER", MASTER)
                except redis.ResponseError as exc:
                    # NOGOODSLAVE until the Sentinel has read the replica's INFO once itself.
                    assert "NOGOODSLAVE" in str(exc), exc
                    return False
                return True

            wait_until(failover, timeout=30, interval=0.5, what="the Sentinel to start a failover")
            wait_until(
                lambda: master_port(sentinel) == replica.port,
                timeout=30,
                interval=0.1,
                what="the Sentinel to promote the replica",
            )
            wait_until(
                lambda: replica.client.info("replication")["role"] == "master",
                timeout=30,
                what="the replica to be the master",
            )
            # Until the Sentinel has made the old primary a replica (and closed its clients'
            # connections), it still takes writes on connections opened before the failover:
            # Sentinel clients look the primary up when they connect.
            wait_until(
                lambda: primary.client.info("replication")["role"] == "slave",
                timeout=30,
                what="the old primary to be a replica",
            )

            # The same client and the same broker connection, now on the promoted replica.
            def writes() -> bool:
                try:
                    client.set("backlot:test:after", "2")
                except redis.ConnectionError:
                    return False  # the old primary's connection, dropped: reconnects
                return True

            wait_until(writes, timeout=30, interval=0.2, what="a write after the failover")
            assert client.info("server")["tcp_port"] == replica.port
            assert replica.client.get("backlot:test:after") == "2"
            assert replica.client.get("backlot:test:before") == "1"  # replicated before

            queue.put({"n": 2})
            got = [queue.get(timeout=10).payload for _ in range(2)]
            assert sorted(item["n"] for item in got) == [1, 2]
            queue.close()
