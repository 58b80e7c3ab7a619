"""Reports and the demo shop data the sales report reads."""

from .report import (
    FINAL_STATUSES,
    Report,
    ReportKind,
    ReportOrigin,
    ReportQuerySet,
    ReportStatus,
)
from .sales import Order, OrderLine, OrderQuerySet, OrderStatus, Product, SalesChannel, SalesRegion

__all__ = [
    "FINAL_STATUSES",
    "Order",
    "OrderLine",
    "OrderQuerySet",
    "OrderStatus",
    "Product",
    "Report",
    "ReportKind",
    "ReportOrigin",
    "ReportQuerySet",
    "ReportStatus",
    "SalesChannel",
    "SalesRegion",
]
