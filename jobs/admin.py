"""Admin for the job ledger (read-only history) and dead letters (replay, discard)."""

from __future__ import annotations

import json
from typing import Any

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest
from django.utils.html import format_html
from django.utils.translation import ngettext

from . import services
from .exceptions import BacklotError
from .models import DeadLetter, DeadLetterStatus, Job


class ReadOnlyAdmin(admin.ModelAdmin):
    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


def _pretty(value: Any) -> str:
    return format_html("<pre>{}</pre>", json.dumps(value, indent=2, sort_keys=True))


@admin.register(Job)
class JobAdmin(ReadOnlyAdmin):
    list_display = ("id", "task_name", "state", "queue", "priority", "attempts", "enqueued_at", "finished_at")
    list_filter = ("state", "queue", "task_name")
    search_fields = ("=id", "idempotency_key")
    date_hierarchy = "enqueued_at"
    readonly_fields = [f.name for f in Job._meta.fields]
    show_full_result_count = False


@admin.register(DeadLetter)
class DeadLetterAdmin(ReadOnlyAdmin):
    list_display = ("task_name", "exception_class", "queue", "attempts", "last_failed_at", "status")
    list_filter = ("status", "task_name", "queue", "exception_class")
    search_fields = ("=job_id_value", "exception_message")
    actions = ("replay_selected", "discard_selected")
    show_full_result_count = False
    exclude = ("args", "kwargs", "traceback")
    readonly_fields = (
        "job", "job_id_value", "task_name", "queue", "priority", "owner", "attempts",
        "exception_class", "exception_message", "traceback_block", "arguments_block",
        "first_failed_at", "last_failed_at", "status", "replayed_job", "resolved_at", "resolved_by",
    )

    @admin.display(description="traceback")
    def traceback_block(self, obj: DeadLetter) -> str:
        return format_html("<pre>{}</pre>", obj.traceback)

    @admin.display(description="arguments")
    def arguments_block(self, obj: DeadLetter) -> str:
        return _pretty({"args": obj.args, "kwargs": obj.kwargs})

    @admin.action(description="Replay selected dead letters")
    def replay_selected(self, request: HttpRequest, queryset: QuerySet[DeadLetter]) -> None:
        replayed, failed = 0, []
        for dead_letter in queryset.filter(status=DeadLetterStatus.DEAD):
            try:
                services.dead_letter_replay(dead_letter=dead_letter, by=request.user)
                replayed += 1
            except BacklotError as exc:
                failed.append(str(exc))
        self.message_user(
            request,
            ngettext("%d dead letter replayed.", "%d dead letters replayed.", replayed) % replayed,
            messages.SUCCESS,
        )
        for message in failed[:5]:
            self.message_user(request, message, messages.ERROR)

    @admin.action(description="Discard selected dead letters")
    def discard_selected(self, request: HttpRequest, queryset: QuerySet[DeadLetter]) -> None:
        count = sum(services.dead_letter_discard(dead_letter=d, by=request.user) for d in queryset)
        self.message_user(
            request,
            ngettext("%d dead letter discarded.", "%d dead letters discarded.", count) % count,
            messages.SUCCESS,
        )
