"""Two beats running at once fire each scheduled tick once; a dead leader is replaced."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from django_celery_beat.models import IntervalSchedule, PeriodicTask

from tests.conftest import LOG_DIR, ROOT, marks, wait_until

LOCK_TTL = 4  # seconds; production default is 30


def start_beat(name: str, env: dict[str, str]) -> subprocess.Popen[bytes]:
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    # beat writes to its own copy of the descriptor; ours is closed once it started.
    with open(LOG_DIR / f"beat-{name}.log", "wb") as log:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                "config",
                "beat",
                "--pidfile=",
                "-l",
                "INFO",
                "--scheduler",
                "jobs.flow.beat:LeaderDatabaseScheduler",
            ],
            cwd=ROOT,
            env={**env, "BACKLOT_BEAT_LOCK_TTL": str(LOCK_TTL)},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def log_of(name: str) -> str:
    return (LOG_DIR / f"beat-{name}.log").read_text(errors="replace")


def test_two_beats_fire_each_tick_once_and_a_dead_leader_is_replaced(worker, worker_env, unique):
    every_second = IntervalSchedule.objects.create(every=1, period=IntervalSchedule.SECONDS)
    PeriodicTask.objects.create(
        name=f"tick {unique}",
        task="tests.record",
        interval=every_second,
        args=json.dumps([unique, "tick"]),
        queue="default",
    )
    first = start_beat(f"a-{unique}", worker_env)
    second = start_beat(f"b-{unique}", worker_env)
    try:
        wait_until(
            lambda: "is now the leader" in log_of(f"a-{unique}") + log_of(f"b-{unique}"),
            timeout=30,
            what="a beat to lead",
        )
        leader, follower = (
            (first, "b") if "is now the leader" in log_of(f"a-{unique}") else (second, "a")
        )
        wait_until(lambda: len(marks(unique)) >= 2, timeout=30, what="ticks to fire")
        start = marks(unique)[-1][0]
        wait_until(lambda: marks(unique)[-1][0] >= start + 8, timeout=30, what="8 s of ticks")

        ticks = [t for t, _ in marks(unique) if start < t <= start + 8]
        assert 6 <= len(ticks) <= 9, len(ticks)  # one per second, not two

        os.killpg(leader.pid, signal.SIGKILL)
        killed_at = time.time()
        wait_until(
            lambda: "is now the leader" in log_of(f"{follower}-{unique}"),
            timeout=LOCK_TTL + 10,
            what="the other beat to take over",
        )
        wait_until(
            lambda: marks(unique)[-1][0] > killed_at + 1,
            timeout=LOCK_TTL + 10,
            what="ticks to resume",
        )
        resumed = min(t for t, _ in marks(unique) if t > killed_at + 0.5)
        assert resumed - killed_at <= LOCK_TTL + 3
    finally:
        for process in (first, second):
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
                process.wait(timeout=20)
