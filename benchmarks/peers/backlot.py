"""Backlot's side of `make bench-peers`, in .venv under Django:
python -m benchmarks.peers.backlot OUT.json [--full] [--profile PATH].

The same four cases as the peers (benchmarks.peers.common.run_cases) for Backlot ledger-off
(@job track=False) and ledger-on (@job, the ledger on PostgreSQL), each on the shipped layout:
the Procfile's worker lines that consume the default queue (benchmarks.cases.drain's
shipped_worker_lines: one `celery -A config worker -c 1` per core here). Bulk enqueue is the
campaign fan-out: job_enqueue_many per 1,000 in a transaction (benchmarks.cases.enqueue).

--profile: a py-spy record (its --subprocesses) of the shipped workers over a ledger-off
drain, summarised by benchmarks.profiling into PATH.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import traceback
import uuid
from pathlib import Path
from typing import Any

from benchmarks.peers.common import Adapter, Proc, log, run_cases, sizes, stop_all


class Backlot(Adapter):
    def __init__(self, track: bool) -> None:
        from benchmarks import jobs as bench
        from benchmarks.cases.drain import shipped_worker_lines

        self.track = track
        self.name = "backlot_ledger_on" if track else "backlot_ledger_off"
        self.task = bench.noop if track else bench.noop_untracked
        self.stamp_task = bench.tracked_stamp if track else bench.untracked_stamp
        self.stamp_prefix = bench.STAMPS
        self.lines = shipped_worker_lines()
        self.what = (
            "Backlot @job, ledger on (PostgreSQL row per job, enqueue())"
            if track
            else "Backlot @job(track=False), ledger off (enqueue())"
        )
        self.workers_what = "the shipped layout: " + " | ".join(
            "celery -A config worker " + " ".join(line) for line in self.lines
        )
        self.bulk_what = "job_enqueue_many per 1,000 in a transaction (the campaign fan-out)"

    def redis(self) -> Any:
        from benchmarks.harness import redis_client

        return redis_client()

    def reset(self) -> None:
        from django.db import connection

        from benchmarks.harness import empty_queues

        empty_queues()
        connection.close()

    def enqueue_one(self, i: int) -> None:
        self.task.enqueue(i)

    def enqueue_bulk(self, count: int) -> None:
        from django.db import connection

        from benchmarks.cases.enqueue import fan_out

        fan_out(self.task, count)
        connection.close()

    def enqueue_stamp(self, key: str) -> None:
        self.stamp_task.enqueue(key)

    def backlog(self) -> int:
        from benchmarks.harness import backlog

        return int(backlog())

    def start_workers(self) -> list[Proc]:
        from benchmarks.harness import worker_env

        procs = []
        for n, line in enumerate(self.lines):
            name = f"peers-{self.name}-{n}-{uuid.uuid4().hex[:4]}@localhost"
            argv = [sys.executable, "-m", "celery", "-A", "config", "worker", *line, "-n", name]
            argv += ["-I", "benchmarks.jobs", "--without-gossip", "--without-mingle"]
            argv += ["--without-heartbeat"]
            procs.append(Proc(f"{self.name}{n}", argv, worker_env()))
        return procs


def profile(path: Path, count: int) -> dict[str, Any]:
    """py-spy over the shipped workers draining `count` ledger-off no-ops."""
    from benchmarks.profiling import py_spy, record, render, summarize

    if not py_spy():
        return {"error": "py-spy not found (scripts/bench-peers.sh installs it in the peers venv)"}
    adapter = Backlot(track=False)
    adapter.reset()
    procs = adapter.start_workers()
    raw_dir = Path(path).parent
    try:
        adapter.wait_ready(procs)
        # The recorders start first, then the backlog: the whole drain is sampled.
        spies, raws = [], []
        for proc in procs:
            raw = raw_dir / f".peers-profile-{proc.pid}.collapsed"
            raws.append(raw)
            spies.append(record(proc.pid, raw, seconds=600, subprocesses=True, idle=False))
        time.sleep(1.5)
        started = time.monotonic()
        adapter.enqueue_bulk(count)
        while adapter.backlog():
            if time.monotonic() - started > 300:
                raise TimeoutError("profiled drain did not finish in 300 s")
            time.sleep(0.01)
        seconds = time.monotonic() - started
        for spy in spies:
            spy.send_signal(signal.SIGINT)
            spy.communicate(timeout=60)
        main_pids = [p.pid for p in procs]
    finally:
        stop_all(procs)
    merged = raw_dir / ".peers-profile.collapsed"
    merged.write_text("".join(r.read_text(errors="replace") for r in raws if r.exists()))
    parts = [
        f"py-spy (--subprocesses, --rate 250, idle samples excluded) of the shipped layout "
        f"draining {count:,} Backlot ledger-off no-ops ({count / seconds:,.0f} jobs/s under "
        f"the profiler), {len(procs)} workers",
        render(summarize(merged, top=25), "all worker processes"),
        render(
            summarize(merged, top=25, process_filter=f"pid {main_pids[0]}"),
            f"one worker's main process (pid {main_pids[0]})",
        ),
    ]
    Path(path).write_text("\n\n".join(parts) + "\n")
    for raw in [*raws, merged]:
        raw.unlink(missing_ok=True)
    rate = round(count / seconds, 1)
    return {"jobs": count, "jobs_per_s_under_profiler": rate, "file": str(path)}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--full", action="store_true")
    parser.add_argument("--cases", default="enqueue,bulk,drain,latency")
    parser.add_argument("--per-round", action="store_true", help="one round of the run")
    parser.add_argument("--profile", default="")
    opts = parser.parse_args()
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    import django

    django.setup()
    import benchmarks.jobs  # noqa: F401  (registers the bench.* tasks in this process)

    out: dict[str, Any] = {}
    size = sizes(opts.full, opts.per_round)
    parser_round = int(os.environ.get("PEERS_ROUND", "0"))
    for track in (False, True) if parser_round % 2 == 0 else (True, False):
        adapter = Backlot(track)
        try:
            out[adapter.name] = run_cases(adapter, size, opts.cases.split(","))
        except Exception:  # noqa: BLE001 (recorded; the run goes on)
            traceback.print_exc()
            out[adapter.name] = {"error": traceback.format_exc(limit=8)}
            log(f"{adapter.name} FAILED")
    if opts.profile:
        try:
            out["profile"] = profile(Path(opts.profile), size.drain)
        except Exception:  # noqa: BLE001
            traceback.print_exc()
            out["profile"] = {"error": traceback.format_exc(limit=8)}
    Path(opts.out).write_text(json.dumps(out, indent=1))
    return 1 if any("error" in v for v in out.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
