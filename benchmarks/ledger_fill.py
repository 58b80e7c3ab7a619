"""A ledger as a week of traffic leaves it, written by PostgreSQL itself: finished jobs, and
active ones that need nothing from the relay for the next hour (the relay_sweep case).

INSERT ... SELECT FROM generate_series, not the ORM: about a minute for a million rows, where
bulk_create would take ten. The columns come from the model (Job._meta.concrete_fields), so the
fill follows the schema: a column it does not set gets its model default (its database default,
or NULL, when it has none), and any trigger the schema has fires as it would for an enqueue's
INSERT.
"""

from __future__ import annotations

from typing import Any

from django.db import connection
from django.db.models import NOT_PROVIDED, Field

from benchmarks import jobs as bench
from jobs.core.conf import backlot_settings
from jobs.models import Job, JobState

# Task names of benchmarks.jobs: the relay reports rows of a task it does not know.
TASKS = (
    bench.noop.name,
    bench.tracked_stamp.name,
    bench.progress_loop.name,
    bench.rate_limited.name,
)
DEAD_EVERY = 33  # ~3 % of the finished jobs gave up
WEEK_S = 7 * 24 * 3600
# Where an active row's next event lies: past the end of any run of the case. A queued row is
# thereby published "just now" at every sweep (never MISSING_AFTER, 4 s, ago with its queue
# empty in Redis, which the relay would send again). Refreshing published_at before each
# sweep instead would write 2,500 row versions a sweep (and, before b2c0ebb, 2,500 entries
# into every index: published_at was in job_due_idx's predicate) and measure that churn too.
AHEAD = "interval '1 hour'"


def fill_ledger(*, finished: int, active: int) -> None:
    """`finished` jobs that ended over the last 7 days (succeeded, a few dead), oldest first
    as the table grew; then `active` ones, a quarter each queued (published), running (lease
    ahead), scheduled and retrying (both due in an hour or more)."""
    queues = list(backlot_settings().QUEUES)
    common = {
        "id": "gen_random_uuid()",
        "task_name": f"({_array(TASKS)})[1 + mod(i / 7, {len(TASKS)})]",
        "queue": f"({_array(queues)})[1 + mod(i, {len(queues)})]",
        "args": "jsonb_build_array(i, 'user' || i || '@example.com')",
    }
    dead = f"mod(i, {DEAD_EVERY}) = 0"
    # x.t: when the job finished, spread evenly over the week up to a second ago
    ended = f"now() - make_interval(secs => {WEEK_S}.0 * ({finished} - i) / {finished})"
    _insert(
        finished,
        f"{ended} - interval '1 second'",
        {
            **common,
            "state": f"CASE WHEN {dead} THEN {_text(JobState.DEAD)} "
            f"ELSE {_text(JobState.SUCCEEDED)} END",
            "attempts": f"CASE WHEN {dead} THEN 3 ELSE 1 END",
            "deliveries": f"CASE WHEN {dead} THEN 3 ELSE 1 END",
            "max_attempts": "3",
            "enqueued_at": "x.t - interval '500 ms'",
            "published_at": "x.t - interval '500 ms'",
            "started_at": "x.t - interval '400 ms'",
            "last_started_at": "x.t - interval '300 ms'",
            "finished_at": "x.t",
            "run_seconds": "0.3",
            "failed_at": f"CASE WHEN {dead} THEN x.t END",
            "error": f"CASE WHEN {dead} THEN 'ConnectionError: refused' ELSE '' END",
        },
    )
    quarter = active // 4
    waited = {"enqueued_at": "x.t - make_interval(secs => i / 1000.0)"}
    ran = {
        "attempts": "1",
        "deliveries": "1",
        "enqueued_at": "x.t - interval '1 minute'",
        "started_at": "x.t - interval '30 seconds'",
        "last_started_at": "x.t - interval '30 seconds'",
    }
    later = f"x.t + {AHEAD} + make_interval(secs => i)"
    kinds: list[tuple[int, dict[str, str]]] = [
        (quarter, {**waited, "state": _text(JobState.QUEUED), "published_at": f"x.t + {AHEAD}"}),
        (
            quarter,
            {
                **ran,
                "state": _text(JobState.RUNNING),
                "published_at": "x.t - interval '1 minute'",
                "lease_expires_at": f"x.t + {AHEAD}",
                "lease_owner": "gen_random_uuid()",
            },
        ),
        (quarter, {**waited, "state": _text(JobState.SCHEDULED), "scheduled_for": later}),
        (
            active - 3 * quarter,
            {
                **ran,
                "state": _text(JobState.RETRYING),
                "max_attempts": "3",
                "failed_at": "x.t - interval '29 seconds'",
                "error": "'ConnectionError: refused'",
                "failures": "jsonb_build_array(jsonb_build_object('attempt', 1, "
                "'exception', 'ConnectionError', 'message', 'refused'))",
                "scheduled_for": later,
            },
        ),
    ]
    for count, values in kinds:
        _insert(count, "now()", {**common, **values})


