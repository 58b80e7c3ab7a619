"""What a report request may contain (per kind) and what the reports API answers."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import date, datetime, time, timedelta
from typing import Annotated, Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from django.conf import settings
from django.core.exceptions import ValidationError as DjangoValidationError
from django.core.validators import validate_email
from django.utils import timezone
from ninja import Schema
from pydantic import (
    AfterValidator,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
)
from pydantic_core import PydanticCustomError

from .exceptions import ReportInputError
from .models import ReportKind

# Longest period one report covers: a year (leap years included). Operations over a year of a
# busy ledger is the heaviest query we allow from a request (see README, reports).
MAX_PERIOD_DAYS = 366
# Recipients of one report's email; more is a mailing list, which campaigns are for.
MAX_RECIPIENTS = 20


def _iso_date(value: Any) -> Any:
    if isinstance(value, date) and not isinstance(value, datetime):
        return value
    if not isinstance(value, str):
        raise PydanticCustomError("date_type", "Enter a date as YYYY-MM-DD.")
    try:
        return date.fromisoformat(value.strip())
    except ValueError:
        raise PydanticCustomError(
            "date_parsing", "{value} is not a date; use YYYY-MM-DD.", {"value": repr(value)}
        ) from None


def _zone_name(value: str) -> str:
    try:
        ZoneInfo(value)
    except (ZoneInfoNotFoundError, ValueError):
        raise PydanticCustomError(
            "timezone",
            "Unknown time zone {value}; use an IANA name such as America/New_York.",
            {"value": repr(value)},
        ) from None
    return value


def _email_address(value: str) -> str:
    value = value.strip()
    try:
        validate_email(value)
    except DjangoValidationError:
        raise PydanticCustomError("email", "Enter a valid email address.") from None
    return value


IsoDate = Annotated[date, BeforeValidator(_iso_date)]
TimeZoneName = Annotated[str, AfterValidator(_zone_name)]
EmailAddress = Annotated[str, AfterValidator(_email_address)]


class PeriodParams(Schema):
    """Whole days from `start` to `end` (both included), as they fall in `timezone`."""

    model_config = ConfigDict(extra="forbid")

    timezone: TimeZoneName = Field(
        default_factory=lambda: settings.TIME_ZONE,
        description="IANA time zone the days are counted in.",
        examples=["America/New_York"],
    )
    start: IsoDate = Field(description="First day, YYYY-MM-DD.", examples=["2025-03-01"])
    end: IsoDate = Field(description="Last day (included), YYYY-MM-DD.", examples=["2025-03-31"])

    @field_validator("start")
    @classmethod
    def _start_not_in_future(cls, start: date, info: ValidationInfo) -> date:
        zone = info.data.get("timezone")
        if zone and start > timezone.now().astimezone(ZoneInfo(zone)).date():
            raise PydanticCustomError(
                "period_future", "Start ({start}) is in the future.", {"start": start}
            )
        return start

    @field_validator("end")
    @classmethod
    def _end_after_start(cls, end: date, info: ValidationInfo) -> date:
        start = info.data.get("start")
        if start is None:  # start itself was invalid: that error says it all
            return end
        if end < start:
            raise PydanticCustomError(
                "period_order",
                "End ({end}) is before start ({start}).",
                {"end": end, "start": start},
            )
        days = (end - start).days + 1
        if days > MAX_PERIOD_DAYS:
            raise PydanticCustomError(
                "period_too_long",
                "The period is {days} days; a report covers at most {limit}.",
                {"days": days, "limit": MAX_PERIOD_DAYS},
            )
        return end

    @property
    def zone(self) -> ZoneInfo:
        return ZoneInfo(self.timezone)

    @property
    def days(self) -> int:
        return (self.end - self.start).days + 1

    def bounds(self) -> tuple[datetime, datetime]:
        """[first midnight, midnight after the last day) as aware datetimes."""
        zone = self.zone
        return (
            datetime.combine(self.start, time.min, zone),
            datetime.combine(self.end + timedelta(days=1), time.min, zone),
        )

    def previous(self) -> PeriodParams:
        """The period of the same length just before this one (for comparisons)."""
        length = timedelta(days=self.days)
        return self.model_construct(
            timezone=self.timezone, start=self.start - length, end=self.end - length
        )

    @property
    def label(self) -> str:
        if self.start == self.end:
            return f"{self.start:%a %d %b %Y}"
        return f"{self.start:%d %b %Y} to {self.end:%d %b %Y}"


class OperationsParams(PeriodParams):
    """Jobs that finished in the period and dead letters written in it."""


class SalesParams(PeriodParams):
    """Orders placed in the period, compared with the period just before."""


PARAMS_BY_KIND: dict[str, type[PeriodParams]] = {
    ReportKind.OPERATIONS: OperationsParams,
    ReportKind.SALES: SalesParams,
}


def _split_addresses(value: Any) -> Any:
    if value is None:
        return []
    if isinstance(value, str):
        return [part for part in (p.strip() for p in value.split(",")) if part]
    return value


class ReportIn(Schema):
    """POST /api/reports/: which report, its parameters, and who gets it by email."""

    model_config = ConfigDict(extra="forbid")

    kind: ReportKind = Field(description="operations or sales.")
    params: dict[str, Any] = Field(
        default_factory=dict,
        description="Parameters of the kind: start, end (YYYY-MM-DD) and an optional timezone.",
        examples=[{"start": "2025-03-01", "end": "2025-03-31", "timezone": "America/New_York"}],
    )
    email_to: Annotated[list[EmailAddress], BeforeValidator(_split_addresses)] = Field(
        default_factory=list,
        max_length=MAX_RECIPIENTS,
        description="Optional addresses (a list, or one comma-separated string) that get the PDF.",
    )


@dataclass(frozen=True)
class ReportRequest:
    """A validated request: its kind, parameters (JSON-ready) and recipients."""

    kind: ReportKind
    params: PeriodParams
    email_to: list[str]

    def params_json(self) -> dict[str, Any]:
        return self.params.model_dump(mode="json")


def _errors(exc: ValidationError, prefix: tuple[str, ...]) -> list[dict[str, Any]]:
    return [
        {"loc": [*prefix, *error["loc"]], "msg": error["msg"], "type": error["type"]}
        for error in exc.errors(include_url=False, include_input=False, include_context=False)
    ]


def report_input_parse(data: Any) -> ReportRequest:
    """Validate a request body; ReportInputError lists every bad field (loc, msg, type)."""
    errors: list[dict[str, Any]] = []
    envelope = None
    try:
        envelope = ReportIn.model_validate(data)
    except ValidationError as exc:
        errors.extend(_errors(exc, ("body",)))
    # The parameters are checked even when another field is bad, so that one answer names all.
    kind = data.get("kind") if isinstance(data, dict) else None
    raw_params = data.get("params", {}) if isinstance(data, dict) else None
    params = None
    if isinstance(kind, str) and kind in PARAMS_BY_KIND and isinstance(raw_params, dict):
        try:
            params = params_parse(kind, raw_params)
        except ReportInputError as exc:
            errors.extend(exc.errors)
    if errors or envelope is None or params is None:
        raise ReportInputError(errors)
    return ReportRequest(kind=envelope.kind, params=params, email_to=envelope.email_to)


def params_parse(kind: str, params: dict[str, Any]) -> PeriodParams:
    """Validate the parameters of a kind; errors are located under body.params."""
    model = PARAMS_BY_KIND[kind]
    try:
        return model.model_validate(params)
    except ValidationError as exc:
        raise ReportInputError(_errors(exc, ("body", "params"))) from None


# --- answers -------------------------------------------------------------------------------


class FieldError(Schema):
    loc: list[str | int]
    msg: str
    type: str


class ReportErrorOut(Schema):
    detail: list[FieldError] | str


class ReportCreatedOut(Schema):
    report_id: int
    job_id: str
    status_url: str
    state: str


class ReportProgressOut(Schema):
    done: int
    total: int | None
    percent: float | None
    message: str


class ReportOut(Schema):
    report_id: int
    kind: str
    title: str
    params: dict[str, Any]
    state: str
    progress: ReportProgressOut
    error: str | None
    job_id: str | None
    job_state: str | None
    attempts: int | None
    max_attempts: int | None
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    render_seconds: float | None
    pages: int | None
    size_bytes: int | None
    emailed_at: datetime | None
    download_url: str | None
