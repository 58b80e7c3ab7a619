"""The report kinds: for each, its parameters, the figures it computes and its template."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..exceptions import ReportError
from ..models import ReportKind
from ..schemas import PARAMS_BY_KIND, PeriodParams
from .operations import SECTIONS as OPERATIONS_SECTIONS
from .operations import operations_data
from .sales import SECTIONS as SALES_SECTIONS
from .sales import sales_data


@dataclass(frozen=True)
class KindSpec:
    kind: ReportKind
    title: str
    template: str
    params: type[PeriodParams]
    sections: tuple[str, ...]
    # "app_label.codename" a user needs to request this kind (staff need none; reports.access)
    permission: str
    # build(params, on_section) -> template context; on_section(name) after each section
    build: Callable[[Any, Callable[[str], None]], dict[str, Any]]


KINDS: dict[str, KindSpec] = {
    ReportKind.OPERATIONS: KindSpec(
        kind=ReportKind.OPERATIONS,
        title="Job operations report",
        template="reports/operations.html",
        params=PARAMS_BY_KIND[ReportKind.OPERATIONS],
        sections=OPERATIONS_SECTIONS,
        permission="reports.request_operations_report",
        build=operations_data,
    ),
    ReportKind.SALES: KindSpec(
        kind=ReportKind.SALES,
        title="Sales summary",
        template="reports/sales.html",
        params=PARAMS_BY_KIND[ReportKind.SALES],
        sections=SALES_SECTIONS,
        permission="reports.request_sales_report",
        build=sales_data,
    ),
}


def kind_spec(kind: str) -> KindSpec:
    try:
        return KINDS[kind]
    except KeyError:
        raise ReportError(f"Unknown report kind {kind!r}; known: {', '.join(KINDS)}") from None
