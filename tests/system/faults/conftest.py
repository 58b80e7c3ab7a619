"""Fault-injection fixtures: a private Redis per test, workers and clients pointed at it.

A fault test stops, freezes or restarts Redis, so it gets its own redis-server (a free port on
127.0.0.1, AOF everysec, noeviction, stopped by PID) instead of the shared test Redis. Workers
(real `celery worker` processes) and client processes (enqueue, relay: see driver.py) use it
as their REDIS_URL; the ledger is the real PostgreSQL test database. Run counters live in the
shared test Redis (FAULTS_COUNTER_URL) so that a restart of the private one cannot lose them,
and applied effects are rows in `faults_applied` (see jobs.py). The PostgreSQL tests get a
private cluster as well (`private_postgres`), for the same reason.

Each test reports one line of figures with `figures(...)`; they are printed again at the end of
the session.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from django.conf import settings
from django.db import connection

from config.celery import app as celery_app
from jobs.broker.running import PREFIX as RUN_PREFIX
from jobs.core.states import WAITING_STATES
from jobs.models import DeadLetter, Job, JobState
from tests.conftest import LOG_DIR, ROOT, Worker, wait_until
from tests.system.faults.jobs import APPLIED_TABLE

FIGURES: list[str] = []


def figures(line: str) -> None:
    """Print a test's summary line now and keep it for the end of the session."""
    print(f"\nfaults: {line}", flush=True)
    FIGURES.append(line)


