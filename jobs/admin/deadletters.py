"""Admin for dead letters (inspect, replay, discard; each with its own permission, each
audited) and the audit log."""

from __future__ import annotations

import json
from typing import Any

from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.shortcuts import get_object_or_404, render
from django.urls import path, reverse
from django.utils.html import format_html, format_html_join
from django.utils.translation import ngettext

from jobs.admin.base import EstimatedCountPaginator, ReadOnlyAdmin, job_link, pretty_json
from jobs.core.exceptions import BacklotError
from jobs.core.masking import mask_value
from jobs.flow import deadletters
from jobs.flow.batches import batch
from jobs.models import AuditEntry, DeadLetter
from jobs.tasks import replay_matching
from jobs.web.forms import EditedReplayForm

PERMISSIONED_ACTIONS = {"replay_selected": "replay", "discard_selected": "discard"}
# A replay's message links this many new jobs (a bulk replay of thousands names the rest as a
# count; the dead-letter list's "replayed as" column links each).
REPLAY_LINKS_SHOWN = 10


@admin.register(DeadLetter)
class DeadLetterAdmin(ReadOnlyAdmin):
    list_display = (
        "task_name",
        "exception_class",
        "short_message",
        "argument_summary",
        "queue",
        "attempts",
        "last_failed_at",  # first_failed_at is on the dead letter's page: the list fits 1,280 px
        "status",
    )
    list_filter = ("status", "task_name", "exception_class", "queue", "last_failed_at")
    search_fields = ("=job_id_value", "exception_message")
    ordering = ("-last_failed_at",)
    list_per_page = 100
    actions = ("replay_selected", "discard_selected")
    show_full_result_count = False
    paginator = EstimatedCountPaginator
    change_list_template = "admin/jobs/deadletter/change_list.html"
    exclude = ("args", "kwargs", "traceback")
    readonly_fields = (
        "job_id_value",
        "task_name",
        "queue",
        "priority",
        "owner",
        "attempts",
        "status",
        "exception_class",
        "exception_message",
        "traceback_block",
        "arguments_block",
        "attempt_history",
        "ledger_entry",
        "replayed_as",
        "first_failed_at",
        "last_failed_at",
        "resolved_at",
        "resolved_by",
    )

    # --- permissions ------------------------------------------------------------------
    def has_replay_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm("jobs.replay_deadletter")

    def has_discard_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm("jobs.discard_deadletter")

    def changelist_view(
        self, request: HttpRequest, extra_context: dict | None = None
    ) -> HttpResponse:
        action = request.POST.get("action") if request.method == "POST" else None
        needed = PERMISSIONED_ACTIONS.get(action or "")
        if needed and not getattr(self, f"has_{needed}_permission")(request):
            raise PermissionDenied(f"You may not {needed} dead letters.")
        extra_context = {**(extra_context or {}), "can_replay": self.has_replay_permission(request)}
        return super().changelist_view(request, extra_context)

    # --- columns ----------------------------------------------------------------------
    @admin.display(description="message")
    def short_message(self, obj: DeadLetter) -> str:
        text = obj.exception_message
        return text if len(text) <= 80 else text[:77] + "…"

    @admin.display(description="arguments")
    def argument_summary(self, obj: DeadLetter) -> str:
        text = json.dumps(mask_value({"args": obj.args, "kwargs": obj.kwargs}))
        return text if len(text) <= 80 else text[:77] + "…"

    @admin.display(description="traceback")
    def traceback_block(self, obj: DeadLetter) -> str:
        return format_html("<pre>{}</pre>", obj.traceback)

    @admin.display(description="arguments")
    def arguments_block(self, obj: DeadLetter) -> str:
        value = {"args": obj.args, "kwargs": obj.kwargs}
        if not self._raw_allowed:
            value = mask_value(value)
        return pretty_json(value)

    @admin.display(description="attempts")
    def attempt_history(self, obj: DeadLetter) -> str:
        failures = obj.job.failures if obj.job else []
        if not failures:
            return "—"
        rows = format_html_join(
            "",
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            ((f["attempt"], f["at"], f["exception"], f["message"]) for f in failures),
        )
        return format_html(
            "<table><tr><th>#</th><th>when</th><th>exception</th><th>message</th></tr>{}</table>",
            rows,
        )

    @admin.display(description="ledger entry")
    def ledger_entry(self, obj: DeadLetter) -> str:
        return job_link(obj.job)

    @admin.display(description="replayed as")
    def replayed_as(self, obj: DeadLetter) -> str:
        return job_link(obj.replayed_job)

    def change_view(
        self,
        request: HttpRequest,
        object_id: str,
        form_url: str = "",
        extra_context: dict | None = None,
    ) -> HttpResponse:
        self._raw_allowed = request.user.has_perm("jobs.view_raw_arguments")
        extra_context = {**(extra_context or {}), "can_replay": self.has_replay_permission(request)}
        return super().change_view(request, object_id, form_url, extra_context)

    _raw_allowed = False

    # --- actions ----------------------------------------------------------------------
    @admin.action(description="Replay selected dead letters", permissions=["replay"])
    def replay_selected(self, request: HttpRequest, queryset: QuerySet[DeadLetter]) -> None:
        outcome = deadletters.dead_letter_replay_many(queryset=queryset, by=request.user)
        deadletters.audit(
            user=request.user,
            action="replay",
            count=outcome.done,
            ids=list(queryset.values_list("pk", flat=True)[:1000]),
        )
        said = (
            ngettext("%d dead letter replayed", "%d dead letters replayed", outcome.done)
            % outcome.done
        )
        shown = outcome.job_ids[:REPLAY_LINKS_SHOWN]
        if shown:
            links = format_html_join(
                ", ",
                '<a href="{}">{}</a>',
                ((reverse("admin:jobs_job_change", args=[job_id]), job_id) for job_id in shown),
            )
            more = len(outcome.job_ids) - len(shown)
            tail = f" and {more} more" if more else ""
            self.message_user(
                request, format_html("{} as {}{}.", said, links, tail), messages.SUCCESS
            )
        else:
            self.message_user(request, f"{said}.", messages.SUCCESS)
        for message in (outcome.errors or [])[:5]:
            self.message_user(request, message, messages.ERROR)

    @admin.action(description="Discard selected dead letters", permissions=["discard"])
    def discard_selected(self, request: HttpRequest, queryset: QuerySet[DeadLetter]) -> None:
        count = deadletters.dead_letter_discard_many(queryset=queryset, by=request.user)
        deadletters.audit(
            user=request.user,
            action="discard",
            count=count,
            ids=list(queryset.values_list("pk", flat=True)[:1000]),
        )
        self.message_user(
            request,
            ngettext("%d dead letter discarded.", "%d dead letters discarded.", count) % count,
            messages.SUCCESS,
        )

    # --- extra views ------------------------------------------------------------------
    def get_urls(self) -> list[Any]:
        wrap = self.admin_site.admin_view
        return [
            path(
                "replay-matching/",
                wrap(self.replay_matching_view),
                name="jobs_deadletter_replay_matching",
            ),
            path(
                "<int:pk>/replay/",
                wrap(self.replay_edited_view),
                name="jobs_deadletter_replay_edited",
            ),
            *super().get_urls(),
        ]

    def _filters_from(self, request: HttpRequest) -> dict[str, str]:
        """The changelist's current filters, as DeadLetter.objects.matching() keys."""
        params = request.GET if request.method == "GET" else request.POST
        mapping = {
            "status__exact": "status",
            "task_name__exact": "task",
            "exception_class__exact": "exception",
            "queue__exact": "queue",
            "last_failed_at__gte": "since",
            "last_failed_at__lt": "until",
            "q": "search",
        }
        return {ours: params[theirs] for theirs, ours in mapping.items() if params.get(theirs)}

    def replay_matching_view(self, request: HttpRequest) -> HttpResponse:
        """Replay every unresolved dead letter matching the changelist's filters, in a job."""
        if not self.has_replay_permission(request):
            raise PermissionDenied("You may not replay dead letters.")
        filters = self._filters_from(request)
        count = DeadLetter.objects.unresolved().matching(filters).count()
        if request.method == "POST":
            # The replays join the batch of the job that sends them: its progress is theirs.
            with batch(description=f"Replay of {count} dead letters", owner=request.user):
                handle = replay_matching.using(owner=request.user).enqueue(
                    filters=filters, user_id=request.user.pk
                )
            deadletters.audit(
                user=request.user,
                action="replay-matching",
                count=count,
                filters=filters,
                job_id=handle.id,
            )
            self.message_user(
                request, f"Replaying {count} dead letters in the background.", messages.SUCCESS
            )
            return HttpResponseRedirect(reverse("job_page", args=[handle.id]))
        return render(
            request,
            "admin/jobs/deadletter/replay_matching.html",
            {
                **self.admin_site.each_context(request),
                "opts": self.model._meta,
                "count": count,
                "filters": filters,
                "title": "Replay all matching dead letters",
            },
        )

    def replay_edited_view(self, request: HttpRequest, pk: int) -> HttpResponse:
        """Replay one dead letter with edited arguments (validated; the edit is recorded)."""
        # Editing starts from the raw arguments, so it needs the permission to see them.
        if not (
            self.has_replay_permission(request) and request.user.has_perm("jobs.view_raw_arguments")
        ):
            raise PermissionDenied(
                "Editing arguments needs the replay and view-raw-arguments permissions."
            )
        row = get_object_or_404(DeadLetter, pk=pk)
        initial = {
            "args": json.dumps(row.args, indent=2),
            "kwargs": json.dumps(row.kwargs, indent=2),
        }
        form = EditedReplayForm(request.POST or None, initial=initial, task_name=row.task_name)
        if request.method == "POST" and form.is_valid():
            try:
                handle = deadletters.dead_letter_replay(
                    dead_letter=row,
                    by=request.user,
                    args=form.cleaned_data["args"],
                    kwargs=form.cleaned_data["kwargs"],
                )
            except BacklotError as exc:
                form.add_error(None, str(exc))
            else:
                deadletters.audit(
                    user=request.user,
                    action="replay-edited",
                    count=1,
                    dead_letter=row.pk,
                    job_id=handle.id,
                    before=mask_value({"args": row.args, "kwargs": row.kwargs}),
                    after=mask_value(
                        {"args": form.cleaned_data["args"], "kwargs": form.cleaned_data["kwargs"]}
                    ),
                )
                url = reverse("admin:jobs_job_change", args=[handle.id])
                self.message_user(
                    request,
                    format_html('Replayed as job <a href="{}">{}</a>.', url, handle.id),
                    messages.SUCCESS,
                )
                return HttpResponseRedirect(reverse("admin:jobs_deadletter_change", args=[row.pk]))
        return render(
            request,
            "admin/jobs/deadletter/replay_edited.html",
            {
                **self.admin_site.each_context(request),
                "opts": self.model._meta,
                "original": row,
                "form": form,
                "title": f"Replay {row.task_name} with edited arguments",
            },
        )


@admin.register(AuditEntry)
class AuditEntryAdmin(ReadOnlyAdmin):
    list_display = ("created_at", "user", "action", "count")
    list_filter = ("action",)
    readonly_fields = ("created_at", "user", "action", "count", "detail")
