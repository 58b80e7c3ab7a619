"""New jobs by the thousand (a fan-out, a dead-letter replay): rows sharing everything but
id, arguments and replay link, by COPY on PostgreSQL and multi-row INSERTs elsewhere."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from django.db import connection

from jobs.core import jsontext
from jobs.models import Job

# Rows per statement: keeps one statement's parameters well under PostgreSQL's 65,535 and
# SQLite's 32,766 limits (Job has ~30 columns).
BULK_BATCH = 1000


@dataclass(frozen=True)
class NewRow:
    """One row of a bulk insert: what differs from the prototype row."""

    id: uuid.UUID
    args: list[Any]
    kwargs: dict[str, Any]
    replay_of: int | None = None


_VARYING = ("id", "args", "kwargs", "replay_of_id")


def insert_many(*, prototype: Job, rows: Sequence[NewRow]) -> None:
    """New jobs sharing everything but id, arguments and replay link: COPY on PostgreSQL,
    multi-row INSERTs elsewhere.

    The COPY is written as text, the constant columns dumped once and each row a line of its
    id, args, kwargs and link before them: 6 Python calls a row where psycopg's write_row
    adapting ~22 values (three of them constant JSON, dumped again each row) took 64
    (cProfile of 10,000 rows). The rows store what write_row's (tests/jobs/ledger/test_accept.py
    compares them with the ORM's INSERT, column for column)."""
    if connection.vendor != "postgresql":
        shared = {
            f.attname: getattr(prototype, f.attname)
            for f in Job._meta.concrete_fields
            if f.attname not in _VARYING
        }
        Job.objects.bulk_create(
            [
                Job(**shared, id=r.id, args=r.args, kwargs=r.kwargs, replay_of_id=r.replay_of)
                for r in rows
            ],
            batch_size=BULK_BATCH,
        )
        return
    constant = [
        (f.column, f.get_db_prep_save(getattr(prototype, f.attname), connection))
        for f in Job._meta.concrete_fields
        if f.attname not in _VARYING
    ]
    columns = ", ".join(
        connection.ops.quote_name(name) for name in (*_VARYING, *(c for c, _ in constant))
    )
    table = connection.ops.quote_name(Job._meta.db_table)
    with connection.cursor() as cursor:
        raw = cursor.cursor
        # The constant columns as COPY text once, each dumped by psycopg as write_row would
        # dump it; per row only its id, args, kwargs and replay link are written.
        tail = "\t".join(_copy_text(raw, [value for _, value in constant]))
        dumps = jsontext.dumps  # the text adapt_json_value(value, None) gives, json.dumps's
        with raw.copy(f"COPY {table} ({columns}) FROM STDIN") as copy:
            for start in range(0, len(rows), BULK_BATCH):
                lines = []
                for r in rows[start : start + BULK_BATCH]:
                    # json.dumps escapes every control character (ensure_ascii): of COPY's
                    # special characters only the backslash can occur in its text
                    args, kwargs = dumps(r.args), dumps(r.kwargs)
                    if "\\" in args:
                        args = args.replace("\\", "\\\\")
                    if "\\" in kwargs:
                        kwargs = kwargs.replace("\\", "\\\\")
                    link = "\\N" if r.replay_of is None else r.replay_of
                    lines.append(f"{r.id}\t{args}\t{kwargs}\t{link}\t{tail}\n")
                copy.write("".join(lines))


# COPY's text format escapes (PostgreSQL's "COPY ... Text Format", as psycopg's write_row)
_COPY_ESCAPES = str.maketrans(
    {"\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\v": "\\v", "\f": "\\f", "\r": "\\r"}
)


def _copy_text(cursor: Any, values: Sequence[Any]) -> list[str]:
    """`values` as COPY text fields: dumped by the cursor's adapters in text format (what
    write_row sends), escaped, NULL as \\N."""
    from psycopg.adapt import PyFormat, Transformer  # PostgreSQL's driver, loaded there only

    transformer = Transformer.from_context(cursor)
    dumped = transformer.dump_sequence(values, [PyFormat.TEXT] * len(values))
    encoding = cursor.connection.info.encoding
    return [
        "\\N" if b is None else bytes(b).decode(encoding).translate(_COPY_ESCAPES) for b in dumped
    ]
