"""Admin for batches: the list, a batch's counters and members, and two actions — replay its
dead members (permission replay_deadletter) and cancel its members that have not ended
(permission cancel_job); both audited."""

from __future__ import annotations

from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.core.paginator import Paginator
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse
from django.urls import reverse
from django.utils.html import format_html, format_html_join
from django.utils.translation import ngettext

from jobs.admin.base import ReadOnlyAdmin, pretty_json
from jobs.flow.batches import batch_cancel, batch_replay_dead
from jobs.flow.deadletters import audit
from jobs.models import Batch, Job

# Members shown per page of a batch's detail (one query through job_batch_idx).
MEMBERS_PER_PAGE = 100
_PERMISSIONED = {"replay_dead_members": "replay", "cancel_pending_members": "cancel"}


@admin.register(Batch)
class BatchAdmin(ReadOnlyAdmin):
    list_display = (
        "id",
        "description",
        "state",
        "total",
        "pending",
        "succeeded",
        "dead",
        "cancelled",
        "created_at",
        "completed_at",
    )
    list_filter = ("state",)
    search_fields = ("=id", "description")
    date_hierarchy = "created_at"
    actions = ("replay_dead_members", "cancel_pending_members")
    exclude = ("callbacks",)
    readonly_fields = [f.name for f in Batch._meta.fields if f.name != "callbacks"] + [
        "callback_jobs",
        "child_batches",
        "member_jobs",
    ]
    _members_page = 1

    # --- permissions --------------------------------------------------------------------
    def has_replay_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm("jobs.replay_deadletter")

    def has_cancel_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm("jobs.cancel_job")

    def changelist_view(
        self, request: HttpRequest, extra_context: dict | None = None
    ) -> HttpResponse:
        action = request.POST.get("action") if request.method == "POST" else None
        needed = _PERMISSIONED.get(action or "")
        if needed and not getattr(self, f"has_{needed}_permission")(request):
            raise PermissionDenied(f"You may not {needed} the members of batches.")
        return super().changelist_view(request, extra_context)

    def change_view(
        self,
        request: HttpRequest,
        object_id: str,
        form_url: str = "",
        extra_context: dict | None = None,
    ) -> HttpResponse:
        try:
            self._members_page = max(1, int(request.GET.get("members_page", "1")))
        except ValueError:
            self._members_page = 1
        return super().change_view(request, object_id, form_url, extra_context)

    # --- the detail -----------------------------------------------------------------------
    @admin.display(description="callbacks")
    def callback_jobs(self, obj: Batch) -> str:
        specs = (obj.callbacks or {}).items()
        return pretty_json({kind: f"{spec['task']}(<batch id>, ...)" for kind, spec in specs})

    @admin.display(description="child batches")
    def child_batches(self, obj: Batch) -> str:
        children = list(Batch.objects.filter(parent=obj).order_by("created_at")[:100])
        if not children:
            return "—"
        return format_html_join(
            ", ",
            '<a href="{}">{}</a> ({})',
            (
                (reverse("admin:jobs_batch_change", args=[c.pk]), c.description or c.pk, c.state)
                for c in children
            ),
        )

    @admin.display(description="members")
    def member_jobs(self, obj: Batch) -> str:
        paginator = Paginator(
            Job.objects.filter(batch=obj)
            .order_by("enqueued_at", "id")
            .only("id", "task_name", "state", "attempts", "finished_at"),
            MEMBERS_PER_PAGE,
        )
        page = paginator.get_page(self._members_page)
        rows = format_html_join(
            "",
            '<tr><td><a href="{}">{}</a></td><td>{}</td><td>{}</td><td>{}</td></tr>',
            (
                (
                    reverse("admin:jobs_job_change", args=[job.pk]),
                    job.pk,
                    job.task_name,
                    job.state,
                    job.attempts,
                )
                for job in page
            ),
        )
        pages = format_html(
            "page {} of {} ({} jobs){}{}",
            page.number,
            paginator.num_pages,
            paginator.count,
            format_html(' <a href="?members_page={}">previous</a>', page.number - 1)
            if page.has_previous()
            else "",
            format_html(' <a href="?members_page={}">next</a>', page.number + 1)
            if page.has_next()
            else "",
        )
        return format_html(
            '<table id="batch-members"><thead><tr><th>job</th><th>task</th><th>state</th>'
            "<th>attempts</th></tr></thead><tbody>{}</tbody></table><p>{}</p>",
            rows,
            pages,
        )

    # --- actions ------------------------------------------------------------------------
    @admin.action(description="Replay the dead members of selected batches", permissions=["replay"])
    def replay_dead_members(self, request: HttpRequest, queryset: QuerySet[Batch]) -> None:
        replayed = 0
        for batch in queryset:
            outcome = batch_replay_dead(batch=batch, by=request.user)
            replayed += outcome.done
            for message in (outcome.errors or [])[:5]:
                self.message_user(request, message, messages.ERROR)
        ids = [str(pk) for pk in queryset.values_list("pk", flat=True)[:1000]]
        audit(user=request.user, action="batch-replay-dead", count=replayed, batch_ids=ids)
        self.message_user(
            request,
            ngettext("%d dead member replayed.", "%d dead members replayed.", replayed) % replayed,
            messages.SUCCESS,
        )

    @admin.action(
        description="Cancel the members of selected batches that have not ended",
        permissions=["cancel"],
    )
    def cancel_pending_members(self, request: HttpRequest, queryset: QuerySet[Batch]) -> None:
        cancelled = 0
        for batch in queryset:
            done, _ = batch_cancel(batch=batch, by=request.user)
            cancelled += done
        ids = [str(pk) for pk in queryset.values_list("pk", flat=True)[:1000]]
        audit(user=request.user, action="batch-cancel", count=cancelled, batch_ids=ids)
        self.message_user(
            request,
            ngettext(
                "%d member cancelled or asked to stop.",
                "%d members cancelled or asked to stop.",
                cancelled,
            )
            % cancelled,
            messages.SUCCESS,
        )
