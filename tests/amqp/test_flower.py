"""Flower, run as the Procfile runs it, on RabbitMQ: it refuses anonymous requests and lists the
site's workers and the platform's jobs they run (its Broker page needs RabbitMQ's management
API, which docs/scaling.md says to enable; this node runs without plugins)."""

from __future__ import annotations

import base64
import json
import secrets
import socket
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from jobs.testing import wait_until
from tests.amqp.site import Process, Site

USER = "ops"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def get(url: str, auth: tuple[str, str] | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(url)
    if auth is not None:
        token = base64.b64encode(f"{auth[0]}:{auth[1]}".encode()).decode()
        request.add_header("Authorization", f"Basic {token}")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()
    except OSError:
        return 0, b""


@pytest.fixture(scope="module")
def flower(amqp_site: Site) -> Iterator[tuple[str, str]]:
    port, password = free_port(), secrets.token_urlsafe(18)
    process = Process(
        "flower",
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "config",
            "flower",
            "--conf=config/flowerconfig.py",
            f"--port={port}",
            "--address=127.0.0.1",
            f"--basic-auth={USER}:{password}",
        ],
        amqp_site.env,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: get(f"{url}/")[0] == 401, timeout=60, what="flower listening")
        yield url, password
    finally:
        process.stop()


def test_flower_on_rabbitmq_refuses_anonymous_requests_and_lists_the_workers(
    site: Site, flower: tuple[str, str]
):
    url, password = flower
    for path in ("/", "/api/workers", "/metrics"):
        assert get(f"{url}{path}")[0] == 401, path
        assert get(f"{url}{path}", auth=(USER, "wrong"))[0] == 401, path

    alive = {worker.name for worker in site.workers if worker.process.poll() is None}

    def workers() -> dict | None:
        status, body = get(f"{url}/api/workers?refresh=1", auth=(USER, password))
        found = json.loads(body) if status == 200 else {}
        return found if alive <= set(found) else None

    found = wait_until(workers, timeout=60, interval=1, what="Flower listing the workers")
    for detail in found.values():
        assert "tests.amqp.work" in detail["registered"]
