"""Case 1, drain throughput, and the worker-layout comparison.

A backlog of no-op jobs is queued while the worker does not consume the queue (its consumer
is cancelled), then the consumer is added back and the clock runs until the queue and the
unacknowledged set are empty (acks_late: a message leaves `unacked` once its job finished).
Variants alternate within each round and the order flips every round.
"""

from __future__ import annotations

import os
import re
import shlex
import time
from typing import Any

import yaml
from django.conf import settings
from django.db import connection, transaction
from django.test import override_settings

from benchmarks import jobs as bench
from benchmarks import plain_celery
from benchmarks.harness import (
    ROOT,
    CaseResult,
    CpuMeter,
    Worker,
    Workers,
    empty_queues,
    pause,
    timed_drain,
)
from benchmarks.sizes import SIZES
from jobs import enqueue_many as job_enqueue_many
from jobs.models import Job, JobState

# variant -> (task, what it is)
VARIANTS: dict[str, tuple[Any, str]] = {
    "bare": (bench.bare_noop, "bare Celery @shared_task, no result backend"),
    "bare_results": (
        bench.bare_noop_results,
        "bare Celery + django-celery-results (the project's result backend)",
    ),
    "ledger_off": (bench.noop_untracked, "Backlot @job track=False"),
    "ledger_on": (bench.noop, "Backlot @job track=True (ledger)"),
}
CHUNK = 1000  # rows per job_enqueue_many call, as the campaign fan-out does


def queue_backlog(task: Any, count: int) -> None:
    """Queue `count` no-op jobs the way each flavour is meant to be queued in bulk."""
    from config.celery import app

    if task.name.startswith("bench.bare"):
        with app.producer_or_acquire() as producer:
            for i in range(count):
                task.apply_async((i,), producer=producer)
        return
    for start in range(0, count, CHUNK):
        with transaction.atomic():
            job_enqueue_many(
                task=task, calls=[((i,), {}) for i in range(start, min(count, start + CHUNK))]
            )


