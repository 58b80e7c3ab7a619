"""Where the time goes (python -m benchmarks --cases profile; not part of the default run).

Two profiles of the furthest-off targets, taken with py-spy (wall clock, idle included, so
time spent waiting for PostgreSQL or Redis shows as such):
  fan-out  this process running the campaign fan-out (job_enqueue_many, ledger on);
           cProfile when py-spy is not installed.
  drain    a worker (main process and its 2 pool processes) draining ledger jobs.
BENCH_PROFILE_LEDGER=off drains ledger-off jobs instead, BENCH_PROFILE_JOBS sets their number
(3,000), BENCH_PROFILE_IDLE=0 leaves out the samples of waiting threads (py-spy's --idle).
The summaries go to benchmarks/results/profile-*.txt, the collapsed stacks (for a flame
graph) to .data/bench-logs/.
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import signal
import subprocess
import time
from pathlib import Path

from django.db import connection

from benchmarks import jobs as bench
from benchmarks.cases.drain import queue_backlog
from benchmarks.cases.enqueue import fan_out
from benchmarks.harness import (
    LOG_DIR,
    CaseResult,
    Workers,
    clock,
    empty_queues,
    pause,
    queued,
    timed_drain,
)
from benchmarks.profiling import py_spy, record, render, summarize

RESULTS = Path(__file__).resolve().parent.parent / "results"
FANOUT_JOBS = 20_000
DRAIN_JOBS = int(os.environ.get("BENCH_PROFILE_JOBS", "3000"))


def _stop(spy: subprocess.Popen[bytes]) -> str:
    spy.send_signal(signal.SIGINT)  # py-spy writes what it has on Ctrl-C
    _, err = spy.communicate(timeout=60)
    return (err or b"").decode(errors="replace")[-500:]


def run(*, full: bool = False) -> CaseResult:
    result = CaseResult(
        case="profile",
        title="Profiles: campaign fan-out (in process) and a ledger drain (worker)",
        params={"fanout_jobs": FANOUT_JOBS, "drain_jobs": DRAIN_JOBS, "py_spy": py_spy()},
    )
    RESULTS.mkdir(exist_ok=True)
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    empty_queues()
    fan_out(bench.noop, 200)  # warm up
    empty_queues()

    # --- fan-out, this process
    raw = LOG_DIR / "profile-fanout.collapsed"
    started = clock()
    if py_spy():
        spy = record(os.getpid(), raw, seconds=600)
        time.sleep(1.0)  # py-spy attaches
        started = clock()
        fan_out(bench.noop, FANOUT_JOBS)
        seconds = clock() - started
        result.extra["py_spy_fanout_stderr"] = _stop(spy)
        text = render(
            summarize(raw, top=40, within="fan_out ("),
            f"campaign fan-out of {FANOUT_JOBS:,} ledger jobs "
            f"({FANOUT_JOBS / seconds:,.0f} jobs/s under py-spy)",
        )
    else:
        profiler = cProfile.Profile()
        profiler.enable()
        fan_out(bench.noop, FANOUT_JOBS)
        profiler.disable()
        seconds = clock() - started
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(40)
        text = f"cProfile (py-spy not installed), fan-out of {FANOUT_JOBS:,}:\n" + out.getvalue()
    result.figure("fan-out under profiler", [FANOUT_JOBS / seconds], "jobs/s")
    (RESULTS / "profile-fanout.txt").write_text(text + "\n")
    assert queued() == FANOUT_JOBS
    empty_queues()
    connection.close()

    # --- ledger drain, worker main + pool processes
    if py_spy():
        with Workers() as workers:
            worker = workers.start("profile", concurrency=2).wait_ready()
            pause([worker])
            off = os.environ.get("BENCH_PROFILE_LEDGER") == "off"
            task = bench.noop_untracked if off else bench.noop
            queue_backlog(task, 200)
            timed_drain([worker], 120)
            queue_backlog(task, DRAIN_JOBS)
            connection.close()
            raw = LOG_DIR / "profile-drain.collapsed"
            spy = record(worker.process.pid, raw, seconds=600, subprocesses=True)
            time.sleep(1.5)
            seconds = timed_drain([worker], 300)
            result.extra["py_spy_drain_stderr"] = _stop(spy)
            main_pid, pools = worker.process.pid, worker.pool_pids()
        result.figure("ledger drain under profiler", [DRAIN_JOBS / seconds], "jobs/s")
        whole = summarize(raw, top=40)
        parts = [render(whole, f"ledger drain of {DRAIN_JOBS:,} jobs, worker -c 2, all processes")]
        parts.append(
            render(
                summarize(raw, top=40, process_filter=f"pid {main_pid}"),
                f"worker main process (pid {main_pid})",
            )
        )
        for pid in pools:
            parts.append(
                render(
                    summarize(raw, top=40, process_filter=f"pid {pid}"), f"pool process (pid {pid})"
                )
            )
        (RESULTS / "profile-drain.txt").write_text("\n\n".join(parts) + "\n")
    else:
        result.notes.append(
            "py-spy not installed: no worker profile (pip install py-spy into .venv)"
        )
    empty_queues()
    return result
