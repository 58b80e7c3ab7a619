"""Case 5: enqueue endpoints under gunicorn vs a trivial view on the same server, and the parts
of POST /api/emails/ (token authentication, template render, idempotency row, the send job's
rate and concurrency gates) each alone.

gunicorn serves the project (benchmarks.settings: the project's settings and URLs plus the
views in benchmarks.urls) with the Procfile's 2 sync workers on a loopback port. One client
sends the requests one after another, a new connection each (gunicorn's sync workers close
it), interleaving the views request by request. No Celery worker runs: jobs only queue up.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable

from django.contrib.auth import get_user_model
from django.db import connection

from benchmarks.harness import (
    LOG_DIR,
    ROOT,
    CaseResult,
    empty_queues,
    percentile,
    register,
    unregister,
    wait_until,
)
from benchmarks.sizes import SIZES
from web.models import ApiToken


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Gunicorn:
    def __init__(self, port: int) -> None:
        LOG_DIR.mkdir(parents=True, exist_ok=True)
        self.port = port
        self.log_path = LOG_DIR / f"gunicorn-{port}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 (the server's lifetime; stop() closes it)
        env = {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "benchmarks.settings",
            "PYTHONUNBUFFERED": "1",
        }
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gunicorn",
                "config.wsgi:application",
                "--bind",
                f"127.0.0.1:{port}",
                "--workers",
                "2",
                "--timeout",
                "30",
                "--name",
                "bench-gunicorn",
            ],
            cwd=ROOT,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        register(self.process.pid)

    def wait_ready(self) -> None:
        def answers() -> bool:
            if self.process.poll() is not None:
                raise RuntimeError(f"gunicorn exited:\n{self.log_path.read_text()[-3000:]}")
            try:
                return request(self.port, "/bench/trivial/", b"", {})[0] == 200
            except OSError:
                return False

        wait_until(answers, 60, interval=0.2, what="gunicorn")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        unregister(self.process.pid)
        self._log.close()


def request(port: int, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("POST", path, body=body, headers=headers)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def _with_new_key() -> bytes:
    return f"n=1&key={uuid.uuid4().hex}".encode()


def run(*, full: bool = False) -> CaseResult:
    size = SIZES["http"]
    count = size.count(full)
    result = CaseResult(
        case="http",
        title="5. HTTP under gunicorn (2 sync workers): enqueue endpoints vs a trivial view",
        params={
            "requests_per_view": count,
            "server": "gunicorn config.wsgi --workers 2 (sync)",
            "client": "one client, sequential, new connection per request",
        },
    )
    if count != size.issue:
        result.notes.append(f"scaled: {count:,} requests per view instead of {size.issue:,}")
    # The project's real JSON endpoint, authenticated by a bearer token.
    user, _ = get_user_model().objects.get_or_create(username="bench-http")
    _, token = ApiToken.issue(user=user, name=f"bench {uuid.uuid4().hex[:6]}")
    connection.close()
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    # name -> (path, body or a function making each request's, headers, status, what)
    views: dict[str, tuple[str, bytes | Callable[[], bytes], dict[str, str], int, str]] = {
        "trivial": ("/bench/trivial/", b"n=1", form, 200, "POST, returns JSON, no job"),
        "bare_delay": ("/bench/delay/", b"n=1", form, 202, "POST, bare Celery delay()"),
        "backlot_enqueue": (
            "/bench/enqueue/",
            b"n=1",
            form,
            202,
            "POST, Backlot enqueue() with the ledger",
        ),
        "api_email": (
            "/api/emails/",
            json.dumps(
                {"to": "bench@example.com", "template": "test", "context": {"name": "Bench"}}
            ).encode(),
            {"Content-Type": "application/json", "Authorization": f"Bearer {token}"},
            202,
            "POST /api/emails/ "
            "(token auth, email row, template render, enqueue with idempotency key)",
        ),
        # its parts beyond an enqueue, each alone (issue 26, item 6)
        "api_token": (
            "/bench/token/",
            b"",
            {"Authorization": f"Bearer {token}"},
            200,
            "POST, the API's token authentication alone (lockout check, token lookup)",
        ),
        "email_render": (
            "/bench/render/",
            b"name=Bench",
            form,
            200,
            "POST, the email's templates rendered alone (subject, text, HTML)",
        ),
        "idempotent_enqueue": (
            "/bench/idempotent/",
            _with_new_key,  # a new key each request: its record's row is written
            form,
            202,
            "POST, Backlot enqueue() holding a new idempotency key",
        ),
        "gated_enqueue": (
            "/bench/gated/",
            b"n=1",
            form,
            202,
            "POST, Backlot enqueue() of a no-op behind emails.send's gates (keyed rate and "
            "concurrency limits)",
        ),
    }
    empty_queues()
    samples: dict[str, list[float]] = {name: [] for name in views}
    server = Gunicorn(free_port())
    try:
        server.wait_ready()
        for i in range(count + 20):  # the first 20 rounds warm up both gunicorn workers
            for name, (path, body, headers, expected, _) in views.items():
                sent = body() if callable(body) else body
                started = time.perf_counter()
                status, payload = request(server.port, path, sent, headers)
                elapsed = (time.perf_counter() - started) * 1000
                if status != expected:
                    raise AssertionError(f"{name}: HTTP {status}: {payload[:300]!r}")
                if i >= 20:
                    samples[name].append(elapsed)
    finally:
        server.stop()
    empty_queues()
    for name, (*_, what) in views.items():
        values = samples[name]
        thirds = [values[len(values) * k // 3 : len(values) * (k + 1) // 3] for k in range(3)]
        result.figure(
            f"{name} p50",
            [percentile(block, 50) for block in thirds],
            "ms",
            higher_is_better=False,
            what=what + " (p50 of each third)",
        )
        result.figure(
            f"{name} p99", [percentile(values, 99)], "ms", higher_is_better=False, what=what
        )
        result.extra.setdefault("distribution_ms", {})[name] = {
            q: round(percentile(values, q), 3) for q in (0, 25, 50, 75, 90, 99, 100)
        }
    overall = result.extra["distribution_ms"]
    over = overall["backlot_enqueue"][50] - overall["trivial"][50]
    result.extra["p50_over_trivial_ms"] = {
        name: round(overall[name][50] - overall["trivial"][50], 3)
        for name in views
        if name != "trivial"
    }
    result.target(
        "enqueue endpoint p50 minus trivial view p50 (ms)", over, "<= 1.5 ms", over <= 1.5
    )
    api_over = overall["api_email"][50] - overall["trivial"][50]
    # what each part of POST /api/emails/ adds: the token and the templates over the trivial
    # view, the idempotency key's row over the plain enqueue
    parts = {
        "token lookup": overall["api_token"][50] - overall["trivial"][50],
        "template render": overall["email_render"][50] - overall["trivial"][50],
        "idempotency row": overall["idempotent_enqueue"][50] - overall["backlot_enqueue"][50],
        "rate and concurrency gates": overall["gated_enqueue"][50] - overall["backlot_enqueue"][50],
    }
    result.extra["api_email_parts_ms"] = {name: round(ms, 3) for name, ms in parts.items()}
    result.target(
        "POST /api/emails/ p50 minus trivial view p50 (ms)",
        api_over,
        "<= 3 ms",
        api_over <= 3,
        detail="the project's real enqueue endpoint: also an email row, a template render, "
        "token auth, the send job's gates; alone: "
        + ", ".join(f"{name} {ms:+.2f} ms" for name, ms in parts.items()),
    )
    return result
