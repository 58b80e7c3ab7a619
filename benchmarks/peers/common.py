"""What both sides of `make bench-peers` share: processes, polling, and the four cases.

Only the standard library and redis-py (both virtualenvs have them). A side is an Adapter:
how it enqueues one job and many, how many of its jobs are still queued or running, how its
workers start; `run_cases` measures the same way for every side:

- single enqueue: `single` jobs, one call each, from this process; no worker runs;
- bulk enqueue: `bulk` jobs through the side's own bulk call (its loop when it has none);
- drain: a backlog of `drain` no-op jobs queued with no worker consuming it, then the workers
  (two processes) consume it; the clock runs from the first job finished to the last
  (acknowledged, or its row marked done), jobs/s;
- latency: one job at a time on idle workers, enqueue -> the job's first line (it RPUSHes
  time.time() to a Redis list the caller BLPOPs), p50 of each third of the run.

Each case repeats `rounds` times (latency once), median and spread as in benchmarks/.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.harness import percentile, summary, wait_until

ROOT = Path(__file__).resolve().parent.parent.parent
LOG_DIR = ROOT / ".data" / "bench-peers-logs"
STAMPS = "peers:stamps:"
IDLE_GAP = 0.02  # seconds between latency jobs, as benchmarks/cases/latency.py


@dataclass(frozen=True)
class Sizes:
    single: int
    bulk: int
    drain: int
    latency: int
    rounds: int


SMALL = Sizes(single=300, bulk=3_000, drain=1_000, latency=150, rounds=3)
FULL = Sizes(single=5_000, bulk=100_000, drain=20_000, latency=500, rounds=3)


def sizes(full: bool, per_round: bool = False) -> Sizes:
    """The run's sizes (PEERS_SCALE multiplies the counts); `per_round`: one round's share, for
    a side called once per round by the runner (one round, latency jobs divided among them)."""
    base = FULL if full else SMALL
    scale = float(os.environ.get("PEERS_SCALE", "1"))

    def scaled(n: int) -> int:
        return max(1, round(n * scale))

    return Sizes(
        single=scaled(base.single),
        bulk=scaled(base.bulk),
        drain=scaled(base.drain),
        latency=max(3, scaled(base.latency) // (base.rounds if per_round else 1)),
        rounds=1 if per_round else base.rounds,
    )


class Proc:
    """A process of our own (its own session), stopped by its PID: SIGTERM, then SIGKILL of
    its process group."""

    def __init__(self, label: str, argv: Sequence[str], env: dict[str, str] | None = None):
        LOG_DIR.mkdir(parents=True, exist_ok=True)
        self.label = label
        self.log_path = LOG_DIR / f"{label}-{uuid.uuid4().hex[:6]}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 (closed by stop())
        self.process = subprocess.Popen(
            list(argv),
            cwd=ROOT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT), **(env or {})},
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    @property
    def pid(self) -> int:
        return self.process.pid

    def check(self) -> None:
        if self.process.poll() is not None:
            raise RuntimeError(f"{self.label} exited {self.process.returncode}:\n{self.tail()}")

    def tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def stop(self, grace: float = 20) -> None:
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=grace)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=10)
        self._log.close()


def stop_all(procs: Sequence[Proc]) -> None:
    for proc in procs:
        if proc.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
    for proc in procs:
        proc.stop()


_TICK = os.sysconf("SC_CLK_TCK")


def group_cpu(pgid: int) -> float:
    """CPU seconds used so far by the live processes of process group `pgid`."""
    total = 0.0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:
            total += (int(fields[11]) + int(fields[12])) / _TICK
    return total


def settle(procs: Sequence[Proc], timeout: float = 45) -> None:
    """Wait until the workers are idle: under 5 % of a core each over half a second."""
    deadline = time.monotonic() + timeout
    last = sum(group_cpu(p.pid) for p in procs)
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = sum(group_cpu(p.pid) for p in procs)
        if now - last < 0.025 * len(procs):
            return
        last = now


def signal_all(procs: Sequence[Proc], signum: int) -> None:
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signum)


def peer_python() -> str:
    return str(ROOT / ".data" / "venv-peers" / "bin" / "python")


class Adapter:
    """One side of the comparison; run_cases calls these."""

    name = ""
    what = ""
    workers_what = ""
    bulk_what = ""
    # Seconds between two backlog polls while draining (a database count costs the database).
    poll = 0.005
    # The Redis list a stamp job appends to is stamp_prefix + key.
    stamp_prefix = STAMPS
    # The drain's size is Sizes.drain times this (a peer far slower than the others).
    drain_factor = 1.0

    def reset(self) -> None:
        raise NotImplementedError

    def enqueue_one(self, i: int) -> None:
        raise NotImplementedError

    def enqueue_bulk(self, count: int) -> None:
        raise NotImplementedError

    def backlog(self) -> int:
        """Jobs queued or running (not yet finished)."""
        raise NotImplementedError

    def start_workers(self) -> list[Proc]:
        raise NotImplementedError

    def wait_ready(self, procs: list[Proc]) -> None:
        """Block until the workers consume (default: one stamp job runs)."""
        key = f"ready-{uuid.uuid4().hex[:6]}"
        self.enqueue_stamp(key)
        deadline = time.monotonic() + 120
        while wait_stamp(self.redis(), self.stamp_prefix + key, 1) is None:
            for proc in procs:
                proc.check()
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name}: workers did not run a job within 120 s")

    def enqueue_stamp(self, key: str) -> None:
        raise NotImplementedError

    def redis(self) -> Any:
        raise NotImplementedError

    def notes(self) -> list[str]:
        return []

    def on_drain_workers(self, procs: list[Proc]) -> None:
        """Called once the drain's workers are up, before the first job finishes."""

    def after_drain(self, procs: list[Proc]) -> None:
        """Called after each timed drain (e.g. to stop a profiler)."""


