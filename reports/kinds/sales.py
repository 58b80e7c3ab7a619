"""The sales summary over the demo shop: revenue, orders, products, regions and channels."""

from __future__ import annotations

from collections.abc import Callable
from decimal import Decimal
from typing import Any

from django.db.models import Count, DecimalField, ExpressionWrapper, F, Q, QuerySet, Sum
from django.db.models.functions import Coalesce
from django.utils import timezone

from ..charts import OK_COLOUR, bucket_expression, bucket_label, bucket_size, buckets, stacked_bars
from ..models import OrderLine, OrderStatus, SalesChannel, SalesRegion
from ..schemas import PeriodParams, SalesParams

SECTIONS = ("summary", "trend", "categories", "products", "regions and channels")
TOP_PRODUCTS = 10
ZERO = Decimal("0.00")

_AMOUNT = ExpressionWrapper(
    F("quantity") * F("unit_price"), output_field=DecimalField(max_digits=14, decimal_places=2)
)
_PAID = Q(order__status=OrderStatus.PAID)
_REFUNDED = Q(order__status=OrderStatus.REFUNDED)
_MONEY: DecimalField[Decimal, Decimal] = DecimalField(max_digits=14, decimal_places=2)


def lines_in(params: PeriodParams) -> QuerySet[OrderLine]:
    start, end = params.bounds()
    return OrderLine.objects.filter(
        order__placed_at__gte=start, order__placed_at__lt=end
    ).order_by()


def _totals(lines: QuerySet[OrderLine]) -> dict[str, Any]:
    found = lines.aggregate(
        revenue=Coalesce(Sum(_AMOUNT, filter=_PAID), ZERO, output_field=_MONEY),
        refunds=Coalesce(Sum(_AMOUNT, filter=_REFUNDED), ZERO, output_field=_MONEY),
        units=Coalesce(Sum("quantity", filter=_PAID), 0),
        orders=Count("order", filter=_PAID, distinct=True),
        refunded_orders=Count("order", filter=_REFUNDED, distinct=True),
    )
    found["average_order"] = found["revenue"] / found["orders"] if found["orders"] else None
    return found


def _change(now: Decimal | int | None, before: Decimal | int | None) -> float | None:
    """Relative change from the previous period (0.12 = +12 %); None when it had nothing."""
    if now is None or not before:
        return None
    return float(now) / float(before) - 1.0


def sales_data(params: SalesParams, on_section: Callable[[str], None]) -> dict[str, Any]:
    """The figures of the sales summary; calls on_section(name) after each section."""
    lines = lines_in(params)
    summary = _totals(lines)
    previous = _totals(lines_in(params.previous()))
    changes = {
        key: _change(summary[key], previous[key])
        for key in ("revenue", "orders", "units", "average_order")
    }
    on_section("summary")

    size = bucket_size(params.days)
    per_bucket = {
        row["bucket"]: row
        for row in lines.filter(_PAID)
        .annotate(bucket=bucket_expression("order__placed_at", size, params.zone))
        .values("bucket")
        .annotate(revenue=Sum(_AMOUNT))
    }
    trend = stacked_bars(
        [
            (bucket_label(day, size), {"revenue": per_bucket.get(day, {}).get("revenue") or 0})
            for day in buckets(params.start, params.end, size, params.zone)
        ],
        series=[("revenue", OK_COLOUR, "Revenue (USD)")],
        value_format="${:,.0f}",
    )
    on_section("trend")

    revenue = summary["revenue"] or ZERO
    categories = list(
        lines.filter(_PAID)
        .values("product__category")
        .annotate(revenue=Sum(_AMOUNT), units=Sum("quantity"), orders=Count("order", distinct=True))
        .order_by("-revenue", "product__category")
    )
    for row in categories:
        row["share"] = float(row["revenue"] / revenue) if revenue else 0.0
    on_section("categories")

    products = list(
        lines.filter(_PAID)
        .values("product__sku", "product__name", "product__category")
        .annotate(revenue=Sum(_AMOUNT), units=Sum("quantity"))
        .order_by("-revenue", "product__sku")[:TOP_PRODUCTS]
    )
    for row in products:
        row["share"] = float(row["revenue"] / revenue) if revenue else 0.0
    on_section("products")

    region_names, channel_names = dict(SalesRegion.choices), dict(SalesChannel.choices)
    regions = [
        {**row, "name": region_names.get(row["order__region"], row["order__region"])}
        for row in lines.filter(_PAID)
        .values("order__region")
        .annotate(revenue=Sum(_AMOUNT), orders=Count("order", distinct=True))
        .order_by("-revenue")
    ]
    channels = [
        {**row, "name": channel_names.get(row["order__channel"], row["order__channel"])}
        for row in lines.filter(_PAID)
        .values("order__channel")
        .annotate(revenue=Sum(_AMOUNT), orders=Count("order", distinct=True))
        .order_by("-revenue")
    ]
    for row in [*regions, *channels]:
        row["share"] = float(row["revenue"] / revenue) if revenue else 0.0
    on_section("regions and channels")

    return {
        "summary": summary,
        "previous": previous,
        "previous_period": params.previous(),
        "changes": changes,
        "trend": trend,
        "trend_size": size,
        "categories": categories,
        "products": products,
        "regions": regions,
        "channels": channels,
        "generated_at": timezone.now(),
    }
