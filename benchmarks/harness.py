"""What every case shares: real worker processes, queue inspection, statistics, results.

A case runs in its own Python process (benchmarks.run_case) with Django set up against the
database it measures; workers are `celery -A config worker` processes it starts and stops by
PID. Everything talks to the Redis and PostgreSQL that scripts/bench.sh started on loopback.
"""

from __future__ import annotations

import contextlib
import os
import signal
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

ROOT = Path(__file__).resolve().parent.parent
LOG_DIR = ROOT / ".data" / "bench-logs"
# One file per running worker or server PID, so a killed case's processes can be ended by PID.
PID_DIR = LOG_DIR / "pids"

# Queues and priority lists as kombu's Redis transport names them (sep ":", steps 0-9).
PRIORITY_STEPS = range(10)


def queue_keys(queue: str = "default") -> list[str]:
    return [queue if step == 0 else f"{queue}:{step}" for step in PRIORITY_STEPS]


def wait_until(
    predicate: Callable[[], Any], timeout: float, interval: float = 0.05, what: str = "condition"
) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


# --------------------------------------------------------------------------- workers


class Worker:
    """A real `celery -A config worker` process, stopped by its PID (and its own group).

    `app="benchmarks.plain_celery"`: a worker of the plain Celery app instead (no Django, no
    Backlot), without the project's environment."""

    def __init__(
        self,
        label: str,
        *,
        concurrency: int = 2,
        queues: str = "default",
        env: dict[str, str] | None = None,
        extra: Sequence[str] = (),
        argv: Sequence[str] | None = None,
        app: str = "config",
    ) -> None:
        self.app = app
        self.name = f"bench-{label}-{uuid.uuid4().hex[:6]}@localhost"
        LOG_DIR.mkdir(parents=True, exist_ok=True)
        self.log_path = LOG_DIR / f"{self.name.split('@')[0]}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 (the worker's lifetime; stop() closes it)
        if argv is None:
            argv = ["-Q", queues, "-c", str(concurrency), "-P", "prefork"]
        command = [
            sys.executable,
            "-m",
            "celery",
            "-A",
            app,
            "worker",
            *argv,
            "-n",
            self.name,
            *(["-I", "benchmarks.jobs"] if app == "config" else []),
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
            *extra,
        ]
        self.process = subprocess.Popen(
            command,
            cwd=ROOT,
            env=worker_env(env) if app == "config" else _plain_env(env),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        register(self.process.pid)

    def wait_ready(self, timeout: float = 90) -> Worker:
        app = control_app(self)

        def answers() -> bool:
            if self.process.poll() is not None:
                raise RuntimeError(f"worker {self.name} exited:\n{self.log_tail()}")
            return bool(app.control.ping(destination=[self.name], timeout=0.5))

        wait_until(answers, timeout, interval=0.2, what=f"worker {self.name}")
        return self

    def pool_pids(self) -> list[int]:
        out = subprocess.run(
            ["ps", "-o", "pid=", "--ppid", str(self.process.pid)],
            capture_output=True,
            text=True,
            check=False,
        ).stdout
        return [int(pid) for pid in out.split()]

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)
            _kill_group(self.process.pid)  # a pool process that outlived its parent
        else:
            # The parent is gone; its pool processes (same group) must not outlive it.
            _kill_group(self.process.pid)
        unregister(self.process.pid)
        self._log.close()


def register(pid: int) -> None:
    PID_DIR.mkdir(parents=True, exist_ok=True)
    (PID_DIR / str(pid)).touch()


def unregister(pid: int) -> None:
    (PID_DIR / str(pid)).unlink(missing_ok=True)


