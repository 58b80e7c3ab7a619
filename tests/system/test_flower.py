"""Flower, run as the Procfile runs it, refuses anonymous requests and lists the platform's jobs."""

from __future__ import annotations

import base64
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from config.celery import app as celery_app
from jobs.models import Job, JobState
from tests.conftest import LOG_DIR, ROOT, Worker, wait_until
from tests.support import tasks


class Flower:
    """A real `celery flower` process with basic auth, on the test broker."""

    user = "ops"

    def __init__(self, env: dict[str, str]) -> None:
        self.port, self.password = free_port(), secrets.token_urlsafe(18)
        self.url = f"http://127.0.0.1:{self.port}"
        LOG_DIR.mkdir(parents=True, exist_ok=True)
        self.log_path = LOG_DIR / f"flower-{self.port}.log"
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "celery",
                    "-A",
                    "config",
                    "flower",
                    "--conf=config/flowerconfig.py",
                    f"--port={self.port}",
                    "--address=127.0.0.1",
                    f"--basic-auth={self.user}:{self.password}",
                ],
                cwd=ROOT,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def get(
        self, path: str, auth: tuple[str, str] | None = None, timeout: float = 10
    ) -> tuple[int, bytes]:
        """GET `path`; (status, body), also for 4xx/5xx answers."""
        request = urllib.request.Request(self.url + path)
        if auth is not None:
            token = base64.b64encode(f"{auth[0]}:{auth[1]}".encode()).decode()
            request.add_header("Authorization", f"Basic {token}")
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as error:
            return error.code, error.read()

    def get_ok(self, path: str) -> bytes:
        status, body = self.get(path, auth=(self.user, self.password))
        assert status == 200, f"GET {path} with credentials: {status} {body[:300]!r}"
        return body

    def alive(self) -> bool:
        if self.process.poll() is not None:
            raise AssertionError(f"flower exited with {self.process.returncode}:\n{self.output()}")
        return True

    def hears(self, worker: Worker) -> bool:
        """Flower has received an event from `worker` (after asking it for a heartbeat)."""
        # Events are fanned out, not queued: Flower sees only what is sent after it has
        # subscribed. A heartbeat it received proves the subscription is live; the worker
        # runs --without-heartbeat, so ask it for one.
        celery_app.control.heartbeat(destination=[worker.name])
        try:
            status, body = self.get("/metrics", auth=(self.user, self.password), timeout=2)
        except OSError:  # not serving yet (or not Flower on that port: alive() tells)
            return False
        online = f'flower_worker_online{{worker="{worker.name}"}} 1.0'
        return status == 200 and online in body.decode()

    def wait_ready(self, worker: Worker) -> None:
        wait_until(
            lambda: self.alive() and answers(self.port),
            timeout=30,
            interval=0.1,
            what=f"flower to listen on {self.port}",
        )
        wait_until(
            lambda: self.alive() and self.hears(worker),
            timeout=30,
            interval=0.5,
            what=f"flower to receive events from {worker.name}",
        )

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


@pytest.fixture(scope="module")
def flower(worker_env: dict[str, str], session_worker: Worker) -> Iterator[Flower]:
    """A real Flower on the test broker, already receiving the session worker's events."""
    for attempt in range(3):
        server = Flower(worker_env)
        try:
            server.wait_ready(session_worker)
            break
        except BaseException:
            server.stop()
            # Another process may take the free port before Flower binds it: try another.
            if attempt == 2 or "Address already in use" not in server.output():
                print(f"flower log:\n{server.output()}")
                raise
    try:
        yield server
    finally:
        server.stop()


# /metrics too: Flower 2.x leaves it open, config/flowerconfig.py puts it behind the login.
@pytest.mark.parametrize("path", ["/", "/api/tasks", "/api/workers", "/metrics"])
def test_refuses_requests_without_valid_credentials(flower: Flower, path: str) -> None:
    anonymous, _ = flower.get(path)
    wrong_password, _ = flower.get(path, auth=(flower.user, flower.password + "x"))

    assert (anonymous, wrong_password) == (401, 401)


@pytest.mark.parametrize("path", ["/", "/api/tasks"])
def test_answers_with_credentials(flower: Flower, path: str) -> None:
    status, body = flower.get(path, auth=(flower.user, flower.password))

    assert status == 200, body[:300]


def test_a_finished_job_appears_in_the_api(flower: Flower, worker: Worker) -> None:
    # given Flower already listening to the worker's events (the fixture waited for that)
    # when a job runs to the end on the session worker
    handle = tasks.add.enqueue(2, 3)
    wait_until(
        lambda: Job.objects.filter(id=handle.id, state=JobState.SUCCEEDED).exists(),
        what=f"job {handle.id} to succeed",
    )

    # then Flower lists it, finished, under the job's id
    def listed() -> dict[str, Any] | None:
        found = json.loads(flower.get_ok("/api/tasks")).get(handle.id)
        return found if found and found.get("state") == "SUCCESS" else None

    task = wait_until(
        listed, timeout=15, interval=0.2, what=f"flower to list {handle.id} as SUCCESS"
    )
    assert (task["name"], task["worker"], task["result"]) == ("tests.add", worker.name, "5")
