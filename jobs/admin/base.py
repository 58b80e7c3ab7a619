"""The admin's shared pieces: read-only history, estimated counts, pretty arguments."""

from __future__ import annotations

import json
from typing import Any, cast

from django.contrib import admin
from django.core.paginator import Paginator
from django.db import connection
from django.db.models import QuerySet
from django.http import HttpRequest
from django.urls import reverse
from django.utils.functional import cached_property
from django.utils.html import format_html

from jobs.models import Job

# Beyond this many rows the changelist shows an estimate instead of COUNT(*): counting a
# million rows on every page load costs ~100 ms on PostgreSQL; an EXPLAIN estimate ~1 ms.
EXACT_COUNT_LIMIT = 10_000


class EstimatedCountPaginator(Paginator):
    @cached_property
    def count(self) -> int:
        object_list = cast("QuerySet[Any]", self.object_list)  # the admin changelist's queryset
        limited = object_list[: EXACT_COUNT_LIMIT + 1].count()
        if limited <= EXACT_COUNT_LIMIT or connection.vendor != "postgresql":
            return limited
        sql, params = object_list.query.sql_with_params()
        with connection.cursor() as cursor:
            cursor.execute(f"EXPLAIN (FORMAT JSON) {sql}", params)
            plan = cursor.fetchone()[0]
        plan = json.loads(plan) if isinstance(plan, str) else plan
        return max(limited, int(plan[0]["Plan"]["Plan Rows"]))


class ReadOnlyAdmin(admin.ModelAdmin):
    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False  # history leaves by retention (manage.py jobs purge), dead letters by discard


def pretty_json(value: Any) -> str:
    return format_html("<pre>{}</pre>", json.dumps(value, indent=2, sort_keys=True))


def job_link(job: Job | None) -> str:
    if job is None:
        return "—"
    url = reverse("admin:jobs_job_change", args=[job.pk])
    return format_html('<a href="{}">{}</a> ({})', url, job.pk, job.state)
