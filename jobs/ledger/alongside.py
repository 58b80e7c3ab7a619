"""A caller's new row written with its job (enqueue's ``alongside=``): on PostgreSQL in the
job's own INSERT statement, as a data-modifying CTE, so the two are atomic without a
transaction around them; elsewhere its own INSERT just before the job's, in one transaction.

A view that accepts an email writes its message row and the send job together: in a
transaction, BEGIN, the message's INSERT, the job's INSERT and COMMIT are four round trips;
here they are one. The row is inserted as ``bulk_create`` inserts (each field's ``pre_save``
and prepared value, no ``save()`` override and no pre_save/post_save signal), and its
primary key is set on the instance.
"""

from __future__ import annotations

import functools
from typing import Any

from django.db import DEFAULT_DB_ALIAS, connections, models, router
from django.db.models.expressions import DatabaseDefault


def check(row: Any) -> None:
    """A ValueError naming what is wrong unless `row` is a new model instance that one
    statement of the job's database can insert."""
    if not isinstance(row, models.Model):
        raise ValueError(f"alongside= takes a new model instance, not {type(row).__name__}")
    name = type(row).__name__
    meta = row._meta
    if not row._state.adding:
        raise ValueError(f"alongside= takes a new {name}: this one is already saved")
    if meta.parents:
        raise ValueError(
            f"alongside= cannot insert {name}: a model with multi-table inheritance is rows in "
            "several tables; save it in a transaction around the enqueue instead"
        )
    database = router.db_for_write(type(row), instance=row) or DEFAULT_DB_ALIAS
    if database != DEFAULT_DB_ALIAS:
        raise ValueError(
            f"alongside= cannot insert {name}: it is written to the database {database!r}, the "
            f"job to {DEFAULT_DB_ALIAS!r}"
        )


def values(row: models.Model, db: Any) -> tuple[tuple[Any, ...], list[Any]]:
    """The columns `row`'s INSERT sets and their values, prepared for `db` as save() prepares
    them. An auto primary key left unset and a field left to its db_default are not sent."""
    meta = row._meta
    fields = []
    prepared = []
    for field in meta.concrete_fields:
        if field.generated or (field is meta.auto_field and row.pk is None):
            continue
        value = field.pre_save(row, True)
        if isinstance(value, DatabaseDefault):
            continue
        if hasattr(value, "resolve_expression"):
            raise ValueError(
                f"alongside= takes plain values: {meta.object_name}.{field.name} is an "
                "expression; save the row in a transaction around the enqueue instead"
            )
        fields.append(field)
        prepared.append(field.get_db_prep_save(value, db))
    return tuple(fields), prepared


@functools.lru_cache(maxsize=64)
def insert_sql(model: Any, fields: tuple[Any, ...], vendor: str) -> str:
    """The row's INSERT; on PostgreSQL returning its primary key, to be a CTE."""
    quote = connections[DEFAULT_DB_ALIAS].ops.quote_name
    columns = ", ".join(quote(f.column) for f in fields)
    marks = ", ".join(["%s"] * len(fields))
    sql = f"INSERT INTO {quote(model._meta.db_table)} ({columns}) VALUES ({marks})"
    if vendor == "postgresql":
        sql += f" RETURNING {quote(model._meta.pk.column)}"
    return sql


def insert_alone(row: models.Model, db: Any) -> None:
    """The row's own INSERT (a database where a CTE cannot insert: SQLite); the caller holds
    the transaction that the job's INSERT joins."""
    fields, prepared = values(row, db)
    with db.cursor() as cursor:
        cursor.execute(insert_sql(type(row), fields, db.vendor), prepared)
        if row.pk is None:
            row.pk = db.ops.last_insert_id(cursor, row._meta.db_table, row._meta.pk.column)
    saved(row, row.pk, db)


def saved(row: models.Model, pk: Any, db: Any) -> None:
    """`row` is in the database under `pk`."""
    row.pk = pk
    row._state.adding = False
    row._state.db = db.alias