def _kill_group(pid: int) -> None:
    """SIGKILL what is left of the process group led by `pid` (started with its own session)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def kill_registered() -> None:
    """End the registered processes of a case that was killed (each is a group leader)."""
    for entry in PID_DIR.glob("*") if PID_DIR.exists() else []:
        pid = int(entry.name)
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            cmdline = b""
        if b"benchmarks" in cmdline or b"bench-" in cmdline:
            try:
                os.killpg(pid, signal.SIGTERM)
                time.sleep(2)
            except ProcessLookupError:
                pass
            _kill_group(pid)
        entry.unlink(missing_ok=True)


def worker_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "DJANGO_SETTINGS_MODULE": "config.settings",
        # A stopped benchmark worker is idle: no need for the 30 s soft-shutdown grace.
        "CELERY_WORKER_SOFT_SHUTDOWN_TIMEOUT": "0",
    }
    env.update(extra or {})
    return env


def _plain_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """A plain Celery worker's environment: no Django settings, no Celery settings of ours."""
    env = {
        key: value
        for key, value in os.environ.items()
        if key != "DJANGO_SETTINGS_MODULE" and not key.startswith(("CELERY_", "BACKLOT_"))
    }
    env.update(PYTHONUNBUFFERED="1", **(extra or {}))
    return env


class Workers:
    """Several workers started together and stopped together (in a `with` block)."""

    def __init__(self) -> None:
        self.started: list[Worker] = []

    def start(self, *args: Any, **kwargs: Any) -> Worker:
        worker = Worker(*args, **kwargs)
        self.started.append(worker)
        return worker

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        for worker in self.started:
            worker.stop()


def control_app(worker: Worker) -> Any:
    """The Celery app whose remote control reaches `worker`."""
    if worker.app == "config":
        from config.celery import app

        return app
    from benchmarks.plain_celery import app as plain

    return plain


def _by_app(workers: Iterable[Worker]) -> Iterator[tuple[Any, list[str]]]:
    """Each app's remote control with the names of its workers among `workers`."""
    groups: dict[str, list[Worker]] = {}
    for worker in workers:
        groups.setdefault(worker.app, []).append(worker)
    for group in groups.values():
        yield control_app(group[0]), [w.name for w in group]


def pause(workers: Iterable[Worker], queue: str = "default") -> None:
    """Stop the workers consuming `queue` (so a backlog can be queued before timing)."""
    for app, names in _by_app(workers):
        app.control.cancel_consumer(queue, destination=names, reply=True, timeout=5)


def resume(workers: Iterable[Worker], queue: str = "default") -> None:
    for app, names in _by_app(workers):
        app.control.add_consumer(queue, destination=names, reply=True, timeout=5)


# --------------------------------------------------------------------------- Redis


def redis_client() -> Any:
    from benchmarks.jobs import bench_redis

    return bench_redis()


def backlog(queue: str = "default") -> int:
    """Messages queued or delivered-but-unacknowledged (acks_late: until the job finished)."""
    pipe = redis_client().pipeline(transaction=False)
    for key in queue_keys(queue):
        pipe.llen(key)
    pipe.hlen("unacked")
    return sum(pipe.execute())


def queued(queue: str = "default") -> int:
    pipe = redis_client().pipeline(transaction=False)
    for key in queue_keys(queue):
        pipe.llen(key)
    return sum(pipe.execute())


def drain_seconds(started: float, timeout: float, queue: str = "default") -> float:
    """Wait until the queue and the unacked set are empty; seconds since `started`."""
    deadline = started + timeout
    while backlog(queue):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{backlog(queue)} messages still queued after {timeout:.0f}s")
        time.sleep(0.005)
    return time.monotonic() - started


def timed_drain(workers: Sequence[Worker], timeout: float, queue: str = "default") -> float:
    """Let `workers` consume `queue` and time the drain of its backlog, from the first message
    taken to the last acknowledged, then stop them consuming it again.

    The clock starts at the first message taken, not at the add_consumer command: a worker
    blocked in BRPOP on its other queues only picks the new one up when that call returns
    (up to a second later), which would otherwise penalise multi-queue workers.
    """
    waiting = queued(queue)
    resume(workers, queue)
    deadline = time.monotonic() + 30
    while queued(queue) >= waiting:
        if time.monotonic() > deadline:
            raise TimeoutError(f"no worker took a message from {queue} within 30 s")
        time.sleep(0.002)
    seconds = drain_seconds(time.monotonic(), timeout, queue)
    pause(workers, queue)
    return seconds


def empty_queues() -> None:
    """Drop queued messages and benchmark keys; kombu's exchange bindings stay."""
    client = redis_client()
    doomed = [k for k in client.scan_iter(count=1000) if not k.startswith(b"_kombu.binding.")]
    for start in range(0, len(doomed), 1000):
        client.delete(*doomed[start : start + 1000])


