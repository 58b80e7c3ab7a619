"""Admin for the job ledger: read-only history, the dashboard, cancel (permission cancel_job)
and retry of dead jobs (replays their dead letters: permission replay_deadletter), each audited."""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.contrib.admin.views.main import ChangeList
from django.core.exceptions import PermissionDenied
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils.html import format_html, format_html_join
from django.utils.translation import ngettext

from jobs.admin.base import EstimatedCountPaginator, ReadOnlyAdmin, pretty_json
from jobs.broker import running
from jobs.core.exceptions import InvalidPayload, SignalRefused
from jobs.core.masking import mask_value
from jobs.flow.cancellation import cancel_many
from jobs.flow.deadletters import audit, dead_letter_replay_many
from jobs.flow.signals import signal
from jobs.models import DeadLetter, Job, JobState, JobStep
from jobs.web.dashboard import dashboard_json, dashboard_view


class JobStepInline(admin.TabularInline):
    """A job's durable steps (jobs.worker.steps), read-only: what each did; the stored result
    is shown by its size only (it may hold personal data)."""

    model = JobStep
    extra = 0
    can_delete = False
    ordering = ("position",)
    fields = (
        "position",
        "name",
        "kind",
        "state",
        "attempts",
        "job_attempt",
        "started_at",
        "finished_at",
        "wake_at",
        "error",
        "result_bytes",
        "copied_from",
    )
    readonly_fields = fields

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


class SignalForm(forms.Form):
    name = forms.CharField(max_length=190, help_text="The event, as the job's wait_for() names it.")
    payload = forms.JSONField(required=False, help_text="JSON the job's wait_for() returns.")


class JobChangeList(ChangeList):
    """The job list, with its page's runs that have not written their row yet (DEFER_CLAIM)
    read in one Redis call: their state column says running, as the status API does."""

    def get_results(self, request: HttpRequest) -> None:
        super().get_results(request)
        unclaimed = running.unclaimed(self.result_list)
        for job in self.result_list:
            job.runs_unclaimed = str(job.pk) in unclaimed


