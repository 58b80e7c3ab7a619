"""Pages of reports: request one and list yours; follow one and download it."""

from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.paginator import Paginator
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_http_methods

from jobs import AlreadyFinished

from . import services
from .forms import ReportRequestForm
from .models import Report, ReportOrigin
from .tasks import report_email_job, report_render_job

REPORTS_PER_PAGE = 20


@login_required
@require_http_methods(["GET", "POST"])
def report_list(request: HttpRequest) -> HttpResponse:
    if request.method == "POST":
        form = ReportRequestForm(request.POST, user=request.user)
        if form.is_valid() and form.report_request is not None:
            report, _ = services.report_request(
                request=form.report_request,
                owner=request.user,
                origin=ReportOrigin.PAGE,
                render_job=report_render_job,
                email_job=report_email_job,
            )
            messages.success(request, f"Report #{report.pk} is queued; this page follows it.")
            return redirect("reports:detail", report_id=report.pk)
    else:
        form = ReportRequestForm(initial=ReportRequestForm.initial_values(), user=request.user)
    page = Paginator(Report.objects.owned_by(request.user), REPORTS_PER_PAGE).get_page(
        request.GET.get("page")
    )
    # A request the user may not make: the form again, naming the permission, as a 403.
    status = 403 if form.refusal is not None else 200
    return render(request, "reports/list.html", {"form": form, "page": page}, status=status)


@login_required
@require_http_methods(["GET"])
def report_page(request: HttpRequest, report_id: int) -> HttpResponse:
    report = get_object_or_404(Report.objects.visible_to(request.user), pk=report_id)
    return render(
        request,
        "reports/detail.html",
        {"report": report, "status": services.report_status(report=report)},
    )


@login_required
@require_http_methods(["POST"])
def report_cancel(request: HttpRequest, report_id: int) -> HttpResponse:
    """The Cancel button of a queued or rendering report (its owner or staff)."""
    report = get_object_or_404(Report.objects.visible_to(request.user), pk=report_id)
    try:
        outcome = services.report_cancel(report=report, by=request.user)
    except AlreadyFinished:
        messages.info(request, f"Report #{report.pk} already finished: it is {report.status}.")
    else:
        if outcome.requested:
            messages.success(request, f"Report #{report.pk} is stopping at its next step.")
        else:
            messages.success(request, f"Report #{report.pk} is cancelled.")
    return redirect("reports:detail", report_id=report.pk)