def _insert(count: int, when: str, values: dict[str, str]) -> None:
    """INSERT ... SELECT over i = 1..count with x.t = `when`: `values` maps a column to an SQL
    expression of i and x.t; every other column gets its default."""
    fields: list[Field[Any, Any]] = list(Job._meta.concrete_fields)
    unknown = set(values) - {field.column for field in fields}
    if unknown:
        raise RuntimeError(f"jobs_job has no column(s) {sorted(unknown)}: the fill needs updating")
    columns: list[str] = []
    selected: list[str] = []
    params: list[Any] = []
    for field in fields:
        if field.column in values:
            selected.append(values[field.column])
        elif field.db_default is not NOT_PROVIDED:
            continue
        elif field.has_default():
            selected.append("%s")
            params.append(field.get_db_prep_save(field.get_default(), connection))
        elif field.null:
            continue
        else:
            raise RuntimeError(f"jobs_job.{field.column} is NOT NULL with no default: fill it")
        columns.append(connection.ops.quote_name(field.column))
    sql = (
        f"INSERT INTO {connection.ops.quote_name(Job._meta.db_table)} ({', '.join(columns)}) "
        f"SELECT {', '.join(selected)} "
        f"FROM generate_series(1, %s) AS g(i), LATERAL (SELECT {when} AS t) AS x"
    )
    with connection.cursor() as cursor:
        cursor.execute(sql, [*params, count])


def _text(value: str) -> str:
    """An SQL string literal (doubled % : the statement also carries %s parameters)."""
    return "'" + str(value).replace("'", "''").replace("%", "%%") + "'"


def _array(values: Any) -> str:
    return f"ARRAY[{', '.join(_text(value) for value in values)}]::text[]"


def job_tables() -> list[str]:
    with connection.cursor() as cursor:
        cursor.execute(
            "select tablename from pg_tables where schemaname = 'public' "
            "and tablename like 'jobs\\_%%' order by tablename"
        )
        return [row[0] for row in cursor.fetchall()]


def truncate_job_tables() -> None:
    tables = ", ".join(connection.ops.quote_name(table) for table in job_tables())
    with connection.cursor() as cursor:
        cursor.execute(f"TRUNCATE {tables} CASCADE")


def vacuum_analyze_job_tables() -> None:
    """What autovacuum would have done by then on a ledger that grew over a week (VACUUM runs
    outside a transaction: Django's autocommit runs each statement on its own)."""
    with connection.cursor() as cursor:
        for table in job_tables():
            cursor.execute(f"VACUUM ANALYZE {connection.ops.quote_name(table)}")


def rows_by_state() -> dict[str, int]:
    with connection.cursor() as cursor:
        cursor.execute(f"select state, count(*) from {Job._meta.db_table} group by state")
        return {state: int(n) for state, n in cursor.fetchall()}


def relation_sizes_mb() -> dict[str, float]:
    """The jobs_ tables (indexes included) and each index of jobs_job, in MB."""
    with connection.cursor() as cursor:
        cursor.execute(
            "select c.relname, pg_total_relation_size(c.oid) from pg_class c "
            "join pg_namespace n on n.oid = c.relnamespace "
            "where n.nspname = 'public' and c.relkind in ('r', 'p') "
            "and c.relname like 'jobs\\_%%' and pg_total_relation_size(c.oid) > 16384 "
            "union all "
            "select i.indexrelid::regclass::text, pg_relation_size(i.indexrelid) "
            "from pg_index i where i.indrelid = %s::regclass order by 1",
            [Job._meta.db_table],
        )
        return {name: round(size / 2**20, 1) for name, size in cursor.fetchall()}
