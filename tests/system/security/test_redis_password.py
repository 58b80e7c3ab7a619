"""A password in REDIS_URL is used for the broker; a wrong one leaves the job in the outbox.

A private redis-server with `requirepass` (a free loopback port, not daemonized, no
persistence, stopped by PID); enqueues run in a fresh process so that REDIS_URL is read at
start-up, as in production. The ledger is the real PostgreSQL test database.
"""

from __future__ import annotations

import json
import secrets
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from jobs.broker.queues import queue_keys as broker_queue_keys
from jobs.flow.relay import RELAY_GRACE
from jobs.models import Job, JobState
from tests.conftest import ROOT, wait_until
from tests.system.security.logscan import remember_secret

pytestmark = pytest.mark.django_db(transaction=True)

# Runs in a fresh interpreter; prints one JSON line: the job id and how long enqueue took.
ENQUEUE = """
import json, time
import django
django.setup()
from tests.support.tasks import prioritized
started = time.monotonic()
handle = prioritized.enqueue("k", "x")
print(json.dumps({"job_id": handle.id, "seconds": time.monotonic() - started}))
"""
RELAY = """
import django
django.setup()
import tests.support.tasks
from jobs.flow.relay import job_relay
print(job_relay())
"""
# Enqueue against a broker that refuses us must give up this fast (bounded publish retries).
ENQUEUE_BOUND_SECONDS = 5


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class PasswordRedis:
    port: int
    password: str
    process: subprocess.Popen

    def url(self, password: str | None) -> str:
        auth = f":{password}@" if password is not None else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def client(self, password: str | None) -> redis.Redis:
        # No retries: redis-py retries connection errors (a refused AUTH is one) with backoff.
        return redis.Redis(
            host="127.0.0.1",
            port=self.port,
            password=password,
            socket_timeout=5,
            socket_connect_timeout=2,
            retry=Retry(NoBackoff(), 0),
        )

    def queued(self, queue: str) -> list[dict[str, Any]]:
        """The messages waiting in `queue` (every priority list), as kombu stored them."""
        client = self.client(self.password)
        return [
            json.loads(raw) for key in broker_queue_keys(queue) for raw in client.lrange(key, 0, -1)
        ]


@pytest.fixture
def password_redis(tmp_path: Path) -> Iterator[PasswordRedis]:
    password = remember_secret(secrets.token_hex(16))
    port = free_port()
    # The configuration goes in on stdin so that the password never shows in `ps`.
    config = (
        f'bind 127.0.0.1\nport {port}\nrequirepass {password}\ndaemonize no\nsave ""\n'
        f"appendonly no\ndir {tmp_path}\nlogfile {tmp_path / 'redis.log'}\n"
    )
    process = subprocess.Popen(
        ["redis-server", "-"],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert process.stdin is not None  # stdin=PIPE
    process.stdin.write(config)
    process.stdin.close()
    server = PasswordRedis(port=port, password=password, process=process)

    def answers() -> bool:
        if process.poll() is not None:
            raise AssertionError(f"redis-server exited: {(tmp_path / 'redis.log').read_text()}")
        try:
            return bool(server.client(password).ping())
        except redis.ConnectionError:
            return False

    try:
        wait_until(answers, timeout=20, what=f"password-protected redis on {port}")
        yield server
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


def run_django(code: str, env: dict[str, str], redis_url: str) -> tuple[str, str]:
    """Run `code` in a new Django process against `redis_url`; (last stdout line, all output)."""
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**env, "DJANGO_SETTINGS_MODULE": "config.settings", "REDIS_URL": redis_url},
        check=False,  # asserted below, with the output in the message
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    return done.stdout.strip().splitlines()[-1], output


def test_the_password_in_redis_url_is_used_to_publish(password_redis, worker_env):
    line, output = run_django(ENQUEUE, worker_env, password_redis.url(password_redis.password))
    job_id = json.loads(line)["job_id"]

    [message] = password_redis.queued("reports")
    assert message["headers"]["id"] == job_id and message["headers"]["task"] == "tests.prioritized"
    job = Job.objects.get(id=job_id)
    assert job.state == JobState.QUEUED and job.published_at is not None
    assert password_redis.password not in output


def test_a_wrong_password_leaves_the_job_in_the_outbox_without_hanging(password_redis, worker_env):
    wrong = remember_secret(secrets.token_hex(16))

    line, output = run_django(ENQUEUE, worker_env, password_redis.url(wrong))

    result = json.loads(line)
    assert result["seconds"] < ENQUEUE_BOUND_SECONDS, result
    job = Job.objects.get(id=result["job_id"])
    assert job.state == JobState.QUEUED and job.published_at is None
    assert password_redis.queued("reports") == []
    assert wrong not in output and password_redis.password not in output

    # The job was accepted, not lost: the relay with the right password publishes it (once the
    # relay's grace for the fast path is over: the row is aged rather than the test waiting).
    Job.objects.filter(id=job.id).update(enqueued_at=job.enqueued_at - RELAY_GRACE)
    relayed, _ = run_django(RELAY, worker_env, password_redis.url(password_redis.password))
    assert relayed == "1"
    [message] = password_redis.queued("reports")
    assert message["headers"]["id"] == result["job_id"]
    job.refresh_from_db()
    assert job.published_at is not None


@pytest.mark.parametrize("password", [None, "wrong-password"], ids=["no-password", "wrong"])
def test_redis_refuses_clients_without_the_password(password_redis, password):
    with pytest.raises(redis.AuthenticationError):
        password_redis.client(password).ping()