def wait_stamp(client: Any, key: str, timeout: float) -> float | None:
    """BLPOP the next stamp of list `key`, in one-second slices, up to `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        popped = client.blpop([key], timeout=1)
        if popped is not None:
            return float(popped[1])
        if time.monotonic() > deadline:
            return None


def log(message: str) -> None:
    print(f"[bench-peers] {message}", file=sys.stderr, flush=True)


def _timed(fn: Callable[[], None]) -> float:
    started = time.monotonic()
    fn()
    return time.monotonic() - started


def _each(fn: Callable[[int], None], count: int) -> None:
    for i in range(count):
        fn(i)


def _expect(adapter: Adapter, count: int, case: str) -> None:
    found = adapter.backlog()
    if found != count:
        raise AssertionError(f"{adapter.name} {case}: {found} jobs queued, expected {count}")


def run_cases(adapter: Adapter, size: Sizes, cases: Sequence[str]) -> dict[str, Any]:
    """The four cases on one side; a dict of figures (median, runs) per case."""
    out: dict[str, Any] = {
        "what": adapter.what,
        "workers": adapter.workers_what,
        "bulk": adapter.bulk_what,
        "sizes": size.__dict__,
        "figures": {},
        "notes": adapter.notes(),
    }
    figures = out["figures"]
    began = time.monotonic()

    if "enqueue" in cases:
        adapter.reset()
        for i in range(50):  # warm-up: connections, imports
            adapter.enqueue_one(i)
        rates = []
        for _ in range(size.rounds):
            adapter.reset()
            seconds = _timed(lambda: _each(adapter.enqueue_one, size.single))
            _expect(adapter, size.single, "single enqueue")
            rates.append(size.single / seconds)
        figures["enqueue"] = {"unit": "jobs/s", **summary(rates)}
        log(f"{adapter.name}: single enqueue {figures['enqueue']['median']:,.0f} jobs/s")

    if "bulk" in cases:
        adapter.reset()
        adapter.enqueue_bulk(100)
        rates = []
        for _ in range(size.rounds):
            adapter.reset()
            seconds = _timed(lambda: adapter.enqueue_bulk(size.bulk))
            _expect(adapter, size.bulk, "bulk enqueue")
            rates.append(size.bulk / seconds)
        figures["bulk"] = {"unit": "jobs/s", **summary(rates)}
        log(f"{adapter.name}: bulk enqueue {figures['bulk']['median']:,.0f} jobs/s")

    if "drain" in cases:
        rates = []
        count = max(1, round(size.drain * adapter.drain_factor))
        for _ in range(size.rounds):
            adapter.reset()
            procs = adapter.start_workers()
            try:
                # Booted and idle, then frozen while the backlog is queued: no worker's boot
                # competes with another's drain, and no job runs before the whole backlog is in.
                adapter.wait_ready(procs)
                settle(procs)
                signal_all(procs, signal.SIGSTOP)
                try:
                    adapter.enqueue_bulk(count)
                    # A worker blocked in BRPOP may have been handed one message as it froze.
                    queued = adapter.backlog()
                    if not count - 2 * len(procs) - 2 <= queued <= count:
                        raise AssertionError(f"{adapter.name}: {queued} of {count} queued")
                finally:
                    signal_all(procs, signal.SIGCONT)
                adapter.on_drain_workers(procs)

                def started(procs: list[Proc] = procs, queued: int = queued) -> bool:
                    for proc in procs:
                        proc.check()
                    return adapter.backlog() < queued

                wait_until(started, 60, interval=0.002, what=f"{adapter.name}'s first job")
                t0 = time.monotonic()
                deadline = t0 + 60 + count / 10
                while adapter.backlog():
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{adapter.name}: {adapter.backlog()} jobs left")
                    time.sleep(adapter.poll)
                seconds = time.monotonic() - t0
                adapter.after_drain(procs)
            finally:
                stop_all(procs)
            rates.append(queued / seconds)
        figures["drain"] = {"unit": "jobs/s", "jobs_per_drain": count, **summary(rates)}
        log(f"{adapter.name}: drain {figures['drain']['median']:,.0f} jobs/s")

    if "latency" in cases:
        adapter.reset()
        procs = adapter.start_workers()
        samples = []
        try:
            adapter.wait_ready(procs)
            settle(procs)
            key = f"lat-{uuid.uuid4().hex[:8]}"
            client = adapter.redis()
            for i in range(size.latency + 10):  # the first 10 warm up
                sent = time.time()
                adapter.enqueue_stamp(key)
                stamped = wait_stamp(client, adapter.stamp_prefix + key, 30)
                if stamped is None:
                    raise TimeoutError(f"{adapter.name}: latency job {i} did not start in 30 s")
                if i >= 10:
                    samples.append((stamped - sent) * 1000)
                time.sleep(IDLE_GAP)
        finally:
            stop_all(procs)
        thirds = [samples[len(samples) * k // 3 : len(samples) * (k + 1) // 3] for k in range(3)]
        figures["latency_p50"] = {
            "unit": "ms",
            "higher_is_better": False,
            **summary([percentile(block, 50) for block in thirds]),
            "p50_all": round(percentile(samples, 50), 3),
            "p99_all": round(percentile(samples, 99), 3),
        }
        log(f"{adapter.name}: latency p50 {figures['latency_p50']['p50_all']:.2f} ms")

    out["seconds"] = round(time.monotonic() - began, 1)
    return out
