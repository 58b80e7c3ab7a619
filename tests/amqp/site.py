"""The RabbitMQ suite's sites (tests/amqp/conftest.py's fixtures build on them): a vhost of the
suite's RabbitMQ (tests/amqp/rabbitmq.py) with a PostgreSQL database and a Redis of its own, the
processes started on them (workers, the relay, drivers) and the tests' ways in."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg
from celery import Celery
from kombu import Connection

from jobs.testing import Worker as PlatformWorker
from tests.amqp.jobs import EFFECTS_TABLE
from tests.amqp.rabbitmq import RabbitMQ
from tests.conftest import LOG_DIR, ROOT
from tests.support.driver_process import Driver
from tests.system.faults.conftest import PrivateRedis

# Worker processes: 2 workers x 2 pool processes, each taking 4 messages per pool process ahead
# (the Procfile's --prefetch-multiplier 4): a killed worker holds messages it never started.
WORKERS = 2
CONCURRENCY = 2
PREFETCH = 4
QUEUES = "default,emails,reports,media"
# RabbitMQ gives up on a message returned more than this many times (x-delivery-limit), here
# below BACKLOT['MAX_WORKER_CRASHES'] (3): a job that kills its pool process is given up by the
# broker first, so the relay's drain of the undeliverable queue is what dead-letters it.
DELIVERY_LIMIT = 1


class SuiteDatabase:
    """A PostgreSQL database of the suite's own on the test server, made by `manage.py
    migrate` and dropped at the end."""

    def __init__(self, label: str) -> None:
        base = os.environ.get("DATABASE_URL", "")
        parts = urlsplit(base)
        assert parts.scheme.startswith("postgres"), f"the RabbitMQ suite needs PostgreSQL: {base}"
        self.name = f"backlot_amqp_{label}_{uuid.uuid4().hex[:8]}"
        self.url = urlunsplit(parts._replace(path=f"/{self.name}"))
        self.admin = urlunsplit(parts._replace(scheme="postgresql", path="/postgres"))
        with psycopg.connect(self.admin, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{self.name}"')

    def migrate(self, env: dict[str, str]) -> None:
        done = subprocess.run(
            [sys.executable, "manage.py", "migrate", "--noinput", "-v", "0"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        with psycopg.connect(urlunsplit(urlsplit(self.admin)._replace(path=f"/{self.name}"))) as c:
            c.execute(f"CREATE TABLE {EFFECTS_TABLE} (key text, label text, job_id uuid)")

    def drop(self) -> None:
        with psycopg.connect(self.admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{self.name}" WITH (FORCE)')


class AMQPWorker(PlatformWorker):
    """A real worker of this project on the suite's RabbitMQ vhost, database and Redis;
    readiness is asked over that vhost (the pytest process's Celery app talks to Redis)."""

    def __init__(
        self,
        name: str,
        env: dict[str, str],
        control: Any,
        *,
        queues: str = QUEUES,
        concurrency: int = CONCURRENCY,
        prefetch: int = PREFETCH,
    ) -> None:
        self.control = control
        super().__init__(
            "config",
            queues=queues,
            concurrency=concurrency,
            name=name,
            env=env,
            cwd=ROOT,
            log_dir=LOG_DIR,
            extra_args=[
                "-I",
                "tests.support.tasks,tests.amqp.jobs",
                "--prefetch-multiplier",
                str(prefetch),
                "--without-gossip",
                "--without-mingle",
                "--without-heartbeat",
                "-l",
                "INFO",
            ],
            ready_timeout=90,
        )

    def ready(self) -> bool:
        if self.process.poll() is not None:
            raise AssertionError(f"worker {self.name} exited:\n{self.output()[-3000:]}")
        return bool(self.control.ping(destination=[self.name], timeout=0.5))

    def broker_ports(self, amqp_port: int) -> set[int]:
        """The client ports of this worker's main process's TCP connections to RabbitMQ: its
        sockets (/proc/PID/fd) found in the IPv4 TCP table (/proc/PID/net/tcp)."""
        proc = Path(f"/proc/{self.process.pid}")
        sockets = set()
        for fd in proc.joinpath("fd").iterdir():
            with contextlib.suppress(OSError):  # closed meanwhile
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    sockets.add(target[len("socket:[") : -1])
        ports = set()
        for line in proc.joinpath("net", "tcp").read_text().splitlines()[1:]:
            fields = line.split()  # sl, local, remote, state, ..., inode (the tenth)
            local, remote, inode = fields[1], fields[2], fields[9]
            if inode in sockets and int(remote.rsplit(":", 1)[1], 16) == amqp_port:
                ports.add(int(local.rsplit(":", 1)[1], 16))
        return ports

    def kill(self) -> list[int]:
        """kill -9 of the worker's main process and its pool processes, by their PIDs (a lost
        host, an OOM kill of the group); returns the pool's PIDs."""
        pool = self.pool_pids()
        for pid in [self.process.pid, *pool]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.process.wait(timeout=10)
        return pool


class Process:
    """A process of the site (the relay) with its log, stopped by its PID."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        LOG_DIR.mkdir(parents=True, exist_ok=True)
        self.log_path = LOG_DIR / f"amqp-{name}-{uuid.uuid4().hex[:6]}.log"
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
            )

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)


class Site:
    """A RabbitMQ vhost with a database and a Redis of its own, the processes started on them,
    and the tests' ways in: the driver, the Redis marks, rabbitmqctl."""

    def __init__(
        self, rabbitmq: RabbitMQ, tmp: Path, label: str, extra_env: dict[str, str]
    ) -> None:
        self.rabbitmq = rabbitmq
        self.vhost = f"backlot-test-{label}-{os.environ.get('PYTEST_XDIST_WORKER', 'main')}-"
        self.vhost += uuid.uuid4().hex[:6]
        self.url = rabbitmq.add_vhost(self.vhost)
        self.amqp_port = urlsplit(self.url).port or 5672
        self.database = SuiteDatabase(label)
        self.broker = PrivateRedis(tmp / f"{label}-redis")
        self.broker.start()
        self.redis = self.broker.client
        self.env = {
            **{k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"},
            "DJANGO_SETTINGS_MODULE": "config.settings",
            "BROKER_URL": self.url,
            "DATABASE_URL": self.database.url,
            "REDIS_URL": self.broker.url,
            "BACKLOT_AMQP_DELIVERY_LIMIT": str(DELIVERY_LIMIT),
            "BACKLOT_PROGRESS_INTERVAL": "0.1",
            "PYTHONUNBUFFERED": "1",
            # A stopped worker would wait 30 s for what it holds (soft shutdown, even when
            # idle): no test here stops a worker with work in hand.
            "CELERY_WORKER_SOFT_SHUTDOWN_TIMEOUT": "1",
            **extra_env,
        }
        # Pings go over the vhost: a bare app of the same broker URL.
        self.control = Celery(f"amqp-suite-{label}", broker=self.url, set_as_current=False).control
        self.workers: list[AMQPWorker] = []
        self.processes: list[Process] = []
        self._driver: Driver | None = None

    def migrate(self) -> None:
        began = time.monotonic()
        self.database.migrate(self.env)
        print(f"\namqp: {self.database.name} migrated in {time.monotonic() - began:.1f} s")

    def start_driver(self, env: dict[str, str] | None = None) -> Driver:
        """A driver on the site (the first one is `site.driver`), with `env` changed."""
        driver = Driver("tests.amqp.driver", {**self.env, **(env or {})}, "amqp")
        if self._driver is None:
            self._driver = driver
        return driver

    @property
    def driver(self) -> Driver:
        assert self._driver is not None, "no driver started on the site"
        return self._driver

    def start_relay(self) -> Process:
        argv = [sys.executable, "-m", "tests.amqp.driver", "relay", "--interval", "0.5"]
        self.processes.append(Process("relay", argv, self.env))
        return self.processes[-1]

    def start_worker(self, name: str, **options: Any) -> AMQPWorker:
        """One more worker on the site (stopped at the end, or by the caller)."""
        worker = AMQPWorker(name, self.env, self.control, **options)
        self.workers.append(worker)
        return worker

    def start_workers(self, count: int) -> list[AMQPWorker]:
        """`count` workers side by side (each waits for its own readiness)."""
        with ThreadPoolExecutor(count) as pool:
            return list(pool.map(self.start_worker, [f"amqp{n}" for n in range(count)]))

    def marks(self, key: str) -> list[str]:
        """The values the test jobs appended with tests.support.tasks.mark, in order."""
        out = []
        for raw in self.redis.lrange(f"test:{key}", 0, -1):
            text = raw.decode() if isinstance(raw, bytes) else str(raw)
            out.append(text.partition("|")[2])
        return out

    def set_flag(self, key: str) -> None:
        self.redis.set(f"test:flag:{key}", 1, ex=120)

    def queues(self) -> dict[str, dict[str, Any]]:
        return self.rabbitmq.queues(self.vhost)

    def depth(self, queue: str) -> tuple[int, int]:
        """(messages ready, consumers) of a queue, as RabbitMQ answers a passive declare: at
        once (rabbitmqctl list_queues shows a quorum queue's counts from stats emitted every
        5 s)."""
        connection: Any  # kombu's channel types name no queue_declare (py-amqp's has it)
        with Connection(self.url, connect_timeout=5) as connection:
            _, messages, consumers = connection.default_channel.queue_declare(
                queue=queue, passive=True
            )
        return int(messages), int(consumers)

    def close(self) -> None:
        stopping = [threading.Thread(target=w.stop) for w in self.workers]
        for thread in stopping:  # side by side: each stop waits for its worker's shutdown
            thread.start()
        for thread in stopping:
            thread.join()
        for process in self.processes:
            process.stop()
        if self._driver is not None:
            self._driver.stop()
        self.broker.stop()
        self.database.drop()
        self.rabbitmq.ctl("delete_vhost", self.vhost)
