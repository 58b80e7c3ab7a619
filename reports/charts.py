"""Time buckets for trends, and the geometry of the stacked bar charts the PDF templates draw.

Charts are inline SVG laid out here in plain numbers; the templates only emit <rect> and
<text> elements, so WeasyPrint needs no images or scripts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, time, timedelta
from typing import Any
from zoneinfo import ZoneInfo

from django.db.models import DateField
from django.db.models.functions import Cast, TruncDate, TruncHour, TruncMonth, TruncWeek

# Bars per chart stay readable on an A4 width up to about 62 (two months of days); a day or
# two is shown by hour, longer periods by week, and beyond half a year by month.
HOURLY_UP_TO = 2
DAILY_UP_TO = 62
WEEKLY_UP_TO = 186
# The palette of the report templates (templates/reports/_pdf_base.html).
OK_COLOUR = "#3451d1"
FAILED_COLOUR = "#d92d20"

Bucket = date | datetime  # a datetime (aware, in the period's zone) for hours, else a date


def bucket_size(days: int) -> str:
    """'hour', 'day', 'week' or 'month': the trend granularity for a period of `days` days."""
    if days <= HOURLY_UP_TO:
        return "hour"
    if days <= DAILY_UP_TO:
        return "day"
    if days <= WEEKLY_UP_TO:
        return "week"
    return "month"


def bucket_expression(column: str, size: str, zone: ZoneInfo) -> Any:
    """An expression naming the bucket: the hour, the day, Monday of the week, the 1st."""
    if size == "hour":
        return TruncHour(column, tzinfo=zone)
    if size == "day":
        return TruncDate(column, tzinfo=zone)
    truncate = TruncWeek if size == "week" else TruncMonth
    return Cast(truncate(column, tzinfo=zone), output_field=DateField())


def bucket_start(day: date, size: str) -> date:
    if size == "week":
        return day - timedelta(days=day.weekday())
    if size == "month":
        return day.replace(day=1)
    return day


def buckets(start: date, end: date, size: str, zone: ZoneInfo | None = None) -> list[Bucket]:
    """Every bucket from the one holding `start` to the one holding `end` (hours need `zone`)."""
    if size == "hour":
        if zone is None:
            raise ValueError("hourly buckets need the period's time zone")
        # Step in UTC: a day has 23 or 25 hours when the clocks change.
        hour = datetime.combine(start, time.min, zone).astimezone(UTC)
        stop = datetime.combine(end + timedelta(days=1), time.min, zone)
        hours: list[Bucket] = []
        while hour < stop:
            hours.append(hour.astimezone(zone))
            hour += timedelta(hours=1)
        return hours
    out: list[Bucket] = []
    current = bucket_start(start, size)
    while current <= end:
        out.append(current)
        if size == "day":
            current += timedelta(days=1)
        elif size == "week":
            current += timedelta(days=7)
        else:
            current = (current.replace(day=28) + timedelta(days=4)).replace(day=1)
    return out


def bucket_label(bucket: Bucket, size: str) -> str:
    if size == "hour":
        return f"{bucket:%H:%M}"
    if size == "month":
        return f"{bucket:%b %Y}"
    return f"{bucket:%d %b}"


@dataclass
class Segment:
    y: float
    height: float
    fill: str


@dataclass
class Bar:
    x: float
    width: float
    center: float
    label: str
    show_label: bool
    total: float
    segments: list[Segment] = field(default_factory=list)


@dataclass
class Gridline:
    y: float
    text_y: float
    label: str


@dataclass
class Chart:
    width: int
    height: int
    plot_left: float
    plot_right: float
    label_y: float
    bars: list[Bar]
    gridlines: list[Gridline]
    legend: list[tuple[str, str]]  # (fill colour, name)


def stacked_bars(
    points: Sequence[tuple[str, Mapping[str, float]]],
    *,
    series: Sequence[tuple[str, str, str]],
    width: int = 680,
    height: int = 170,
    max_labels: int = 12,
    value_format: str = "{:,.0f}",
) -> Chart:
    """Lay out one stacked bar per point; `series` are (value key, fill colour, legend name)."""
    plot_left, plot_right, plot_top, plot_bottom = 48.0, float(width) - 4, 8.0, float(height) - 22
    totals = [sum(float(values.get(key, 0) or 0) for key, _, _ in series) for _, values in points]
    peak = _nice_ceiling(max(totals, default=0.0))
    slot = (plot_right - plot_left) / max(1, len(points))
    bar_width = max(1.0, slot * 0.72)
    every = max(1, -(-len(points) // max_labels))  # ceil: at most max_labels labels
    scale = (plot_bottom - plot_top) / peak
    bars = []
    for index, ((label, values), total) in enumerate(zip(points, totals, strict=True)):
        left = plot_left + slot * index + (slot - bar_width) / 2
        bar = Bar(
            x=round(left, 2),
            width=round(bar_width, 2),
            center=round(left + bar_width / 2, 2),
            label=label,
            show_label=index % every == 0,
            total=total,
        )
        top = plot_bottom
        for key, fill, _ in series:
            amount = float(values.get(key, 0) or 0)
            if amount <= 0:
                continue
            h = amount * scale
            top -= h
            bar.segments.append(Segment(y=round(top, 2), height=round(h, 2), fill=fill))
        bars.append(bar)
    gridlines = []
    for share in (0.0, 0.25, 0.5, 0.75, 1.0):
        y = round(plot_bottom - (plot_bottom - plot_top) * share, 2)
        gridlines.append(Gridline(y=y, text_y=y + 3, label=value_format.format(peak * share)))
    return Chart(
        width=width,
        height=height,
        plot_left=plot_left,
        plot_right=plot_right,
        label_y=float(height) - 8,
        bars=bars,
        gridlines=gridlines,
        legend=[(fill, name) for _, fill, name in series],
    )


def _nice_ceiling(value: float) -> float:
    """The smallest 1, 2, 2.5 or 5 * 10^n at or above `value` (1 for an empty chart)."""
    if value <= 0:
        return 1.0
    magnitude = 10 ** (len(str(int(value))) - 1) if value >= 1 else 1.0
    for step in (1, 2, 2.5, 5, 10):
        if value <= step * magnitude:
            return step * magnitude
    return 10 * magnitude
