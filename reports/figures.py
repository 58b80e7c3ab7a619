"""A report's figures (the template context its kind computes) as JSON and back.

The scheduled report keeps its figures as a durable step's result, so that a render retried
after a failed layout does not run the queries again. The context holds what JSON has no type
for (datetimes, dates, Decimals, the charts' dataclasses, period parameters); each is written as
a one-key object naming its type and read back as that type, so the template sees the same
values on a later run as on the run that computed them. Only the types below are read back:
stored JSON never names a class to import.
"""

from __future__ import annotations

import dataclasses
from datetime import date, datetime
from decimal import Decimal
from typing import Any

from . import charts
from .schemas import PARAMS_BY_KIND, PeriodParams

_DATACLASSES: dict[str, type] = {
    cls.__name__: cls for cls in (charts.Chart, charts.Bar, charts.Segment, charts.Gridline)
}
_PARAMS: dict[str, type[PeriodParams]] = {cls.__name__: cls for cls in PARAMS_BY_KIND.values()}


def figures_dump(value: Any) -> Any:
    """`value` as plain JSON; raises TypeError naming a value of any other type."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, datetime):
        return {"$datetime": value.isoformat()}
    if isinstance(value, date):
        return {"$date": value.isoformat()}
    if isinstance(value, Decimal):
        return {"$decimal": str(value)}
    if isinstance(value, PeriodParams) and type(value).__name__ in _PARAMS:
        return {"$period": [type(value).__name__, value.model_dump(mode="json")]}
    if dataclasses.is_dataclass(value) and type(value).__name__ in _DATACLASSES:
        fields = {f.name: figures_dump(getattr(value, f.name)) for f in dataclasses.fields(value)}
        return {"$chart": [type(value).__name__, fields]}
    if isinstance(value, list | tuple):
        return [figures_dump(item) for item in value]
    if isinstance(value, dict):
        if not all(isinstance(key, str) and not key.startswith("$") for key in value):
            raise TypeError(f"figures keep dicts with plain text keys, not {list(value)[:5]!r}")
        return {key: figures_dump(item) for key, item in value.items()}
    raise TypeError(f"figures cannot keep a {type(value).__name__}: {value!r:.80}")


def figures_load(value: Any) -> Any:
    """What figures_dump wrote, with its types back."""
    if isinstance(value, list):
        return [figures_load(item) for item in value]
    if not isinstance(value, dict):
        return value
    if len(value) == 1:
        [(key, data)] = value.items()
        if key == "$datetime":
            return datetime.fromisoformat(data)
        if key == "$date":
            return date.fromisoformat(data)
        if key == "$decimal":
            return Decimal(data)
        if key == "$period":
            name, fields = data
            return _PARAMS[name].model_construct(  # as PeriodParams.previous() makes it
                timezone=fields["timezone"],
                start=date.fromisoformat(fields["start"]),
                end=date.fromisoformat(fields["end"]),
            )
        if key == "$chart":
            name, fields = data
            return _DATACLASSES[name](**{k: figures_load(v) for k, v in fields.items()})
    return {key: figures_load(item) for key, item in value.items()}
