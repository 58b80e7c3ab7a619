"""Admin for videos and their renditions: read-only history."""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.http import HttpRequest
from django.urls import reverse
from django.utils.html import format_html

from .models import Rendition, Video


class ReadOnlyMixin:
    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


class RenditionInline(ReadOnlyMixin, admin.TabularInline):
    model = Rendition
    extra = 0
    can_delete = False
    fields = (
        "format",
        "status",
        "progress",
        "resolution",
        "size_bytes",
        "duration",
        "job_link",
        "error",
    )
    readonly_fields = fields
    show_change_link = True

    @admin.display(description="job")
    def job_link(self, obj: Rendition) -> str:
        return _job_link(obj.job_id)


def _job_link(job_id: Any) -> str:
    if not job_id:
        return "-"
    return format_html(
        '<a href="{}">{}</a>', reverse("admin:jobs_job_change", args=[job_id]), job_id
    )


@admin.register(Video)
class VideoAdmin(ReadOnlyMixin, admin.ModelAdmin):
    list_display = (
        "id",
        "original_name",
        "owner",
        "status",
        "duration",
        "resolution",
        "created_at",
        "finished_at",
    )
    list_filter = ("status",)
    search_fields = ("=id", "original_name", "owner__username")
    date_hierarchy = "created_at"
    list_select_related = ("owner",)
    show_full_result_count = False
    fields = (
        "id",
        "owner",
        "original_name",
        "source_file",
        "source_size",
        "status",
        "container",
        "duration",
        "width",
        "height",
        "error_block",
        "job_link",
        "created_at",
        "probed_at",
        "finished_at",
    )
    readonly_fields = fields
    inlines = (RenditionInline,)

    @admin.display(description="source file")
    def source_file(self, obj: Video) -> str:
        return obj.source.name  # a path under MEDIA_ROOT, not a public link

    @admin.display(description="error")
    def error_block(self, obj: Video) -> str:
        return format_html("<pre>{}</pre>", obj.error) if obj.error else "-"

    @admin.display(description="job")
    def job_link(self, obj: Video) -> str:
        return _job_link(obj.job_id)


@admin.register(Rendition)
class RenditionAdmin(ReadOnlyMixin, admin.ModelAdmin):
    list_display = (
        "video",
        "format",
        "status",
        "progress",
        "resolution",
        "size_bytes",
        "started_at",
        "finished_at",
    )
    list_filter = ("status", "format")
    search_fields = ("=video__id", "=job_id")
    list_select_related = ("video",)
    show_full_result_count = False
    fields = (
        "video",
        "format",
        "status",
        "progress",
        "width",
        "height",
        "duration",
        "size_bytes",
        "path",
        "poster_path",
        "job_link",
        "error_block",
        "started_at",
        "finished_at",
    )
    readonly_fields = fields

    @admin.display(description="error")
    def error_block(self, obj: Rendition) -> str:
        return format_html("<pre>{}</pre>", obj.error) if obj.error else "-"

    @admin.display(description="job")
    def job_link(self, obj: Rendition) -> str:
        return _job_link(obj.job_id)
