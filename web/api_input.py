"""The one JSON parser of the whole API (config.api): bodies, forms and query strings it lets in.

Every JSON body the API reads goes through `ApiParser.parse_body` (ninja's body parameters) or
`json_body` (views that validate a body themselves, e.g. reports.api), so the same limits hold
everywhere:

- a body over its route's limit is refused unread: JSON 413 naming the limit (`API_MAX_BODY_BYTES`,
  or a route's own `body_limit(...)`);
- nesting deeper than `MAX_JSON_DEPTH` and the decoder's RecursionError are a 400, as is
  `NaN`/`Infinity` (not JSON, and PostgreSQL's jsonb refuses them);
- a string holding a NUL, another control character (tab and line breaks excepted) or a lone
  surrogate is refused with a 400 naming the field (`loc`), in bodies, form fields and query
  strings alike: such characters cannot be stored (PostgreSQL refuses NUL) or smuggle headers and
  log lines.

A refusal is raised as `InputRefused`; config.api answers it with ninja's field-error shape
{"detail": [{"loc", "msg", "type"}]}.
"""

from __future__ import annotations

import json
import unicodedata
from collections.abc import Callable, Iterator
from functools import wraps
from typing import Any, cast

from django.conf import settings
from django.core.exceptions import RequestDataTooBig
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.utils.datastructures import MultiValueDict
from ninja.parser import Parser

# Deeper than any body the API documents (a report's params are 2 levels, a campaign's
# recipients 3); well below the decoder's recursion limit (~1,000 frames).
MAX_JSON_DEPTH = 32
# A JSON body's default limit: the largest documented body (a campaign with 10,000 recipients)
# is a few MB; routes that take uploads have their own (web.uploads).
DEFAULT_MAX_BODY_BYTES = 1024 * 1024
# Characters kept in free text: tab, line feed, carriage return.
_ALLOWED_CONTROLS = frozenset("\t\n\r")
_LIMIT_ATTRIBUTE = "backlot_body_limit"


class InputRefused(Exception):
    """A request's input the API will not read: `status` (400 or 413) and ninja's error list."""

    def __init__(self, status: int, errors: list[dict[str, Any]]) -> None:
        super().__init__(errors[0]["msg"])
        self.status = status
        self.errors = errors


def body_limit_of(request: HttpRequest) -> int:
    """The body limit of the request's route: its own `body_limit`, else API_MAX_BODY_BYTES."""
    own = getattr(request, _LIMIT_ATTRIBUTE, None)
    if own is not None:
        return int(own)
    return int(getattr(settings, "API_MAX_BODY_BYTES", DEFAULT_MAX_BODY_BYTES))


