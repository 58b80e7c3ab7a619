"""Admin: report history (read-only) and the demo shop's products and orders."""

from __future__ import annotations

import json
from decimal import Decimal
from typing import TYPE_CHECKING, Any, TypedDict

from django.contrib import admin
from django.db.models import DecimalField, ExpressionWrapper, F, QuerySet, Sum
from django.http import HttpRequest
from django.urls import reverse
from django.utils.html import format_html

from jobs import mask_value

from .models import Order, OrderLine, Product, Report

if TYPE_CHECKING:
    from django_stubs_ext import WithAnnotations


class _OrderTotal(TypedDict):
    order_total: Decimal | None


@admin.register(Report)
class ReportAdmin(admin.ModelAdmin):
    list_display = (
        "id",
        "kind",
        "period",
        "status",
        "origin",
        "owner",
        "created_at",
        "render_seconds",
        "pages",
    )
    list_filter = ("status", "kind", "origin", "created_at")
    search_fields = ("=id", "owner__username")
    date_hierarchy = "created_at"
    list_select_related = ("owner",)
    show_full_result_count = False
    fields = (
        "kind",
        "params_block",
        "status",
        "origin",
        "owner",
        "recipients",
        "download",
        "pages",
        "size_bytes",
        "job_link",
        "trigger_job_id",
        "error_block",
        "created_at",
        "started_at",
        "finished_at",
        "render_seconds",
        "emailed_at",
        "uid",
    )
    readonly_fields = fields

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    @admin.display(description="period")
    def period(self, obj: Report) -> str:
        return obj.period_label

    @admin.display(description="parameters")
    def params_block(self, obj: Report) -> str:
        return format_html("<pre>{}</pre>", json.dumps(obj.params, indent=2, sort_keys=True))

    @admin.display(description="email to")
    def recipients(self, obj: Report) -> str:
        return ", ".join(mask_value(list(obj.email_to))) or "-"

    @admin.display(description="PDF")
    def download(self, obj: Report) -> str:
        # Through the API (permission-checked), never a public MEDIA_URL link.
        if not obj.download_url:
            return "-"
        return format_html('<a href="{}">{}</a>', obj.download_url, obj.download_filename())

    @admin.display(description="render job")
    def job_link(self, obj: Report) -> str:
        if not obj.job_id:
            return "-"
        return format_html(
            '<a href="{}">{}</a>', reverse("admin:jobs_job_change", args=[obj.job_id]), obj.job_id
        )

    @admin.display(description="error")
    def error_block(self, obj: Report) -> str:
        return format_html("<pre>{}</pre>", obj.error) if obj.error else "-"


@admin.register(Product)
class ProductAdmin(admin.ModelAdmin):
    list_display = ("sku", "name", "category", "unit_price", "active")
    list_filter = ("category", "active")
    search_fields = ("sku", "name")


class OrderLineInline(admin.TabularInline):
    model = OrderLine
    extra = 0
    autocomplete_fields = ("product",)


@admin.register(Order)
class OrderAdmin(admin.ModelAdmin):
    list_display = ("number", "placed_at", "region", "channel", "status", "total")
    list_filter = ("status", "region", "channel", "placed_at")
    search_fields = ("=number",)
    date_hierarchy = "placed_at"
    inlines = (OrderLineInline,)
    show_full_result_count = False

    def get_queryset(self, request: HttpRequest) -> QuerySet[Order]:
        amount = ExpressionWrapper(
            F("lines__quantity") * F("lines__unit_price"),
            output_field=DecimalField(max_digits=14, decimal_places=2),
        )
        return super().get_queryset(request).annotate(order_total=Sum(amount))

    @admin.display(description="total (USD)", ordering="order_total")
    def total(self, obj: WithAnnotations[Order, _OrderTotal]) -> Any:
        return obj.order_total
