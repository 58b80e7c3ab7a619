"""Issue 26 item 4: one relay sweep (jobs.flow.relay.job_relay, as beat runs it) over a ledger
of 1,000,000 finished and 10,000 active rows, none of which needs anything: what is measured is
the cost of looking. Also each SQL statement of a sweep, and jobs.web.monitoring.queue_stats
(read by /metrics, /health/ and the dashboard), the same way.

The ledger is written by PostgreSQL (benchmarks.ledger_fill), then vacuumed and analyzed. The
jobs_ tables are truncated before the fill and after the run (the bench database is the
suite's own); the queues in Redis are empty throughout.
"""

from __future__ import annotations

import contextlib
import re
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

from django.db import connection, transaction

from benchmarks import ledger_fill
from benchmarks.harness import CaseResult, empty_queues, percentile, queued
from benchmarks.sizes import SIZES
from jobs.core.conf import backlot_settings
from jobs.flow.relay import job_relay
from jobs.models import Job
from jobs.web.monitoring import queue_stats

ACTIVE = 10_000  # the issue's figure, at every scale
WARMUP = 2
CAPTURED = 5  # sweeps (and queue_stats calls) whose statements are timed one by one
SWEEP_GOAL_MS = 100.0


def run(*, full: bool = False) -> CaseResult:
    size = SIZES["relay_sweep"]
    finished = size.count(full)
    result = CaseResult(
        case="relay_sweep",
        title=f"Issue 26 item 4: relay sweep over {finished:,} finished + {ACTIVE:,} active "
        "ledger rows, nothing to do (PostgreSQL)",
        params={
            "finished_rows": finished,
            "active_rows": ACTIVE,
            "sweeps": size.repeats,
            "warmup_sweeps": WARMUP,
        },
    )
    if connection.vendor != "postgresql":
        raise RuntimeError("the relay_sweep case fills the ledger with PostgreSQL's SQL")
    if finished != size.issue:
        result.notes.append(
            f"scaled: {finished:,} finished rows instead of {size.issue:,} "
            "(the target is stated for the issue's size)"
        )
    empty_queues()
    ledger_fill.truncate_job_tables()
    try:
        started = time.monotonic()
        ledger_fill.fill_ledger(finished=finished, active=ACTIVE)
        filled = time.monotonic() - started
        ledger_fill.vacuum_analyze_job_tables()
        result.extra["fill_seconds"] = round(filled, 1)
        result.extra["vacuum_analyze_seconds"] = round(time.monotonic() - started - filled, 1)
        result.extra["rows"] = ledger_fill.rows_by_state()
        result.extra["relation_sizes_mb"] = ledger_fill.relation_sizes_mb()
        result.notes.append(
            f"fill: {finished + ACTIVE:,} rows by INSERT ... SELECT in {filled:.0f} s, "
            f"VACUUM ANALYZE {result.extra['vacuum_analyze_seconds']:.0f} s"
        )
        _measure_sweep(result, size.repeats)
        _measure_queue_stats(result, size.repeats)
    finally:
        ledger_fill.truncate_job_tables()
        empty_queues()
    return result


# --------------------------------------------------------------------------- measuring


class StatementClock:
    """Every statement run on `connection` with its time (Django's execute_wrapper, the hook
    CaptureQueriesContext rests on: its times are rounded to the millisecond, these are not)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any, float]] = []

    def __call__(
        self, execute: Callable[..., Any], sql: str, params: Any, many: bool, context: Any
    ) -> Any:
        started = time.perf_counter()
        try:
            return execute(sql, params, many, context)
        finally:
            self.calls.append((sql, params, time.perf_counter() - started))

    @contextlib.contextmanager
    def recording(self) -> Iterator[StatementClock]:
        self.calls = []
        with connection.execute_wrapper(self):
            yield self


def _timed(call: Callable[[], Any], repeats: int) -> tuple[list[float], list[Any]]:
    """Milliseconds of `repeats` calls after WARMUP, and what each call returned."""
    for _ in range(WARMUP):
        call()
    times, returned = [], []
    for _ in range(repeats):
        started = time.perf_counter()
        returned.append(call())
        times.append((time.perf_counter() - started) * 1000)
    return times, returned


def _statements(call: Callable[[], Any]) -> tuple[list[dict[str, Any]], float, float]:
    """The statements of `call` grouped by SQL text (the relay runs some once per queue),
    slowest first: per group the median over CAPTURED calls of its ms per call; and the medians
    of a call's time in SQL and of the rest of its time (Redis, Python)."""
    clock = StatementClock()
    totals: list[float] = []
    rest: list[float] = []
    per_call: dict[str, list[float]] = defaultdict(list)
    counts: dict[str, int] = {}
    sample: dict[str, Any] = {}
    for _ in range(CAPTURED):
        with clock.recording():
            started = time.perf_counter()
            call()
            wall = (time.perf_counter() - started) * 1000
        totals.append(sum(seconds for *_, seconds in clock.calls) * 1000)
        rest.append(wall - totals[-1])
        spent: dict[str, float] = defaultdict(float)
        for sql, params, seconds in clock.calls:
            spent[sql] += seconds * 1000
            sample.setdefault(sql, params)
        for sql, ms in spent.items():
            per_call[sql].append(ms)
            counts[sql] = sum(1 for other, *_ in clock.calls if other == sql)
    groups = [
        {
            "ms": round(statistics.median(times), 3),
            "max_ms": round(max(times), 3),
            "statements_per_call": counts[sql],
            "sql": sql,
            "params": sample[sql],
        }
        for sql, times in per_call.items()
    ]
    groups.sort(key=lambda group: group["ms"], reverse=True)
    return groups, statistics.median(totals), statistics.median(rest)


