"""JSON API of reports (django-ninja router mounted at /api/reports/ in config/api.py).

POST / validates the request itself (reports.schemas) so that bad input is a 400 with one
entry per bad field, in ninja's {"detail": [{"loc", "msg", "type"}]} shape; ninja's own body
validation would answer 422. The body is read by the API's one parser (web.api_input.json_body).
"""

from __future__ import annotations

from typing import Any

from django.http import FileResponse
from ninja import Router, Status
from ninja.errors import HttpError

from config.api_types import AuthenticatedRequest
from jobs import AlreadyFinished
from web.api_input import json_body

from . import services
from .exceptions import ReportInputError, ReportNotReady, ReportPermissionDenied
from .models import Report, ReportOrigin
from .schemas import ReportCreatedOut, ReportErrorOut, ReportIn, ReportOut, report_input_parse
from .tasks import report_email_job, report_render_job

router = Router(tags=["reports"])


def _inline_refs(schema: Any, definitions: dict[str, Any]) -> Any:
    """The JSON schema with local $refs replaced by their definitions (for openapi_extra)."""
    if isinstance(schema, dict):
        ref = schema.get("$ref", "")
        if ref.startswith("#/$defs/"):
            return _inline_refs(definitions[ref.removeprefix("#/$defs/")], definitions)
        return {k: _inline_refs(v, definitions) for k, v in schema.items() if k != "$defs"}
    if isinstance(schema, list):
        return [_inline_refs(item, definitions) for item in schema]
    return schema


_REQUEST_SCHEMA = ReportIn.model_json_schema()
_REQUEST_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {
                "schema": _inline_refs(_REQUEST_SCHEMA, _REQUEST_SCHEMA.get("$defs", {}))
            }
        },
    }
}


def _visible_report(request: AuthenticatedRequest, report_id: int) -> Report:
    report = Report.objects.visible_to(request.auth).filter(pk=report_id).first()
    if report is None:
        raise HttpError(404, "No such report")
    return report


@router.post(
    "/",
    response={202: ReportCreatedOut, 400: ReportErrorOut, 403: ReportErrorOut},
    url_name="report_create",
    openapi_extra=_REQUEST_BODY,
    summary="Request a PDF report",
)
def report_create(request: AuthenticatedRequest) -> Status[dict[str, Any]]:
    """Accept a report request: 202 with the report and job ids, 400 naming each bad field, or
    403 naming the permission the request needs.

    Body: {"kind": "operations" | "sales", "params": {"start", "end", "timezone"?},
    "email_to": [addresses]?}. A kind needs its permission (reports.request_sales_report,
    reports.request_operations_report) unless the caller is staff; an address other than the
    caller's own needs reports.email_report_elsewhere. Nothing is written or enqueued for a
    bad or refused request.
    """
    data = json_body(request)  # the API's one parser: limits, depth, control characters
    try:
        parsed = report_input_parse(data)
    except ReportInputError as exc:
        return Status(400, {"detail": exc.errors})
    try:
        report, job_id = services.report_request(
            request=parsed,
            owner=request.auth,
            origin=ReportOrigin.API,
            render_job=report_render_job,
            email_job=report_email_job,
        )
    except ReportPermissionDenied as exc:
        return Status(403, {"detail": str(exc)})
    return Status(
        202,
        {
            "report_id": report.pk,
            "job_id": job_id,
            "status_url": report.status_url,
            "state": report.status,
        },
    )


@router.get("/{int:report_id}/", response=ReportOut, url_name="report_status")
def report_detail(request: AuthenticatedRequest, report_id: int) -> dict[str, Any]:
    """A report's state, progress and error; download_url once the PDF is ready.

    Other users' reports are 404 (staff see all).
    """
    return services.report_status(report=_visible_report(request, report_id))


@router.get(
    "/{int:report_id}/download",
    response={404: ReportErrorOut, 409: ReportErrorOut},  # 200: the PDF, in openapi_extra
    url_name="report_download",
    openapi_extra={
        "responses": {"200": {"description": "The PDF", "content": {"application/pdf": {}}}}
    },
)
def report_download(request: AuthenticatedRequest, report_id: int) -> Any:
    """The PDF as an attachment (owner or staff only; others get 404); 409 until it is ready."""
    report = _visible_report(request, report_id)
    try:
        handle = services.report_file_open(report=report)
    except ReportNotReady as exc:
        return Status(409, {"detail": str(exc)})
    return FileResponse(
        handle,
        as_attachment=True,
        filename=report.download_filename(),
        content_type="application/pdf",
    )


@router.post(
    "/{int:report_id}/cancel",
    response={202: ReportOut, 404: ReportErrorOut, 409: ReportErrorOut},
    url_name="report_cancel",
)
def report_cancel(request: AuthenticatedRequest, report_id: int) -> Any:
    """Cancel a queued or rendering report, as its page's Cancel button does (a rendering one
    stops at its next step); 202 with the report. 409 once it has settled."""
    report = _visible_report(request, report_id)
    try:
        services.report_cancel(report=report, by=request.auth)
    except AlreadyFinished:
        return Status(
            409, {"detail": f"Report {report.pk} already finished: it is {report.status}"}
        )
    report.refresh_from_db()
    return Status(202, services.report_status(report=report))
