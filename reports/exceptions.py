"""Errors the reports app raises on purpose; all derive from jobs.BacklotError."""

from __future__ import annotations

from typing import Any

from django.core.exceptions import PermissionDenied

from jobs import BacklotError


class ReportError(BacklotError):
    """Base class of the reports app's errors."""


class ReportInputError(ReportError, ValueError):
    """A report request that does not validate; `errors` holds one entry per bad field.

    Each entry is {"loc": [...], "msg": str, "type": str}, the shape django-ninja uses.
    """

    def __init__(self, errors: list[dict[str, Any]]) -> None:
        super().__init__("; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in errors))
        self.errors = errors


class ReportNotReady(ReportError):
    """The report has no PDF yet (or rendering failed)."""


class ReportPermissionDenied(ReportError, PermissionDenied):
    """The requester lacks the permission a request needs; `permission` names it
    ("app_label.codename") and the message says what it is needed for.

    A Django PermissionDenied, so a view that lets it through answers 403.
    """

    def __init__(self, message: str, *, permission: str) -> None:
        super().__init__(message)
        self.permission = permission
