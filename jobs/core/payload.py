"""Checks that job arguments are plain JSON and small, naming the first offending value."""

from __future__ import annotations

import math
from typing import Any

from jobs.core import jsontext
from jobs.core.exceptions import InvalidPayload, PayloadTooLarge

_JSON_SCALARS = (str, int, float, bool, type(None))


def _find_non_json(value: Any, path: str) -> str | None:
    """What makes `value` unfit to store or send as JSON, named by its path from `path`.

    The path is written only for the value found: a walk that built each item's path as it
    went (an f-string per list item and dict entry) spent most of its time on paths of values
    that were fine (a fan-out checks every job's arguments)."""
    found = _problem(value)
    if found is None:
        return None
    steps, what = found
    return f"{path}{''.join(reversed(steps))} {what}"


def _problem(value: Any) -> tuple[list[str], str] | None:
    """The first unfit value in `value`: its path's steps, innermost first, and what it is."""
    if isinstance(value, _JSON_SCALARS):
        if isinstance(value, float) and not math.isfinite(value):
            return [], f"is {value!r}, which JSON cannot represent"
        if isinstance(value, str) and "\x00" in value:
            return [], "contains a NUL character, which the database cannot store"
        return None
    if isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            found = _problem(item)
            if found:
                found[0].append(f"[{index}]")
                return found
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                return [], f"has a non-string key {key!r} ({type(key).__name__})"
            if "\x00" in key:
                return [], "has a key with a NUL character, which the database cannot store"
            found = _problem(item)
            if found:
                found[0].append(f"[{key!r}]")
                return found
        return None
    return [], (
        f"is a {type(value).__module__}.{type(value).__qualname__}, which is not "
        "JSON-serializable; pass ids and plain values (str, int, float, bool, None, list, dict)"
    )


def payload_check(*, task_name: str, args: tuple | list, kwargs: dict, max_bytes: int) -> int:
    """Raise InvalidPayload unless args/kwargs are plain JSON under max_bytes; return the size."""
    found = _find_non_json(list(args), "args") or _find_non_json(kwargs, "kwargs")
    if found:
        raise InvalidPayload(f"Cannot enqueue {task_name}: {found}.")
    # ASCII (ensure_ascii): its length is its size in bytes
    size = len(jsontext.compact([list(args), kwargs]))
    if size > max_bytes:
        raise PayloadTooLarge(
            f"Cannot enqueue {task_name}: arguments are {size} bytes as JSON, over the "
            f"{max_bytes}-byte limit (BACKLOT['MAX_PAYLOAD_BYTES']); "
            "store the data and pass its id."
        )
    return size


def json_problem(value: Any, path: str) -> str | None:
    """What makes `value` unfit to store or send as JSON (None when it is fine)."""
    return _find_non_json(value, path)
