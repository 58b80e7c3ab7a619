"""Percentiles (p50, p95) of a numeric column per group: in PostgreSQL, or streamed in Python.

PostgreSQL computes them with the ordered-set aggregate percentile_cont, next to the data.
SQLite (the `make run` default) has no such aggregate, so there the values are streamed in
sorted order and interpolated the same way; both give identical answers.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from itertools import groupby
from typing import Any

from django.db import connections
from django.db.models import Aggregate, FloatField, QuerySet

Key = tuple[Any, ...]


class PercentileCont(Aggregate):
    """PostgreSQL's percentile_cont(fraction) WITHIN GROUP (ORDER BY expression)."""

    function = "PERCENTILE_CONT"
    name = "PercentileCont"
    template = "%(function)s(%(fraction)s) WITHIN GROUP (ORDER BY %(expressions)s)"
    output_field = FloatField()

    def __init__(self, expression: Any, fraction: float, **extra: Any) -> None:
        fraction = float(fraction)
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"fraction must be within [0, 1], got {fraction!r}")
        super().__init__(expression, fraction=repr(fraction), **extra)


def percentile(sorted_values: Sequence[float], fraction: float) -> float | None:
    """The `fraction` percentile of ascending values, interpolated like percentile_cont."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"fraction must be within [0, 1], got {fraction!r}")
    count = len(sorted_values)
    if count == 0:
        return None
    position = fraction * (count - 1)
    lower = math.floor(position)
    upper = min(lower + 1, count - 1)
    low, high = float(sorted_values[lower]), float(sorted_values[upper])
    return low + (high - low) * (position - lower)


def grouped_percentiles(
    queryset: QuerySet[Any],
    *,
    field: str,
    fractions: Sequence[float],
    group: Sequence[str] = (),
    in_database: bool | None = None,
) -> dict[Key, tuple[float | None, ...]]:
    """{group key: (percentile per fraction)} over the rows of `queryset` where `field` is set.

    in_database=None uses PostgreSQL's aggregate when the queryset's database is PostgreSQL.
    """
    rows = queryset.order_by().filter(**{f"{field}__isnull": False})
    if in_database is None:
        in_database = connections[rows.db].vendor == "postgresql"
    if in_database:
        aggregates = {f"p{i}": PercentileCont(field, f) for i, f in enumerate(fractions)}
        if not group:
            found = rows.aggregate(**aggregates)
            return {(): tuple(found[f"p{i}"] for i in range(len(fractions)))}
        return {
            tuple(row[g] for g in group): tuple(row[f"p{i}"] for i in range(len(fractions)))
            for row in rows.values(*group).annotate(**aggregates)
        }
    return _streamed(rows, field=field, fractions=fractions, group=group)


def _streamed(
    rows: QuerySet[Any], *, field: str, fractions: Sequence[float], group: Sequence[str]
) -> dict[Key, tuple[float | None, ...]]:
    # Sorted by group then value: one group's values are in memory at a time.
    stream: Iterable[tuple[Any, ...]] = (
        rows.order_by(*group, field).values_list(*group, field).iterator(chunk_size=5000)
    )
    found: dict[Key, tuple[float | None, ...]] = {}
    width = len(group)
    for key, items in groupby(stream, key=lambda row: tuple(row[:width])):
        values = [row[width] for row in items]
        found[key] = tuple(percentile(values, f) for f in fractions)
    if not group and () not in found:
        found[()] = tuple(None for _ in fractions)
    return found