def pytest_sessionfinish(session: pytest.Session) -> None:
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # a pytest-xdist process: tests/conftest.py prints them
        workeroutput["fault_figures"] = list(FIGURES)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if FIGURES:
        terminalreporter.section("fault-injection figures")
        for line in FIGURES:
            terminalreporter.write_line(f"faults: {line}")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class PrivateRedis:
    """A redis-server of our own: AOF everysec, no snapshots, noeviction, not daemonized."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen | None = None
        self.client = redis.Redis.from_url(self.url, socket_timeout=5, socket_connect_timeout=1)

    def start(self) -> None:
        assert self.process is None or self.process.poll() is not None, "already running"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.process = subprocess.Popen(
            [
                "redis-server",
                "--bind",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--appendonly",
                "yes",
                "--appendfsync",
                "everysec",
                "--dir",
                str(self.dir),
                "--save",
                "",
                "--maxmemory-policy",
                "noeviction",
                "--daemonize",
                "no",
                "--logfile",
                str(self.dir / "redis.log"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
        )
        wait_until(self.answers, timeout=30, interval=0.05, what=f"redis on {self.port}")

    def answers(self) -> bool:
        if self.process is None or self.process.poll() is not None:
            raise AssertionError(
                f"redis-server exited: {(self.dir / 'redis.log').read_text()[-2000:]}"
            )
        try:
            return bool(self.client.ping())
        except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError):
            return False

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """SIGTERM: Redis flushes the AOF and exits; SIGKILL: a crash."""
        if self.process is not None and self.process.poll() is None:
            if sig != signal.SIGKILL:
                self.process.send_signal(signal.SIGCONT)  # a frozen server cannot stop itself
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        self.client.connection_pool.disconnect()

    def restart(self, sig: int = signal.SIGTERM) -> None:
        """Same port, same directory: the new server reloads the AOF."""
        self.stop(sig)
        self.start()

    def freeze(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def thaw(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)

    def queue_depth(self, queue: str = "default") -> int:
        """Messages waiting in `queue`, over its priority lists (kombu: name, name:1 ... name:9)."""
        names = [queue] + [f"{queue}:{level}" for level in range(1, 10)]
        return sum(self.client.llen(name) for name in names)

    def unacked(self) -> int:
        return int(self.client.hlen("unacked"))

    def queued_ids(self, queue: str = "default") -> list[str]:
        """Task ids of the messages waiting in `queue` (kombu's JSON envelopes)."""
        ids = []
        for name in [queue] + [f"{queue}:{level}" for level in range(1, 10)]:
            for raw in self.client.lrange(name, 0, -1):
                ids.append(json.loads(raw)["headers"]["id"])
        return ids


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[PrivateRedis]:
    server = PrivateRedis(tmp_path / "redis")
    server.start()
    yield server
    server.stop(signal.SIGKILL)


class PrivatePostgres:
    """A PostgreSQL cluster of our own, started and stopped with scripts/services.sh (as
    `make test` starts the shared one), holding a copy of the test database's schema.

    Restarting the shared test PostgreSQL would also cut the pytest process's connection and
    every other test's; a private cluster can be restarted under running workers safely.
    """

    def __init__(self, directory: Path) -> None:
        self.dir = directory / "pg"
        self.port = free_port()
        self.url = f"postgres://backlot@127.0.0.1:{self.port}/backlot"

    def services(self, *args: str) -> None:
        done = subprocess.run(
            [str(ROOT / "scripts" / "services.sh"), *args],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert done.returncode == 0, f"services.sh {args[0]} failed:\n{done.stderr[-3000:]}"

    def start(self) -> None:
        self.services("postgres-up", str(self.dir), str(self.port))

    def stop(self) -> None:
        """`pg_ctl stop -m fast`: every open connection is terminated."""
        self.services("postgres-down", str(self.dir))

    def restart(self) -> float:
        began = time.monotonic()
        self.stop()
        self.start()
        return time.monotonic() - began

    def copy_schema_from(self, source: dict[str, Any]) -> None:
        """The test database's tables (as migrated by pytest-django), without their rows."""
        pg_bin = Path("/usr/lib/postgresql") / (self.dir / "PG_VERSION").read_text().strip() / "bin"
        env = {**os.environ, "PGPASSWORD": source["PASSWORD"] or ""}
        dump = subprocess.run(
            [
                str(pg_bin / "pg_dump"),
                "--schema-only",
                "--no-owner",
                "-h",
                source["HOST"],
                "-p",
                str(source["PORT"]),
                "-U",
                source["USER"],
                source["NAME"],
            ],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
            check=True,
        ).stdout
        subprocess.run(
            [str(pg_bin / "psql"), "-X", "-q", "-v", "ON_ERROR_STOP=1", self.url],
            input=dump,
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )

    def query(self, sql: str, *params: Any) -> list[tuple]:
        import psycopg

        with psycopg.connect(self.url, connect_timeout=5) as conn:
            return conn.execute(sql, params).fetchall()


@pytest.fixture
def private_postgres(applied_table: str, django_db_blocker: Any) -> Iterator[PrivatePostgres]:
    import shutil
    import tempfile

    # Not under pytest's tmp_path (mode 700): the postgres user must reach the cluster directory.
    root = Path(tempfile.mkdtemp(prefix="backlot-faults-pg-", dir="/tmp"))
    root.chmod(0o755)
    server = PrivatePostgres(root)
    server.start()
    try:
        with django_db_blocker.unblock():
            server.copy_schema_from(connection.settings_dict)
        yield server
    finally:
        try:
            server.stop()
        finally:
            shutil.rmtree(root, ignore_errors=True)


class FaultWorker(Worker):
    """A `celery worker` on the private Redis; loads the fault jobs as well as the test jobs.

    tests.conftest.Worker pings through the pytest process's Celery app, which is bound to the
    shared Redis; this one pings through an app bound to the private broker.
    """

    def __init__(
        self, name: str, queues: str, concurrency: int, env: dict[str, str], pool: str = ""
    ) -> None:
        self.name = f"{name}-{uuid.uuid4().hex[:6]}@localhost"
        # set_as_current=False: the project app must stay current_app for the rest of the session
        self.probe = Celery("faults-probe", broker=env["REDIS_URL"], set_as_current=False)
        self.probe.conf.broker_transport_options = dict(celery_app.conf.broker_transport_options)
        LOG_DIR.mkdir(parents=True, exist_ok=True)
        self.log_path = LOG_DIR / f"faults-{self.name.split('@')[0]}.log"
        self.log = open(self.log_path, "wb")  # noqa: SIM115 (the worker writes it until stop())
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                "config",
                "worker",
                "-Q",
                queues,
                "-c",
                str(concurrency),
                "-n",
                self.name,
                "-I",
                "tests.support.tasks,tests.system.faults.jobs",
                "--without-gossip",
                "--without-mingle",
                "--without-heartbeat",
                "-l",
                "INFO",
                *(["-P", pool] if pool else []),
            ],
            cwd=ROOT,
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        wait_until(self.ready, timeout=60, interval=0.25, what=f"worker {self.name} to answer")

    def ready(self) -> bool:
        if self.process.poll() is not None:
            raise AssertionError(f"worker {self.name} exited:\n{self.log_path.read_text()[-3000:]}")
        try:
            return bool(self.probe.control.ping(destination=[self.name], timeout=0.5))
        except (redis.ConnectionError, OSError):
            # the probe's connection predates a Redis restart (its health check finds it closed):
            # not an answer yet; the next ping connects again
            return False

    def kill(self) -> None:
        """kill -9 the main process and its pool processes at once (a host loss, an OOM kill)."""
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=10)
        self.log.close()

    def stop(self) -> None:
        try:
            super().stop()
        finally:
            self.probe.close()