def body_limit(limit: int) -> Callable[[Callable[..., HttpResponse]], Callable[..., HttpResponse]]:
    """For an API view (ninja's decorate_view): this route's JSON bodies may be `limit` bytes."""

    def decorate(run: Callable[..., HttpResponse]) -> Callable[..., HttpResponse]:
        @wraps(run)
        def limited(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
            setattr(request, _LIMIT_ATTRIBUTE, limit)
            return run(request, *args, **kwargs)

        return limited

    return decorate


def too_large(limit: int, size: int | None) -> InputRefused:
    said = f"The body is {size} bytes; " if size else "The body is too large; "
    return InputRefused(
        413,
        [
            {
                "loc": ["body"],
                "msg": f"{said}this route takes at most {limit} bytes.",
                "type": "body_too_large",
                "ctx": {"limit": limit},
            }
        ],
    )


def _declared_length(request: HttpRequest) -> int | None:
    try:
        return int(request.META.get("CONTENT_LENGTH") or 0) or None
    except (TypeError, ValueError):
        return None


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _invalid(msg: str, kind: str) -> InputRefused:
    return InputRefused(400, [{"loc": ["body"], "msg": msg, "type": kind}])


def json_body(request: HttpRequest) -> Any:
    """The request's JSON body (None when empty), checked as the module docstring says.

    Parsed once per request: a second call returns the same value.
    """
    cached = getattr(request, "_backlot_json", _MISSING)
    if cached is not _MISSING:
        return cached
    limit = body_limit_of(request)
    declared = _declared_length(request)
    if declared is not None and declared > limit:
        raise too_large(limit, declared)
    try:
        raw = request.body
    except RequestDataTooBig:
        raise too_large(limit, declared) from None
    if len(raw) > limit:
        raise too_large(limit, len(raw))
    if not raw:
        data = None
    else:
        try:
            data = json.loads(raw, parse_constant=_refuse_constant)
        except RecursionError:
            raise _invalid(
                f"The body is nested too deeply (at most {MAX_JSON_DEPTH} levels).", "json_depth"
            ) from None
        except ValueError as exc:  # JSONDecodeError, bad UTF-8, NaN, an over-long integer
            raise _invalid(f"The body is not valid JSON: {exc}", "json_invalid") from None
        _check_depth(data)
        _check_text(data, ["body"])
    request._backlot_json = data  # type: ignore[attr-defined]  # a per-request cache
    return data


_MISSING = object()


def _check_depth(data: Any) -> None:
    """Refuse nesting past MAX_JSON_DEPTH (iteratively: no recursion of our own)."""
    stack: list[tuple[Any, int]] = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict | list):
            if depth > MAX_JSON_DEPTH:
                raise _invalid(
                    f"The body is nested too deeply (at most {MAX_JSON_DEPTH} levels).",
                    "json_depth",
                )
            children = value.values() if isinstance(value, dict) else value
            stack.extend((child, depth + 1) for child in children)


def refused_character(text: str) -> str | None:
    """The first character of `text` that free text may not hold, described; None if none."""
    for index, char in enumerate(text):
        if char in _ALLOWED_CONTROLS:
            continue
        category = unicodedata.category(char)
        if category == "Cc" or category == "Cs":
            name = "NUL" if char == "\x00" else f"U+{ord(char):04X}"
            return f"{name} at position {index}"
    return None


def _strings(data: Any, loc: list[Any]) -> Iterator[tuple[list[Any], str]]:
    stack: list[tuple[Any, list[Any]]] = [(data, loc)]
    while stack:
        value, where = stack.pop()
        if isinstance(value, str):
            yield where, value
        elif isinstance(value, dict):
            for key, child in value.items():
                yield [*where, key], key  # a key is free text too
                stack.append((child, [*where, key]))
        elif isinstance(value, list):
            stack.extend((child, [*where, index]) for index, child in enumerate(value))


def _check_text(data: Any, loc: list[Any]) -> None:
    errors = []
    for where, text in _strings(data, loc):
        found = refused_character(text)
        if found:
            field = ".".join(str(part) for part in where[1:]) or where[0]
            errors.append(
                {
                    "loc": where,
                    "msg": f"{field} contains a control character ({found}); "
                    "it cannot be accepted.",
                    "type": "control_character",
                }
            )
    if errors:
        raise InputRefused(400, sorted(errors, key=lambda error: str(error["loc"])))


class ApiParser(Parser):
    """ninja's parser for the whole API: json_body for bodies, the same text rules for forms
    and query strings (uploaded files are content, not text: not checked here)."""

    def parse_body(self, request: HttpRequest) -> dict[str, Any]:
        return cast(dict[str, Any], json_body(request))

    def parse_querydict(
        self, data: MultiValueDict[str, Any], list_fields: list[str], request: HttpRequest
    ) -> dict[str, Any]:
        if data is not request.FILES:
            where = "query" if data is request.GET else "form"
            values = {key: data.getlist(key) for key in data}
            _check_text({k: v[0] if len(v) == 1 else v for k, v in values.items()}, [where])
        return super().parse_querydict(data, list_fields, request)


def refusal_response(exc: InputRefused) -> JsonResponse:
    return JsonResponse({"detail": exc.errors}, status=exc.status)
