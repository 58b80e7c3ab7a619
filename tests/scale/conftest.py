"""The scale test's cluster: Redis and PostgreSQL in one network namespace, a Celery worker in
each of two others (see cluster.py), 5,000 jobs run through them.

Collected only when asked for: `make test-scale` (BACKLOT_SCALE_TEST=1), or a path inside
tests/scale on the command line. A plain `pytest` / `make test` leaves it out; it needs root.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import LOG_DIR, ROOT
from tests.scale.cluster import (
    CeleryWorker,
    ClusterError,
    Network,
    Postgres,
    Redis,
    netns,
    remove_stale_namespaces,
    require_privileges,
)

HERE = Path(__file__).resolve().parent
# The size: 4,400 plain jobs and 600 behind the 40/s limit (15 s of its window).
WORK_JOBS = 4400
LIMITED_JOBS = 600
# Pool processes per worker host: the I/O-bound rule of thumb (2 x cores) for a 2-core host.
CONCURRENCY = 4
# Bound on the wait for the 5,000 jobs; measured drains took 23-41 s (see docs/scaling.md).
DRAIN_TIMEOUT = 240

FIGURES: list[str] = []


def scale_requested(config: pytest.Config) -> bool:
    if os.environ.get("BACKLOT_SCALE_TEST") == "1":
        return True
    base = Path(config.invocation_params.dir)
    for arg in config.args:
        path = (base / arg.split("::")[0]).resolve()
        if path == HERE or HERE in path.parents:
            return True
    return False


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    if collection_path.name.startswith("test_") and not scale_requested(config):
        return True
    return None


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if FIGURES:
        terminalreporter.section("scale figures")
        for line in FIGURES:
            terminalreporter.write_line(f"scale: {line}")


def figures(line: str) -> None:
    print(f"\nscale: {line}", flush=True)
    FIGURES.append(line)


@dataclass
class ScaleRun:
    """What one run of the cluster produced; the cluster itself is gone by then."""

    run: str
    hosts: dict[str, str]  # h1/h2 -> the worker's nodename
    enqueued: dict[str, Any]
    drain: dict[str, Any]
    report: dict[str, Any]
    timings: dict[str, float] = field(default_factory=dict)


class Driver:
    """tests/scale/driver.py commands (or another module's), run inside the services namespace."""

    def __init__(
        self, namespace: str, env: dict[str, str], module: str = "tests.scale.driver"
    ) -> None:
        self.namespace = namespace
        self.env = env
        self.module = module

    def __call__(self, command: str, timeout: float = 120, **spec: Any) -> dict[str, Any]:
        done = subprocess.run(
            netns(
                self.namespace,
                sys.executable,
                "-m",
                self.module,
                command,
                json.dumps(spec),
            ),
            cwd=ROOT,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if done.returncode != 0:
            raise AssertionError(
                f"driver {command} failed ({done.returncode}):\n{done.stderr[-3000:]}"
            )
        result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
        return result


@pytest.fixture(scope="module")
def scale_run() -> Iterator[ScaleRun]:
    """Build the cluster, run the jobs, read the results back, and tear everything down
    (workers, PostgreSQL, Redis by PID, then the namespaces) before any assertion runs."""
    try:
        require_privileges()
    except ClusterError as exc:
        pytest.fail(str(exc), pytrace=False)
    remove_stale_namespaces()
    tag = str(os.getpid())
    began = time.monotonic()
    network = Network(tag)
    # Not under pytest's tmp_path (mode 700): the postgres user must reach its directory.
    workdir = Path(tempfile.mkdtemp(prefix=f"backlot-scale-{tag}-", dir="/tmp"))
    workdir.chmod(0o755)
    redis = Redis(network.services, workdir / "redis", tag)
    postgres = Postgres(network.services, workdir / "pg", tag)
    workers: list[CeleryWorker] = []
    timings: dict[str, float] = {}
    try:
        network.create()
        redis.start()
        postgres.start()
        timings["services"] = time.monotonic() - began
        env = {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "config.settings",
            "DATABASE_URL": postgres.url,
            "REDIS_URL": redis.url,
            "PYTHONUNBUFFERED": "1",
            # Stopping idle workers at the end need not take the platform's 30 s.
            "CELERY_WORKER_SOFT_SHUTDOWN_TIMEOUT": "2",
        }
        driver = Driver(network.services, env)
        timings["migrate"] = driver("setup", timeout=300)["seconds"]
        for namespace in network.hosts.values():
            worker = CeleryWorker(namespace, env, CONCURRENCY)
            workers.append(worker)
            worker.start()
        driver("ping", timeout=90, names=[worker.nodename for worker in workers], within=60)
        timings["ready"] = time.monotonic() - began

        run = uuid.uuid4().hex[:10]
        jobs_began = time.monotonic()
        enqueued = driver("enqueue", timeout=300, run=run, work=WORK_JOBS, limited=LIMITED_JOBS)
        for worker in workers:
            worker.alive()
        drain = driver(
            "wait", timeout=DRAIN_TIMEOUT + 30, total=WORK_JOBS + LIMITED_JOBS, within=DRAIN_TIMEOUT
        )
        timings["jobs"] = time.monotonic() - jobs_began
        report = driver(
            "report", timeout=120, run=run, expected={"work": WORK_JOBS, "limited": LIMITED_JOBS}
        )
        # Kept for a look after the run (the per-job start times of the limited jobs are in it).
        (LOG_DIR / f"scale-report-{tag}.json").write_text(json.dumps(report))
        result = ScaleRun(
            run=run,
            hosts={host: f"scale@{namespace}" for host, namespace in network.hosts.items()},
            enqueued=enqueued,
            drain=drain,
            report=report,
            timings=timings,
        )
    except BaseException:
        for worker in workers:
            print(f"--- {worker.name} (last lines) ---\n{worker.tail()}", file=sys.stderr)
        raise
    finally:
        for worker in workers:
            worker.signal_stop()  # both at once: each may spend its soft-shutdown timeout
        for service in [*workers, postgres, redis]:
            try:
                service.stop()
            except Exception as exc:  # noqa: BLE001 (stop the rest, delete the namespaces)
                print(f"stopping {service.name}: {exc}", file=sys.stderr)
        leftovers = network.delete()
        shutil.rmtree(workdir, ignore_errors=True)
        timings["total"] = time.monotonic() - began
    assert not leftovers, leftovers
    yield result