@pytest.fixture
def fault_env(worker_env: dict[str, str], private_redis: PrivateRedis) -> dict[str, str]:
    """Environment of workers and clients of a fault test.

    A 10 s visibility timeout, so that messages of a killed worker come back quickly; the
    countdowns Redis may hold (MAX_BROKER_COUNTDOWN + RATE_LIMIT_MAX_RESERVE = 6 s) stay below it
    as the jobs.E002 check requires.
    """
    return {
        **worker_env,
        "DJANGO_SETTINGS_MODULE": "config.settings",
        "REDIS_URL": private_redis.url,
        "FAULTS_COUNTER_URL": settings.REDIS_URL,
        "CELERY_VISIBILITY_TIMEOUT": "10",
        "BACKLOT_MAX_BROKER_COUNTDOWN": "5",
        "BACKLOT_RATE_LIMIT_MAX_RESERVE": "1",
    }


@pytest.fixture
def start_fault_worker(
    fault_env: dict[str, str], transactional_db: None
) -> Iterator[Callable[..., FaultWorker]]:
    """Start workers on the private Redis; the ones still running are stopped at teardown."""
    started: list[FaultWorker] = []

    def start(
        name: str = "fault",
        queues: str = "default",
        concurrency: int = 2,
        pool: str = "",
        **env: str,
    ) -> FaultWorker:
        worker = FaultWorker(name, queues, concurrency, {**fault_env, **env}, pool)
        started.append(worker)
        return worker

    yield start
    for worker in started:
        if worker.process.poll() is None:
            worker.kill()


