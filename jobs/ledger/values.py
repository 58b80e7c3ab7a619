"""A new row's values, prepared for its INSERT as Model.save(force_insert=True) prepares them,
in a fraction of the calls.

Django prepares each value through its field: pre_save(), then get_db_prep_save(), which goes
through get_db_prep_value() and get_prep_value() (and to_python()) to the backend's adapter:
five to seven calls a value, ~35 values a job, ~40 % of the Python work of a ledger-on enqueue
outside the database driver (measured in process: 49 us a row of a plain enqueue, on a 2-core
machine where the whole enqueue takes ~1 ms). For the values a job's row holds at enqueue,
that chain ends where it began or at one adapter call:

- a str of a CharField or TextField is itself (to_python returns a str as it is);
- a uuid.UUID of a UUIDField is itself where the database has a uuid type (PostgreSQL);
- an int of an integer field is what the backend's adapt_integerfield_value makes of it;
- an aware datetime of a DateTimeField is what adapt_datetimefield_value makes of it;
- a dict or list of a JSONField is what adapt_json_value makes of it with the field's encoder.

So a field of exactly these classes (not a subclass, whose methods may differ), with a value
of exactly these types, takes that shortcut; any other field or value (a foreign key, a naive
datetime, an expression, a lazy string, a bool) goes through get_db_prep_save() as before.
pre_save() is reading the attribute for every field here but a DateField/DateTimeField with
auto_now or auto_now_add, which keeps its own. tests/jobs/ledger/test_values.py holds the
shortcut to Django's own answer, field by field, on the test's database.
"""

from __future__ import annotations

import functools
import operator
import uuid
from collections.abc import Callable
from datetime import datetime
from typing import Any

from django.db import models

# What a field's value becomes on the shortcut: itself, or one adapter call of the backend
SAME_STR, SAME_UUID, INTEGER, DATETIME, JSON, GENERIC, PRE_SAVE = range(7)

_INTEGER_FIELDS = (
    models.IntegerField,
    models.SmallIntegerField,
    models.BigIntegerField,
    models.PositiveIntegerField,
    models.PositiveSmallIntegerField,
    models.PositiveBigIntegerField,
)


def _kind(field: Any, native_uuid: bool) -> int:
    cls = type(field)
    if cls in (models.CharField, models.TextField):
        return SAME_STR
    if cls is models.UUIDField and native_uuid:
        return SAME_UUID
    if cls in _INTEGER_FIELDS:
        return INTEGER
    if cls is models.DateTimeField and not (field.auto_now or field.auto_now_add):
        return DATETIME
    if cls is models.JSONField:
        return JSON
    return GENERIC


def _reads_attribute(field: Any) -> bool:
    """Whether the field's pre_save() at an insert is reading its attribute."""
    if isinstance(field, models.DateField):
        return not (field.auto_now or field.auto_now_add)
    return type(field).pre_save is models.Field.pre_save


@functools.lru_cache(maxsize=16)
def _plan(
    model: Any, native_uuid: bool
) -> tuple[tuple[tuple[Any, int, Any], ...], Callable[[Any], tuple[Any, ...]]]:
    """Per column: its field, its kind, and what its adapter takes besides the value."""
    fields = tuple(f for f in model._meta.concrete_fields if not f.generated)
    plan = []
    for field in fields:
        kind = _kind(field, native_uuid) if _reads_attribute(field) else PRE_SAVE
        extra = field.get_internal_type() if kind == INTEGER else getattr(field, "encoder", None)
        plan.append((field, kind, extra))
    return tuple(plan), operator.attrgetter(*(f.attname for f in fields))


def insert_values(instance: Any, db: Any) -> tuple[tuple[str, ...], list[Any]]:
    """The columns a new row of `instance` sets (their names: a statement cached by them is
    found without hashing a field object, a Python call each) and their values prepared for
    connection `db` (a DatabaseWrapper itself, not django.db.connection: each of the proxy's
    attributes is looked up through asgiref's Local). A nullable column whose value is None is
    left out (it defaults to NULL), as it costs a value prepared and bound for nothing."""
    plan, read = _plan(instance.__class__, db.features.has_native_uuid_field)
    ops = db.ops
    columns: list[str] = []
    values: list[Any] = []
    for (field, kind, extra), attribute in zip(plan, read(instance), strict=True):
        value = field.pre_save(instance, True) if kind == PRE_SAVE else attribute
        if value is None:
            if field.null:
                continue
            prepared = field.get_db_prep_save(value, db)
        elif kind == SAME_STR and isinstance(value, str) and not hasattr(value, "as_sql"):
            prepared = value
        elif kind == INTEGER and type(value) is int:
            prepared = ops.adapt_integerfield_value(value, extra)
        elif kind == DATETIME and type(value) is datetime and value.tzinfo is not None:
            prepared = ops.adapt_datetimefield_value(value)
        elif kind == JSON and type(value) in (dict, list):
            prepared = ops.adapt_json_value(value, extra)
        elif kind == SAME_UUID and type(value) is uuid.UUID:
            prepared = value
        else:
            prepared = field.get_db_prep_save(value, db)
        columns.append(field.column)
        values.append(prepared)
    return tuple(columns), values