def _abbreviated(sql: str, width: int = 170) -> str:
    table = connection.ops.quote_name(Job._meta.db_table)
    text = " ".join(sql.split()).replace(f"{table}.", "")
    text = re.sub(rf"^SELECT (.{{40,}}?) FROM {re.escape(table)}", f"SELECT … FROM {table}", text)
    return text if len(text) <= width else text[: width - 1] + "…"


def _explain(groups: list[dict[str, Any]], count: int = 3) -> list[str]:
    """EXPLAIN (ANALYZE, BUFFERS) of the slowest statements, plain EXPLAIN of the others (with
    the parameters of their first run), in a transaction rolled back: the sweep's UPDATEs
    match nothing, but EXPLAIN ANALYZE runs them. Each group gets `seq_scan`: whether its plan
    reads the whole of jobs_job (on the schema before b2c0ebb the planner chose that for the
    lost-message EXISTS in some runs and not in others, as ANALYZE's sample fell)."""
    plans: list[str] = []
    scanned = f"Seq Scan on {Job._meta.db_table} "
    with contextlib.suppress(_RolledBack), transaction.atomic(), connection.cursor() as cursor:
        for position, group in enumerate(groups):
            options = "(ANALYZE, BUFFERS) " if position < count else ""
            cursor.execute(f"EXPLAIN {options}{group['sql']}", group["params"])
            plan = "\n".join(row[0] for row in cursor.fetchall())
            group["seq_scan"] = scanned in plan
            if options:
                plans.append(f"{_abbreviated(group['sql'], 110)}\n{plan}")
        raise _RolledBack
    return plans


class _RolledBack(Exception):
    """Ends the EXPLAIN's transaction with a rollback."""


def _report_statements(result: CaseResult, what: str, call: Callable[[], Any]) -> None:
    groups, total, rest = _statements(call)
    plans = _explain(groups)
    for group in groups:
        group["params"] = [str(param) for param in group["params"] or ()]
    result.extra[f"{what}_statements"] = groups
    result.extra[f"{what}_plans"] = plans
    result.extra[f"{what}_sql_ms"] = round(total, 3)
    result.extra[f"{what}_outside_sql_ms"] = round(rest, 3)
    count = sum(group["statements_per_call"] for group in groups)
    result.notes.append(
        f"{what}: {count} statements, {total:.1f} ms in SQL and {rest:.1f} ms outside it "
        f"(Redis, Python; medians of {CAPTURED} calls); slowest (ms per call, statements):"
    )
    for group in groups[:5]:
        result.notes.append(
            f"  {group['ms']:7.2f} ms {group['statements_per_call']:2d} x "
            f"{'[Seq Scan] ' if group['seq_scan'] else ''}{_abbreviated(group['sql'])}"
        )
    scans = sum(group["statements_per_call"] for group in groups if group["seq_scan"])
    result.notes.append(f"{what}: {scans} statement(s) planned as a Seq Scan on jobs_job")
    for plan in plans:
        print(f"\n-- {what}: EXPLAIN (ANALYZE, BUFFERS) {plan}", flush=True)


def _measure_sweep(result: CaseResult, repeats: int) -> None:
    times, sent = _timed(job_relay, repeats)
    waiting = sum(queued(queue) for queue in backlot_settings().QUEUES)
    if any(sent) or waiting:
        raise AssertionError(
            f"the sweeps sent {sum(sent)} job(s) ({waiting} messages in Redis): the fill left "
            "work for the relay, so what was measured is not the cost of looking"
        )
    figure = result.figure(
        "relay sweep",
        times,
        "ms",
        higher_is_better=False,
        p90=percentile(times, 90),
        what="jobs.flow.relay.job_relay(), this process, autocommit, bench Redis; sent 0",
    )
    p50 = figure["median"]
    result.notes.append(
        f"sweep: p50 {p50:.1f} ms, p90 {figure['p90']:.1f} ms, "
        f"min {figure['min']:.1f}, max {figure['max']:.1f} ({repeats} sweeps after {WARMUP})"
    )
    _report_statements(result, "sweep", job_relay)
    met = p50 < SWEEP_GOAL_MS
    margin = (
        f"{'met' if met else 'not met'}: {abs(p50 - SWEEP_GOAL_MS):.1f} ms "
        f"{'under' if met else 'over'} the goal ({p50 / SWEEP_GOAL_MS:.2f} x)"
    )
    result.notes.append(f"target sweep p50 < {SWEEP_GOAL_MS:.0f} ms: {margin}")
    finished = result.params["finished_rows"]
    result.target(
        f"relay sweep p50, {finished:,} finished + {ACTIVE:,} active rows (ms)",
        p50,
        f"< {SWEEP_GOAL_MS:.0f} ms",
        met,
        detail=margin,
    )


def _measure_queue_stats(result: CaseResult, repeats: int) -> None:
    times, _ = _timed(queue_stats, repeats)
    figure = result.figure(
        "queue_stats",
        times,
        "ms",
        higher_is_better=False,
        p90=percentile(times, 90),
        what="jobs.web.monitoring.queue_stats() (/metrics, /health/, the dashboard)",
    )
    result.notes.append(
        f"queue_stats: p50 {figure['median']:.1f} ms, p90 {figure['p90']:.1f} ms, "
        f"min {figure['min']:.1f}, max {figure['max']:.1f}"
    )
    _report_statements(result, "queue_stats", queue_stats)