def drain_rounds(
    result: CaseResult,
    workers_for: dict[str, list[Worker]],
    count: int,
    repeats: int,
    timeout: float,
) -> dict[str, list[float]]:
    """Alternate the variants `repeats` times (the order flips every round); jobs/s per
    variant. CPU shares and, on PostgreSQL, new connections per job go to result.extra."""
    variants = list(workers_for)
    rates: dict[str, list[float]] = {v: [] for v in variants}
    cpu: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
    sessions: dict[str, list[float]] = {v: [] for v in variants}
    for round_no in range(repeats):
        order = variants if round_no % 2 == 0 else variants[::-1]
        for variant in order:
            task, _ = VARIANTS[variant.removesuffix("_reuse")]
            workers = workers_for[variant]
            succeeded_before = _succeeded(task)
            queue_backlog(task, count)
            connection.close()
            opened = pg_sessions()
            meter = CpuMeter(workers)
            seconds = timed_drain(workers, timeout)
            cpu[variant].append(meter.stop())
            closed = pg_sessions()
            if opened is not None and closed is not None:
                sessions[variant].append((closed - opened) / count)
            rates[variant].append(count / seconds)
            done = _succeeded(task) - succeeded_before
            if getattr(task, "track", False) and done != count:
                result.notes.append(
                    f"{variant} round {round_no + 1}: {done} of {count} ledger rows succeeded"
                )
            connection.close()
    for variant in variants:
        shares = cpu[variant]
        result.extra.setdefault("cpu_pct", {})[variant] = {
            key: sorted(s[key] for s in shares)[len(shares) // 2] for key in shares[0]
        }
        if sessions[variant]:
            result.extra.setdefault("new_db_connections_per_job", {})[variant] = round(
                sorted(sessions[variant])[len(sessions[variant]) // 2], 3
            )
    return rates


def pg_sessions() -> int | None:
    """Sessions PostgreSQL has opened on this database so far (None on SQLite)."""
    if connection.vendor != "postgresql":
        return None
    with connection.cursor() as cursor:
        cursor.execute("select sessions from pg_stat_database where datname = current_database()")
        value = int(cursor.fetchone()[0])
    connection.close()
    return value


# The HOT target of issue 16: UPDATEs of jobs_job over a ledger drain that PostgreSQL made
# heap-only (no index entry written: no indexed column changed and the page had room).
HOT_GOAL = 0.9
# UPDATEs per ledger job over a drain: its success alone (the published mark is in the INSERT,
# and a short job writes no claim: DEFER_CLAIM, in prefork's pool processes too).
UPDATES_PER_JOB = 1


def job_table_updates() -> tuple[int, int] | None:
    """(n_tup_upd, n_tup_hot_upd) of jobs_job as PostgreSQL's statistics show them now (None on
    SQLite). Backends report their counts asynchronously (at exit, or within about a second of
    going idle, PGSTAT_MIN_INTERVAL / PGSTAT_IDLE_INTERVAL): callers poll (wait_job_updates)."""
    if connection.vendor != "postgresql":
        return None
    with connection.cursor() as cursor:
        if getattr(connection, "pg_version", 0) >= 150000:
            cursor.execute("select pg_stat_force_next_flush()")  # this backend's own counts
        cursor.execute("select pg_stat_clear_snapshot()")
        cursor.execute(
            "select n_tup_upd, n_tup_hot_upd from pg_stat_user_tables where relname = %s",
            [Job._meta.db_table],
        )
        upd, hot = cursor.fetchone()
    return int(upd), int(hot)


def wait_job_updates(
    before: tuple[int, int], expected: int, timeout: float = 30
) -> tuple[int, int]:
    """(UPDATEs, HOT UPDATEs) of jobs_job since `before`, once at least `expected` UPDATEs are
    reported or the counts stopped moving for 11 s (an idle backend reports within 10 s,
    PGSTAT_IDLE_INTERVAL), or after `timeout`."""
    deadline = time.monotonic() + timeout
    last, still_since = None, time.monotonic()
    while True:
        now = job_table_updates() or before
        delta = (now[0] - before[0], now[1] - before[1])
        if delta[0] >= expected or time.monotonic() > deadline:
            return delta
        if delta != last:
            last, still_since = delta, time.monotonic()
        elif time.monotonic() - still_since > 11 and delta[0] > 0:
            return delta
        time.sleep(0.25)


def job_table_updates_settled(first: tuple[int, int], quiet: float = 2.5) -> tuple[int, int]:
    """The counts once they stopped moving for `quiet` seconds (the warm-up's backends have
    reported), at most 15 s."""
    deadline = time.monotonic() + 15
    last, since = first, time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.25)
        now = job_table_updates() or last
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet:
            break
    return last


def hot_figure(result: CaseResult, before: tuple[int, int], ledger_jobs: int) -> None:
    """HOT share of jobs_job's UPDATEs over the ledger drains, as a figure and a target."""
    upd, hot = wait_job_updates(before, UPDATES_PER_JOB * ledger_jobs)
    share = hot / upd if upd else 0.0
    result.figure(
        "HOT updates / updates (jobs_job)",
        [share],
        "x",
        what="n_tup_hot_upd / n_tup_upd of jobs_job over the ledger drains (pg_stat_user_tables)",
    )
    result.extra["jobs_job_updates"] = {
        "updates": upd,
        "hot_updates": hot,
        "ledger_jobs": ledger_jobs,
        "updates_per_job": round(upd / ledger_jobs, 2) if ledger_jobs else None,
    }
    if upd < UPDATES_PER_JOB * ledger_jobs:
        result.notes.append(
            f"jobs_job: {upd:,} UPDATEs reported for {ledger_jobs:,} ledger jobs "
            f"(expected {UPDATES_PER_JOB * ledger_jobs:,}; statistics not all flushed)"
        )
    result.target(
        "HOT UPDATEs of jobs_job over a ledger drain (n_tup_hot_upd / n_tup_upd)",
        share,
        f">= {HOT_GOAL}",
        share >= HOT_GOAL,
        detail=f"{hot:,} of {upd:,} UPDATEs heap-only",
    )


def _succeeded(task: Any) -> int:
    if not getattr(task, "track", False):
        return 0
    return Job.objects.filter(task_name=task.name, state=JobState.SUCCEEDED).count()


# The worker settings that keep database connections between tasks (see the module).
REUSE_SETTINGS = "benchmarks.settings_reuse"


def _drain(db: str, variants: list[str], full: bool) -> CaseResult:
    size = SIZES[f"drain_{db}"]
    count = size.count(full)
    engine = "PostgreSQL" if db == "pg" else "SQLite"
    result = CaseResult(
        case=f"drain_{db}",
        title=f"1. Drain throughput, one worker prefork -c 2, {engine}",
        params={
            "jobs_per_drain": count,
            "issue_jobs_per_drain": size.issue,
            "rounds": size.repeats,
            "worker": "celery -A config worker -c 2 -P prefork",
            "database": db,
            "prefetch_multiplier": settings.CELERY_WORKER_PREFETCH_MULTIPLIER,
            "conn_max_age": settings.DATABASES["default"]["CONN_MAX_AGE"],
        },
    )
    if count != size.issue:
        result.notes.append(
            f"scaled: {count:,} jobs per drain instead of {size.issue:,} (15-minute budget)"
        )
    if any(v.endswith("_reuse") for v in variants):
        result.notes.append(
            "*_reuse: a second worker with CELERY_DB_REUSE_MAX set (benchmarks/settings_reuse.py); "
            "without it Celery's Django fixup closes the DB connection around every task, "
            "whatever CONN_MAX_AGE says"
        )
    empty_queues()
    with Workers() as workers:
        shipped = workers.start(f"drain-{db}", concurrency=2)
        reuse = None
        if any(v.endswith("_reuse") for v in variants):
            reuse = workers.start(
                f"drain-{db}-reuse", concurrency=2, env={"DJANGO_SETTINGS_MODULE": REUSE_SETTINGS}
            )
        every = [w for w in (shipped, reuse) if w]
        for worker in every:
            worker.wait_ready()
        pause(every)
        workers_for = {v: [reuse if reuse and v.endswith("_reuse") else shipped] for v in variants}
        # A short warm-up drain per variant: imports, connections, caches.
        drain_rounds(CaseResult("warmup", ""), workers_for, 100, 1, 60)
        ledger_jobs = count * size.repeats * sum(v.startswith("ledger_on") for v in variants)
        updates_before = job_table_updates()
        if updates_before is not None:  # the warm-up's counts are in before the clock starts
            updates_before = job_table_updates_settled(updates_before)
        rates = drain_rounds(result, workers_for, count, size.repeats, timeout=300)
        if updates_before is not None and ledger_jobs:
            hot_figure(result, updates_before, ledger_jobs)
    suffix = "" if db == "pg" else "_sqlite"
    label = {v: v if v == "bare" else v + suffix for v in variants}
    for variant in variants:
        result.figure(
            label[variant],
            rates[variant],
            "jobs/s",
            what=VARIANTS[variant.removesuffix("_reuse")][1]
            + (" (worker keeps DB connections)" if variant.endswith("_reuse") else ""),
        )
    for variant in variants:
        if variant != "bare":
            result.ratio(f"{label[variant]} / bare", rates[variant], rates["bare"])
    if db == "pg":
        on = result.ratio(
            "ledger_on / bare_results_reuse", rates["ledger_on"], rates["bare_results_reuse"]
        )
        result.ratio(
            "ledger_on_reuse / bare_results_reuse",
            rates["ledger_on_reuse"],
            rates["bare_results_reuse"],
        )
        vs_bare = result.ratios["ledger_on / bare"]["median"]
        result.target("ledger on (PostgreSQL) / bare drain", vs_bare, ">= 0.7", vs_bare >= 0.7)
        result.target(
            "ledger on / django-celery-results alone with reused connections",
            on,
            ">= 1.0",
            on >= 1.0,
        )
        off = result.ratios["ledger_off / bare"]["median"]
        result.target("ledger off / bare drain", off, ">= 0.95", off >= 0.95)
    else:
        lite = result.ratios["ledger_on_sqlite / bare"]["median"]
        result.target("ledger on (SQLite) / bare drain", lite, ">= 0.6", lite >= 0.6)
    return result


def run_pg(*, full: bool = False) -> CaseResult:
    return _drain(
        "pg",
        [
            "bare",
            "bare_results",
            "bare_results_reuse",
            "ledger_off",
            "ledger_on",
            "ledger_on_reuse",
        ],
        full,
    )


def run_sqlite(*, full: bool = False) -> CaseResult:
    return _drain("sqlite", ["bare", "bare_results", "ledger_on"], full)


# --------------------------------------------------------------------------- layout


def _expand_variable(match: re.Match[str]) -> str:
    """${VAR:-default} (a match of VAR and default) -> the environment's value or the default."""
    return os.environ.get(match[1], match[2] or "")


def shipped_worker_lines() -> list[list[str]]:
    """The `celery ... worker` command lines of the Procfile that consume the default queue
    (what `make run` starts), as worker arguments with ${VAR:-default} expanded from the
    environment, each repeated as many times as it runs (docker-compose.yml's deploy.replicas,
    which scripts/run.sh passes to honcho)."""
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    lines = []
    for raw in (ROOT / "Procfile").read_text().splitlines():
        name, _, command = raw.partition(":")
        if not command.strip() or raw.lstrip().startswith("#"):
            continue
        command = re.sub(r"\$\{(\w+)(?::-([^}]*))?\}", _expand_variable, command)
        argv = shlex.split(command)
        if "celery" not in argv[0] or "worker" not in argv:
            continue
        args = argv[argv.index("worker") + 1 :]
        if "default" not in _queues_of(args):
            continue  # the no-op jobs are short jobs: what the default queue's workers give
        replicas = str(compose.get(name.strip(), {}).get("deploy", {}).get("replicas", 1))
        count = int(re.sub(r"\$\{(\w+)(?::-([^}]*))?\}", _expand_variable, replicas))
        lines += [without_option(args, "-n", "--hostname")] * count
    return lines


def _queues_of(args: list[str]) -> list[str]:
    for flag, value in zip(args, [*args[1:], ""], strict=True):
        if flag in ("-Q", "--queues"):
            return value.split(",")
        if flag.startswith("--queues="):
            return flag.partition("=")[2].split(",")
    return ["default"]


def without_option(args: list[str], short: str, long: str) -> list[str]:
    """A worker line's arguments without one option and its value (`-n x`, `--hostname x`,
    `--hostname=x`)."""
    out, skip = [], False
    for arg in args:
        if skip:
            skip = False
            continue
        if arg in (short, long):
            skip = True
            continue
        if arg.startswith(f"{long}="):
            continue
        out.append(arg)
    return out


def run_layout(*, full: bool = False) -> CaseResult:
    size = SIZES["layout"]
    count = size.count(full)
    cores = os.cpu_count() or 1
    shipped = shipped_worker_lines()
    result = CaseResult(
        case="layout",
        title="Worker layout: no-op drains, the Procfile's workers vs one default worker -c 2",
        params={
            "jobs_per_drain": count,
            "rounds": size.repeats,
            "cores": cores,
            "shipped": [" ".join(a) for a in shipped],
        },
    )
    if count != size.issue:
        result.notes.append(f"scaled: {count:,} jobs per drain instead of {size.issue:,}")
    empty_queues()
    with Workers() as workers:
        sets = {
            "single_c2": [workers.start("single", concurrency=2)],
            "shipped": [workers.start(f"shipped{i}", argv=args) for i, args in enumerate(shipped)],
            # the same lines with the claim written first (BACKLOT['DEFER_CLAIM'] off; on by
            # default since issue 26 item 3: one write per short job)
            "shipped_claiming": [
                workers.start(f"claiming{i}", argv=args, env={"BACKLOT_DEFER_CLAIM": "0"})
                for i, args in enumerate(shipped)
            ],
            "per_core_c1": [workers.start(f"core{i}", concurrency=1) for i in range(cores)],
            "single_c2_prefetch4": [
                workers.start(
                    "prefetch4", concurrency=2, env={"CELERY_WORKER_PREFETCH_MULTIPLIER": "4"}
                )
            ],
            "per_core_c1_prefetch4": [
                workers.start(
                    f"core{i}p4", concurrency=1, env={"CELERY_WORKER_PREFETCH_MULTIPLIER": "4"}
                )
                for i in range(cores)
            ],
        }
        # bare Celery without Backlot (benchmarks.plain_celery): its own app, queue and defaults
        plain = workers.start("plain", app="benchmarks.plain_celery", argv=["-c", "2"])
        for worker in [plain, *(w for group in sets.values() for w in group)]:
            worker.wait_ready()
        every = [w for group in sets.values() for w in group]
        pause(every)
        pause([plain], plain_celery.QUEUE)
        # What each drain runs: bare no-ops, and issue 16's headline, the shipped layout
        # running ledger-on jobs (the same worker processes).
        plans: dict[str, tuple[list[Worker], Any]] = {
            name: (group, bench.bare_noop) for name, group in sets.items()
        }
        plans["shipped_ledger_on"] = (sets["shipped"], bench.noop)
        plans["shipped_claiming_ledger_on"] = (sets["shipped_claiming"], bench.noop)
        del plans["shipped_claiming"]  # bare no-ops write no row: the same as "shipped"
        plans["plain_c2"] = ([plain], plain_celery.plain_noop)
        rates: dict[str, list[float]] = {name: [] for name in plans}
        for round_no in range(size.repeats + 1):  # round 0 warms up
            names = list(plans) if round_no % 2 == 0 else list(reversed(plans))
            for name in names:
                group, task = plans[name]
                n = 200 if round_no == 0 else count
                if name == "plain_c2":
                    plain_celery.queue_backlog(n)
                    seconds = timed_drain(group, 300, plain_celery.QUEUE)
                else:
                    # each backlog is enqueued as its workers' project would: with the setting
                    # on (the default), first messages stamped, whose deliveries skip reading
                    # the row
                    deferring = name != "shipped_claiming_ledger_on"
                    with override_settings(BACKLOT={**settings.BACKLOT, "DEFER_CLAIM": deferring}):
                        queue_backlog(task, n)
                    connection.close()
                    seconds = timed_drain(group, 300)
                if round_no:
                    rates[name].append(n / seconds)
    result.figure("single_c2", rates["single_c2"], "jobs/s", what="one celery worker -c 2")
    result.figure(
        "shipped",
        rates["shipped"],
        "jobs/s",
        what="Procfile worker line(s): " + " | ".join(result.params["shipped"]),
    )
    result.figure(
        "per_core_c1", rates["per_core_c1"], "jobs/s", what=f"{cores} celery workers -c 1"
    )
    result.figure(
        "single_c2_prefetch4",
        rates["single_c2_prefetch4"],
        "jobs/s",
        what="one celery worker -c 2, CELERY_WORKER_PREFETCH_MULTIPLIER=4 (Celery's default)",
    )
    shipped_ratio = result.ratio("shipped / single_c2", rates["shipped"], rates["single_c2"])
    result.ratio("per_core_c1 / single_c2", rates["per_core_c1"], rates["single_c2"])
    result.ratio(
        "single_c2_prefetch4 / single_c2", rates["single_c2_prefetch4"], rates["single_c2"]
    )
    result.figure(
        "per_core_c1_prefetch4",
        rates["per_core_c1_prefetch4"],
        "jobs/s",
        what=f"{cores} celery workers -c 1, prefetch multiplier 4",
    )
    result.ratio(
        "per_core_c1_prefetch4 / single_c2",
        rates["per_core_c1_prefetch4"],
        rates["single_c2"],
    )
    result.target(
        "shipped worker layout / single worker -c 2", shipped_ratio, ">= 1.6", shipped_ratio >= 1.6
    )
    result.figure(
        "shipped_ledger_on",
        rates["shipped_ledger_on"],
        "jobs/s",
        what="Procfile worker line(s), Backlot @job track=True (ledger) no-ops (DEFER_CLAIM)",
    )
    vs_project = result.ratio(
        "shipped_ledger_on / single_c2", rates["shipped_ledger_on"], rates["single_c2"]
    )
    vs_default = result.ratio(
        "shipped_ledger_on / single_c2_prefetch4",
        rates["shipped_ledger_on"],
        rates["single_c2_prefetch4"],
    )
    result.figure(
        "shipped_claiming_ledger_on",
        rates["shipped_claiming_ledger_on"],
        "jobs/s",
        what="the same worker lines with BACKLOT['DEFER_CLAIM'] off (the claim written first)",
    )
    result.ratio(
        "shipped_claiming_ledger_on / single_c2",
        rates["shipped_claiming_ledger_on"],
        rates["single_c2"],
    )
    result.ratio(
        "shipped_ledger_on / shipped_claiming_ledger_on",
        rates["shipped_ledger_on"],
        rates["shipped_claiming_ledger_on"],
    )
    result.figure(
        "plain_c2",
        rates["plain_c2"],
        "jobs/s",
        what="one worker -c 2 of a plain Celery app (no Django, no Backlot: kombu's Redis "
        "transport, Celery's defaults: early ack, prefetch 4), its own no-ops and queue",
    )
    vs_plain = result.ratio(
        "shipped_ledger_on / plain_c2", rates["shipped_ledger_on"], rates["plain_c2"]
    )
    result.ratio("single_c2 / plain_c2", rates["single_c2"], rates["plain_c2"])
    # Issue 16's headline: against bare Celery's own default worker (prefetch 4), the project's
    # settings (prefetch 1) and a plain Celery app without Backlot, whichever drains fastest.
    headline = min(vs_project, vs_default, vs_plain)
    result.target(
        "shipped layout, ledger-on jobs / bare worker -c 2 (headline)",
        headline,
        ">= 1.0",
        headline >= 1.0,
        detail=f"vs -c 2 prefetch 4 (Celery's default) {vs_default:.3f}, "
        f"vs -c 2 prefetch 1 (the project's) {vs_project:.3f}, "
        f"vs a plain Celery app's -c 2 {vs_plain:.3f}",
    )
    return result
