"""Lost workers: the platform's processes as the Procfile starts them, a job that takes its
whole worker down, and the client commands of tests/system/faults/test_lost_worker.py.

Workers import this module (-I) for `faults.kill_worker`; the relay process runs here
(`python -m tests.system.faults.lost relay`) so that it knows the test jobs as a project's relay
knows the project's: it is `manage.py jobs relay`, the command itself.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import django
from django.apps import apps

if not apps.ready:  # run as a command; workers and pytest have set Django up already
    django.setup()

import redis
from celery import Celery
from django.core.management import call_command
from django.db import transaction

from config.celery import app as celery_app
from jobs import enqueue_many
from jobs.worker.decorators import job
from jobs.worker.task import PlatformTask
from tests.system.faults import jobs as fault_jobs

ROOT = Path(__file__).resolve().parents[3]
# tests.conftest.LOG_DIR (not imported: this module runs in worker processes)
LOG_DIR = ROOT / ".data" / "test-logs" / os.environ.get("PYTEST_XDIST_WORKER", "main")
# What `make run` (scripts/run.sh) sets before it starts the Procfile: laptop sizes.
MAKE_RUN_ENV = {"WORKER_EMAILS_CONCURRENCY": "2", "WORKER_DEFAULT_CONCURRENCY": "1"}
MODULES = "tests.support.tasks,tests.system.faults.jobs,tests.system.faults.lost"


@job(name="faults.kill_worker", bind=True, queue="emails", time_limit=60)
def kill_worker(self: Any, run: str, item: int) -> None:
    """Takes its whole worker down: kills the worker's main process, then its own pool
    process (what a segfault in a C extension or an OOM kill of the group does)."""
    fault_jobs.count_run(run, item)
    os.kill(os.getppid(), signal.SIGKILL)
    os._exit(1)


TASKS: dict[str, PlatformTask[Any, Any]] = {"effect": fault_jobs.effect, "kill_worker": kill_worker}


def procfile_command(entry: str, env: dict[str, str]) -> list[str]:
    """The command of Procfile entry `entry`, its ${VAR:-default} expanded from `env`, with
    this interpreter for `celery` and `python`."""
    for line in (ROOT / "Procfile").read_text().splitlines():
        name, _, command = line.partition(":")
        if name.strip() == entry and not line.startswith("#"):
            break
    else:
        raise LookupError(f"no {entry!r} entry in the Procfile")

    def expand(match: re.Match[str]) -> str:
        value = env.get(match["name"])
        return value if value else (match["default"] or "")

    argv = shlex.split(re.sub(r"\$\{(?P<name>\w+)(?::[-?](?P<default>[^}]*))?\}", expand, command))
    if argv[0] == "celery":
        return [sys.executable, "-m", "celery", *argv[1:]]
    if argv[0] == "python":
        return [sys.executable, *argv[1:]]
    return argv


class Process:
    """A platform process of the test (relay, beat), in a session of its own."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        LOG_DIR.mkdir(parents=True, exist_ok=True)
        self.log_path = LOG_DIR / f"lost-{name}-{uuid.uuid4().hex[:6]}.log"
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip

    def kill(self) -> None:
        """kill -9 of the process and whatever it started."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=10)

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.kill()


class ProcfileWorker(Process):
    """The Procfile's `worker-emails` (make run's sizes: -c 2, prefetch 4) on the test's
    Redis, with a node name of its own and the test jobs imported."""

    def __init__(self, name: str, env: dict[str, str], wait: bool = True) -> None:
        self.name = f"{name}-{uuid.uuid4().hex[:6]}@localhost"
        argv = procfile_command("worker-emails", {**MAKE_RUN_ENV, **env})
        at = argv.index("-n")
        argv[at + 1] = self.name
        argv += ["-I", MODULES, "--without-gossip", "--without-mingle", "--without-heartbeat"]
        self.argv = argv
        super().__init__(name, argv, env)
        self.probe = Celery("lost-probe", broker=env["REDIS_URL"], set_as_current=False)
        self.probe.conf.broker_transport_options = dict(celery_app.conf.broker_transport_options)
        if wait:
            from jobs.testing import wait_until

            try:
                wait_until(self.ready, timeout=90, interval=0.25, what=f"worker {self.name}")
            except BaseException:
                self.kill()  # the caller never holds it: it would outlive the test
                raise

    def ready(self) -> bool:
        if self.process.poll() is not None:
            raise AssertionError(f"worker {self.name} exited:\n{self.log_path.read_text()[-3000:]}")
        try:
            return bool(self.probe.control.ping(destination=[self.name], timeout=0.5))
        except redis.ConnectionError:
            # the probe's pooled connection closed under it (a fresh-clone run saw "Connection
            # closed by server" here once, the worker itself fine): not an answer, ask again
            return False

    def kill(self) -> None:
        super().kill()
        self.probe.close()

    def stop(self) -> None:
        super().stop()
        self.probe.close()


def enqueue(spec: dict[str, Any]) -> dict[str, Any]:
    task = TASKS[spec["task"]]
    items = range(spec.get("start", 0), spec.get("start", 0) + spec["count"])
    with transaction.atomic():
        ids = enqueue_many(
            task=task,
            calls=[((), {"run": spec["run"], "item": i, **spec.get("kwargs", {})}) for i in items],
            queue=spec.get("queue", "emails"),
        )
    return {"ids": ids}


def relay(spec: dict[str, Any]) -> None:
    """`manage.py jobs relay`, in a process that knows the test jobs."""
    call_command("jobs", "relay", "--interval", str(spec.get("interval", 1.0)))


if __name__ == "__main__":
    command, spec = sys.argv[1], json.loads(sys.argv[2])
    result = {"enqueue": enqueue, "relay": relay}[command](spec)
    if result is not None:
        print(json.dumps(result), flush=True)
