"""Fault 10: PostgreSQL restarted while jobs run."""

from __future__ import annotations

import time
from collections import Counter

from tests.conftest import wait_until
from tests.system.faults.conftest import Client, figures, runs

JOBS = 300


def test_postgres_restart_under_running_jobs_every_job_completes_without_dead_letters(
    private_redis, private_postgres, fault_env, start_fault_worker, run_id
):
    """300 jobs (0.1 s each) on two workers of 2 processes; PostgreSQL (a private cluster: the
    ledger, the effects, the result backend) is restarted (`pg_ctl stop -m fast`, start) when
    about a third are done; the relay runs.

    Pass figures: 300/300 succeeded, 0 dead letters (the outage is transient), 300 effects,
    0 duplicates; within 150 s of the restart.
    """
    pg = private_postgres
    env = {**fault_env, "DATABASE_URL": pg.url}
    client = Client(env)
    try:
        began = time.monotonic()
        ids = client.enqueue("effect", run_id, JOBS, many=True, kwargs={"seconds": 0.1})
        client.start_relay()
        start_fault_worker("pg-a", concurrency=2, DATABASE_URL=pg.url)
        start_fault_worker("pg-b", concurrency=2, DATABASE_URL=pg.url)

        def ledger() -> Counter:
            return Counter(
                dict(
                    pg.query(
                        "SELECT state, count(*) FROM jobs_job"
                        " WHERE task_name = 'faults.effect' GROUP BY state"
                    )
                )
            )

        def finished() -> int:
            counts = ledger()
            return counts["succeeded"] + counts["dead"]

        # when
        wait_until(
            lambda: finished() >= JOBS // 3, timeout=60, interval=0.2, what="a third of the jobs"
        )
        running = ledger()["running"]
        outage = pg.restart()
        restarted = time.monotonic()

        # then
        wait_until(
            lambda: finished() >= JOBS,
            timeout=150,
            interval=0.5,
            what=f"{JOBS} jobs after the restart (ledger: {dict(ledger())})",
        )
        recovered = time.monotonic() - restarted
        counts = ledger()
        letters = pg.query(
            "SELECT exception_class, count(*) FROM jobs_deadletter GROUP BY exception_class"
        )
        effects = Counter(
            dict(
                pg.query(
                    "SELECT item, count(*) FROM faults_applied WHERE run = %s GROUP BY item", run_id
                )
            )
        )
        started = runs(run_id)
        duplicates = sum(n - 1 for n in effects.values() if n > 1)
        figures(
            f"PostgreSQL restart ({outage:.1f} s down, {running} jobs running): "
            f"{counts['succeeded']}/{JOBS} succeeded, {counts['dead']} dead ({dict(letters)}), "
            f"{len(effects)} effects, {duplicates} duplicates, {sum(started.values())} runs, "
            f"recovered {recovered:.1f} s after the restart, {time.monotonic() - began:.1f} s"
        )
        assert len(ids) == JOBS
        assert counts["succeeded"] == JOBS, f"{dict(counts)}; dead letters: {letters}"
        assert not letters, f"dead letters for a transient outage: {letters}"
        assert len(effects) == JOBS and duplicates == 0
    finally:
        client.close()


RESETS = 3


def test_postgres_connections_reset_under_running_jobs_no_dead_letters(
    private_redis, private_postgres, fault_env, start_fault_worker, run_id
):
    """300 jobs (0.2 s each) on two workers of 2 processes; every database connection is
    terminated (pg_terminate_backend: what a restart, a failover or a pooler restart does to
    clients, without the downtime) 3 times, 1 s apart, while they run; the relay runs.

    Pass figures: 300/300 succeeded, 0 dead letters (a dropped connection is transient),
    300 effects, 0 duplicates; within 150 s of the last reset.
    """
    pg = private_postgres
    env = {**fault_env, "DATABASE_URL": pg.url}
    client = Client(env)
    try:
        began = time.monotonic()
        ids = client.enqueue("effect", run_id, JOBS, many=True, kwargs={"seconds": 0.2})
        client.start_relay()
        start_fault_worker("pgreset-a", concurrency=2, DATABASE_URL=pg.url)
        start_fault_worker("pgreset-b", concurrency=2, DATABASE_URL=pg.url)

        def ledger() -> Counter:
            return Counter(
                dict(
                    pg.query(
                        "SELECT state, count(*) FROM jobs_job"
                        " WHERE task_name = 'faults.effect' GROUP BY state"
                    )
                )
            )

        def finished() -> int:
            counts = ledger()
            return counts["succeeded"] + counts["dead"]

        # when
        wait_until(
            lambda: finished() >= JOBS // 4, timeout=60, interval=0.2, what="a quarter of the jobs"
        )
        terminated: list[int] = []
        last = 0.0
        for _ in range(RESETS):
            if terminated:
                due = last + 1.0

                def passed(due: float = due) -> bool:
                    return time.monotonic() >= due

                wait_until(
                    passed,
                    timeout=5,
                    interval=0.05,
                    what="1 s apart",
                )
            terminated.append(
                len(
                    pg.query(
                        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                        " WHERE datname = 'backlot'"
                        " AND pid <> pg_backend_pid() AND backend_type = 'client backend'"
                    )
                )
            )
            last = time.monotonic()

        # then
        wait_until(
            lambda: finished() >= JOBS,
            timeout=150,
            interval=0.5,
            what=f"{JOBS} jobs after the resets (ledger: {dict(ledger())})",
        )
        recovered = time.monotonic() - last
        counts = ledger()
        letters = pg.query(
            "SELECT exception_class, left(exception_message, 60), count(*) FROM jobs_deadletter"
            " GROUP BY 1, 2"
        )
        effects = Counter(
            dict(
                pg.query(
                    "SELECT item, count(*) FROM faults_applied WHERE run = %s GROUP BY item", run_id
                )
            )
        )
        started = runs(run_id)
        duplicates = sum(n - 1 for n in effects.values() if n > 1)
        figures(
            f"PostgreSQL connections reset {RESETS}x ({terminated} connections): "
            f"{counts['succeeded']}/{JOBS} succeeded, {counts['dead']} dead {letters}, "
            f"{len(effects)} effects, {duplicates} duplicates, {sum(started.values())} runs, "
            f"done {recovered:.1f} s after the last reset, {time.monotonic() - began:.1f} s"
        )
        assert len(ids) == JOBS and all(terminated)
        assert not letters, f"dead letters for a dropped database connection: {letters}"
        assert counts["succeeded"] == JOBS, dict(counts)
        assert len(effects) == JOBS and duplicates == 0
    finally:
        client.close()