@admin.register(Job)
class JobAdmin(ReadOnlyAdmin):
    list_display = (
        "id",
        "task_name",
        "shown_state",
        "queue",
        "priority",
        "attempts",
        "enqueued_at",
        "finished_at",
    )
    list_filter = ("state", "queue", "task_name")
    actions = ("cancel_selected", "retry_selected", "signal_selected")
    search_fields = ("=id", "idempotency_key")
    date_hierarchy = "enqueued_at"
    show_full_result_count = False
    paginator = EstimatedCountPaginator
    exclude = ("args", "kwargs")
    inlines = (JobStepInline,)
    readonly_fields = [f.name for f in Job._meta.fields if f.name not in ("args", "kwargs")] + [
        "arguments"
    ]

    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type[ChangeList]:
        return JobChangeList

    @admin.display(description="state", ordering="state")
    def shown_state(self, obj: Job) -> str:
        """The row's state; running for a run that has not written its row yet (DEFER_CLAIM)."""
        if getattr(obj, "runs_unclaimed", False):
            return str(JobState.RUNNING.label)
        return str(obj.get_state_display())

    @admin.display(description="arguments")
    def arguments(self, obj: Job) -> str:
        return pretty_json(mask_value({"args": obj.args, "kwargs": obj.kwargs}))

    def has_cancel_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm("jobs.cancel_job")

    def has_retry_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm("jobs.replay_deadletter")

    def has_signal_permission(self, request: HttpRequest) -> bool:
        # a signal steers a running job as a cancel does: the same permission
        return request.user.has_perm("jobs.cancel_job")

    @admin.action(description="Send a signal to selected jobs", permissions=["signal"])
    def signal_selected(self, request: HttpRequest, queryset: QuerySet[Job]) -> Any:
        """jobs.signal(job, name, payload) for each selected job (up to 1,000), after a page
        asking for the event's name and JSON payload; refused ones are listed, each audited."""
        form = SignalForm(request.POST if "apply" in request.POST else None)
        if not form.is_valid():
            return TemplateResponse(
                request,
                "admin/jobs/job/signal.html",
                {
                    **self.admin_site.each_context(request),
                    "title": "Send a signal",
                    "opts": self.model._meta,
                    "form": form,
                    "jobs": list(queryset.only("id")[:1000]),
                    "action_checkbox_name": helpers.ACTION_CHECKBOX_NAME,
                },
            )
        name, payload = form.cleaned_data["name"], form.cleaned_data["payload"]
        ids = list(queryset.values_list("id", flat=True)[:1000])
        sent, refused = 0, []
        for job_id in ids:
            try:
                signal(job_id, name, payload)
                sent += 1
            except (SignalRefused, InvalidPayload, Job.DoesNotExist) as exc:
                refused.append(str(exc))
        audit(user=request.user, action="signal", count=sent, ids=[str(i) for i in ids], name=name)
        self.message_user(
            request,
            ngettext("Signal %s sent to %d job", "Signal %s sent to %d jobs", sent) % (name, sent),
            messages.SUCCESS if sent else messages.WARNING,
        )
        for reason in refused[:5]:
            self.message_user(request, reason, messages.ERROR)
        return None

    def changelist_view(
        self, request: HttpRequest, extra_context: dict | None = None
    ) -> HttpResponse:
        action = request.POST.get("action") if request.method == "POST" else None
        if action == "cancel_selected" and not self.has_cancel_permission(request):
            raise PermissionDenied("You may not cancel jobs.")
        if action == "retry_selected" and not self.has_retry_permission(request):
            raise PermissionDenied("You may not retry jobs.")
        if action == "signal_selected" and not self.has_signal_permission(request):
            raise PermissionDenied("You may not signal jobs.")
        return super().changelist_view(request, extra_context)

    @admin.action(description="Retry selected dead jobs", permissions=["retry"])
    def retry_selected(self, request: HttpRequest, queryset: QuerySet[Job]) -> None:
        """A dead job is retried by replaying its dead letter: a new job, linked to it, with
        the original queue, owner and priority (jobs.flow.deadletters). Others are skipped."""
        ids = list(queryset.filter(state=JobState.DEAD).values_list("id", flat=True)[:1000])
        letters = DeadLetter.objects.unresolved().filter(job_id_value__in=ids)
        outcome = dead_letter_replay_many(queryset=letters, by=request.user)
        audit(user=request.user, action="retry", count=outcome.done, ids=[str(i) for i in ids])
        skipped = queryset.count() - outcome.done
        said = ngettext("%d job retried", "%d jobs retried", outcome.done) % outcome.done
        links = format_html_join(
            ", ",
            '<a href="{}">{}</a>',
            ((reverse("admin:jobs_job_change", args=[j]), j) for j in outcome.job_ids[:10]),
        )
        tail = f"; {skipped} not dead (or already replayed): left as they are" if skipped else ""
        message = format_html("{} as {}{}.", said, links, tail) if outcome.job_ids else said + tail
        self.message_user(request, message, messages.SUCCESS if outcome.done else messages.WARNING)
        for error in outcome.errors[:5]:
            self.message_user(request, error, messages.ERROR)

    @admin.action(description="Cancel selected jobs", permissions=["cancel"])
    def cancel_selected(self, request: HttpRequest, queryset: QuerySet[Job]) -> None:
        ids = list(queryset.values_list("id", flat=True)[:1000])
        done, ended = cancel_many(ids, by=request.user)
        audit(user=request.user, action="cancel", count=done, ids=[str(i) for i in ids])
        self.message_user(
            request,
            ngettext("%d job cancelled", "%d jobs cancelled", done) % done
            + (f"; {ended} had already finished." if ended else "."),
            messages.SUCCESS if done else messages.WARNING,
        )

    def get_urls(self) -> list[Any]:
        return [
            path("dashboard/", self.admin_site.admin_view(dashboard_view), name="jobs_dashboard"),
            path(
                "dashboard.json",
                self.admin_site.admin_view(dashboard_json),
                name="jobs_dashboard_json",
            ),
            *super().get_urls(),
        ]