def wait_stamp(key: str, timeout: float) -> float | None:
    """Pop the next stamp a job wrote under `key`, waiting up to `timeout` seconds.

    BLPOP in one-second slices: one long BLPOP would outlast the client's socket timeout.
    """
    from benchmarks.jobs import STAMPS

    client = redis_client()
    deadline = time.monotonic() + timeout
    while True:
        popped = client.blpop([STAMPS + key], timeout=1)
        if popped is not None:
            return float(popped[1])
        if time.monotonic() > deadline:
            return None


def take_stamps(key: str) -> list[float]:
    from benchmarks.jobs import STAMPS

    client = redis_client()
    values = client.lrange(STAMPS + key, 0, -1)
    client.delete(STAMPS + key)
    return [float(v) for v in values]


# --------------------------------------------------------------------------- statistics


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank-interpolated percentile (q in 0..100)."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def summary(values: Sequence[float]) -> dict[str, Any]:
    values = [float(v) for v in values]
    med = statistics.median(values)
    return {
        "median": med,
        "min": min(values),
        "max": max(values),
        "n": len(values),
        "spread_pct": (max(values) - min(values)) / med * 100 if med else 0.0,
        "runs": [round(v, 6) for v in values],
    }


@dataclass
class CaseResult:
    """One case's figures: per variant the runs (median and spread), per ratio the per-round
    ratios (A and B measured in the same round), and the targets of the issue."""

    case: str
    title: str
    params: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    figures: dict[str, dict[str, Any]] = field(default_factory=dict)
    ratios: dict[str, dict[str, Any]] = field(default_factory=dict)
    targets: list[dict[str, Any]] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    def figure(
        self,
        variant: str,
        values: Sequence[float],
        unit: str,
        higher_is_better: bool = True,
        **more: Any,
    ) -> dict[str, Any]:
        self.figures[variant] = {
            "unit": unit,
            "higher_is_better": higher_is_better,
            **summary(values),
            **more,
        }
        return self.figures[variant]

    def ratio(self, name: str, numerators: Sequence[float], denominators: Sequence[float]) -> float:
        per_round = [a / b for a, b in zip(numerators, denominators, strict=True) if b]
        self.ratios[name] = summary(per_round)
        return self.ratios[name]["median"]

    def target(self, name: str, measured: float, goal: str, met: bool, detail: str = "") -> None:
        self.targets.append(
            {"target": name, "measured": measured, "goal": goal, "met": bool(met), "detail": detail}
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "case": self.case,
            "title": self.title,
            "params": self.params,
            "notes": self.notes,
            "figures": self.figures,
            "ratios": self.ratios,
            "targets": self.targets,
            "extra": self.extra,
        }


def clock() -> float:
    return time.monotonic()


# --------------------------------------------------------------------------- CPU

_TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pids: Iterable[int]) -> float:
    """User + system CPU seconds the processes used so far (gone processes count 0)."""
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / _TICK
    return total


def machine_busy() -> tuple[float, float]:
    """(busy, total) jiffies of the whole machine, from /proc/stat."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = values[3] + values[4]
    return sum(values) - idle, sum(values)


class CpuMeter:
    """CPU use of a worker (main process, pool processes) and of the machine over a span."""

    def __init__(self, workers: Sequence[Worker]) -> None:
        self.parents = [w.process.pid for w in workers]
        self.pools = [pid for w in workers for pid in w.pool_pids()]
        self.start = (cpu_seconds(self.parents), cpu_seconds(self.pools), machine_busy(), clock())

    def stop(self) -> dict[str, float]:
        parents, pools, (busy, total), started = self.start
        (busy2, total2), elapsed = machine_busy(), clock() - started
        cores = os.cpu_count() or 1
        return {
            "worker_main_cpu_pct": round((cpu_seconds(self.parents) - parents) / elapsed * 100, 1),
            "pool_cpu_pct": round((cpu_seconds(self.pools) - pools) / elapsed * 100, 1),
            "machine_cpu_pct": round((busy2 - busy) / max(1, total2 - total) * 100 * cores, 1),
        }