class Client:
    """Runs driver.py commands against the private Redis and the test database."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self.background: list[tuple[subprocess.Popen, Any]] = []

    def run(self, command: str, timeout: float = 120, **spec: Any) -> dict[str, Any]:
        done = subprocess.run(
            [sys.executable, "-m", "tests.system.faults.driver", command, json.dumps(spec)],
            cwd=ROOT,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        assert done.returncode == 0, (
            f"driver {command} failed ({done.returncode}):\n{done.stderr[-3000:]}"
        )
        return json.loads(done.stdout.strip().splitlines()[-1])

    def run_raw(
        self, command: str, timeout: float = 60, **spec: Any
    ) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "tests.system.faults.driver", command, json.dumps(spec)],
            cwd=ROOT,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def enqueue(self, task: str, run: str, count: int, start: int = 0, **spec: Any) -> list[str]:
        return self.run("enqueue", task=task, run=run, count=count, start=start, **spec)["ids"]

    def start_relay(self, interval: float = 1.0) -> subprocess.Popen:
        """A relay loop (what beat's `jobs.relay` schedule runs), until the test ends."""
        LOG_DIR.mkdir(parents=True, exist_ok=True)
        log = open(LOG_DIR / f"faults-relay-{uuid.uuid4().hex[:6]}.log", "wb")  # noqa: SIM115 (closed in close())
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.system.faults.driver",
                "relay",
                json.dumps({"interval": interval}),
            ],
            cwd=ROOT,
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.background.append((process, log))
        return process

    def start_background(self, command: str, **spec: Any) -> tuple[subprocess.Popen, Path]:
        """A driver command running while the test goes on; its JSON answer lands in a file."""
        LOG_DIR.mkdir(parents=True, exist_ok=True)
        out_path = LOG_DIR / f"faults-{command}-{uuid.uuid4().hex[:6]}.json"
        out = open(out_path, "wb")  # noqa: SIM115 (closed in close())
        process = subprocess.Popen(
            [sys.executable, "-m", "tests.system.faults.driver", command, json.dumps(spec)],
            cwd=ROOT,
            env=self.env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.background.append((process, out))
        return process, out_path

    def close(self) -> None:
        for process, log in self.background:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait(timeout=5)
            log.close()


@pytest.fixture
def client_procs(fault_env: dict[str, str], start_fault_worker: Any) -> Iterator[Client]:
    """Client processes; torn down before the workers (it depends on start_fault_worker)."""
    client = Client(fault_env)
    yield client
    client.close()


@pytest.fixture(scope="session")
def applied_table(django_db_setup: Any, django_db_blocker: Any) -> str:
    """The effects log: one row per applied effect, deliberately without a unique key."""
    with django_db_blocker.unblock(), connection.cursor() as cursor:
        cursor.execute(
            f"CREATE TABLE IF NOT EXISTS {APPLIED_TABLE} (id bigserial PRIMARY KEY,"
            " run text NOT NULL, item integer NOT NULL, job_id uuid, pid integer,"
            " at timestamptz NOT NULL DEFAULT now())"
        )
    return APPLIED_TABLE


@pytest.fixture
def run_id(applied_table: str) -> str:
    """A fresh id that scopes this test's counters, effects and effect keys."""
    return uuid.uuid4().hex[:10]


# --- what the tests read back -----------------------------------------------------------------


def applied(run: str) -> Counter:
    """item -> how many times its effect was applied (1 is right, 2+ is a duplicate)."""
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT item, count(*) FROM {APPLIED_TABLE} WHERE run = %s GROUP BY item", [run]
        )
        return Counter(dict(cursor.fetchall()))


def running_ids(client: Any, ids: list[str]) -> set[str]:
    """Those of `ids` whose job runs: its row says running, or it waits while its run's Redis
    record (DEFER_CLAIM, jobs.broker.running: the status API reads it so) is live and says
    unclaimed. `client`: the Redis the workers record their runs in."""
    rows = list(Job.objects.filter(id__in=ids).only("id", "state"))
    found = {str(job.id) for job in rows if job.state == JobState.RUNNING}
    now_ms = time.time() * 1000
    for job in rows:
        if job.state not in WAITING_STATES:
            continue
        until, claimed = client.hmget(f"{RUN_PREFIX}{job.id}", "until", "claimed")
        if until is not None and claimed is None and float(until) > now_ms:
            found.add(str(job.id))
    return found


def runs(run: str) -> Counter:
    """item -> how many times the job body started."""
    from tests.system.faults.jobs import counter

    raw = counter().hgetall(f"faults:{run}:runs")
    return Counter({int(k): int(v) for k, v in raw.items()})


def states(ids: list[str]) -> Counter:
    found: Counter = Counter()
    for at in range(0, len(ids), 5000):
        for state, n in _state_counts(ids[at : at + 5000]):
            found[state] += n
    return found


def _state_counts(ids: list[str]) -> list[tuple[str, int]]:
    from django.db.models import Count

    return list(Job.objects.filter(id__in=ids).values_list("state").annotate(n=Count("id")))


def finished_count(ids: list[str]) -> int:
    counts = states(ids)
    return counts[JobState.SUCCEEDED] + counts[JobState.DEAD]


def wait_finished(ids: list[str], timeout: float, what: str = "jobs") -> float:
    """Poll until every job succeeded or is dead; returns the seconds waited."""
    began = time.monotonic()

    def done() -> bool:
        return finished_count(ids) == len(ids)

    try:
        wait_until(done, timeout=timeout, interval=0.5, what=f"{len(ids)} {what} to finish")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; states: {dict(states(ids))}") from None
    return time.monotonic() - began


def dead_letters(ids: list[str]) -> int:
    return DeadLetter.objects.filter(job_id_value__in=ids).count()
