"""Who may ask for what: the permission each report kind needs, and whom a report may be sent to.

Both kinds hold company-wide figures, so a user requests one only with its permission
(reports.request_sales_report, reports.request_operations_report), which operators and analysts
get through a group; staff may request every kind, since they already see every job and its
outcome (GET /api/jobs/, the admin dashboard). A requested report is emailed only to the
requester's own address unless they hold reports.email_report_elsewhere: otherwise the platform
would relay PDFs to anyone. Staff status does not lift that rule (superusers hold every
permission). The scheduler sends its reports to BACKLOT_REPORT_RECIPIENTS and asks no one
(services.report_schedule_make does not come here).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .exceptions import ReportPermissionDenied
from .kinds import kind_spec
from .models import ReportKind
from .schemas import ReportRequest

EMAIL_ELSEWHERE_PERMISSION = "reports.email_report_elsewhere"


def kind_allowed(user: Any, kind: str) -> bool:
    """May `user` request reports of `kind`? Staff may; anyone else needs the kind's permission."""
    if not getattr(user, "is_active", False):
        return False
    return bool(user.is_staff) or bool(user.has_perm(kind_spec(kind).permission))


def kinds_allowed(user: Any) -> list[ReportKind]:
    """The kinds `user` may request, in ReportKind's order."""
    return [kind for kind in ReportKind if kind_allowed(user, kind)]


def own_address(user: Any) -> str:
    """The requester's address as compared ("" when they have none: then every one is other)."""
    return str(getattr(user, "email", "") or "").strip().lower()


def other_addresses(user: Any, addresses: Iterable[str]) -> list[str]:
    """The addresses among `addresses` that are not `user`'s own (case-insensitive)."""
    own = own_address(user)
    return [address for address in addresses if not own or address.strip().lower() != own]


def email_allowed(user: Any, addresses: Iterable[str]) -> bool:
    """May `user` have a report emailed to `addresses`? Their own (or none) always; any other
    address needs reports.email_report_elsewhere."""
    if not other_addresses(user, addresses):
        return True
    return bool(getattr(user, "is_active", False)) and bool(
        user.has_perm(EMAIL_ELSEWHERE_PERMISSION)
    )


def report_request_authorize(*, request: ReportRequest, user: Any) -> None:
    """Refuse a request `user` may not make: ReportPermissionDenied names the permission."""
    spec = kind_spec(request.kind)
    if not kind_allowed(user, request.kind):
        raise ReportPermissionDenied(
            f"Requesting the {request.kind} report needs permission {spec.permission}",
            permission=spec.permission,
        )
    if not email_allowed(user, request.email_to):
        raise ReportPermissionDenied(
            "Emailing a report to an address other than your own needs permission "
            f"{EMAIL_ELSEWHERE_PERMISSION}",
            permission=EMAIL_ELSEWHERE_PERMISSION,
        )
