"""The report services called directly: figures, percentiles, PDF files, demo data."""

from __future__ import annotations

import random
import uuid
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest
from django.conf import settings
from django.core.management import call_command
from django.db.models import DecimalField, ExpressionWrapper, F, Sum
from django.utils import timezone

from jobs.models import DeadLetter, DeadLetterStatus, Job, JobState
from reports import services
from reports.charts import bucket_size, buckets, stacked_bars
from reports.demo import demo_seed
from reports.kinds.operations import operations_data
from reports.kinds.sales import sales_data
from reports.models import Order, OrderLine, OrderStatus, Product, Report, ReportKind, ReportStatus
from reports.percentiles import grouped_percentiles, percentile
from reports.rendering import pdf_file_name
from reports.schemas import OperationsParams, SalesParams
from tests.reports.conftest import pdf_text, pdf_title, remove_report_files

pytestmark = pytest.mark.django_db


@pytest.fixture
def media_cleanup():
    yield
    remove_report_files()


def ledger_row(
    *,
    task: str,
    queue: str,
    state: str,
    finished_at: datetime,
    run_seconds: float | None,
    attempts: int = 1,
    crashes: int = 0,
) -> Job:
    return Job.objects.create(
        task_name=task,
        queue=queue,
        state=state,
        attempts=attempts,
        max_attempts=5,
        crashes=crashes,
        enqueued_at=finished_at - timedelta(seconds=5),
        started_at=finished_at - timedelta(seconds=2),
        finished_at=finished_at,
        run_seconds=run_seconds,
    )


def period_around(moment: datetime, zone: str = "UTC") -> OperationsParams:
    day = moment.astimezone(ZoneInfo(zone)).date()
    return OperationsParams(start=day, end=day, timezone=zone)


# --- percentiles ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "values, fraction, expected",
    [
        ([], 0.5, None),
        ([4.0], 0.5, 4.0),
        ([4.0], 0.95, 4.0),
        ([1.0, 2.0], 0.5, 1.5),
        ([1.0, 2.0, 3.0, 4.0], 0.5, 2.5),
        ([1.0, 2.0, 3.0, 4.0], 0.0, 1.0),
        ([1.0, 2.0, 3.0, 4.0], 1.0, 4.0),
        (list(map(float, range(1, 101))), 0.95, 95.05),
        ([0.1, 0.1, 0.1, 10.0], 0.95, 8.515),
    ],
)
def test_percentile_interpolates_like_percentile_cont(values, fraction, expected):
    found = percentile(values, fraction)
    assert found == pytest.approx(expected) if expected is not None else found is None


@pytest.mark.parametrize("fraction", [-0.1, 1.5])
def test_percentile_rejects_fractions_outside_0_1(fraction):
    with pytest.raises(ValueError):
        percentile([1.0], fraction)


def test_database_and_python_percentiles_agree():
    rng = random.Random(7)
    now = timezone.now()
    for index in range(300):
        ledger_row(
            task=f"tests.t{index % 3}",
            queue=("default", "emails")[index % 2],
            state=JobState.SUCCEEDED,
            finished_at=now,
            run_seconds=round(rng.lognormvariate(0, 1), 4),
        )
    ledger_row(
        task="tests.t0", queue="default", state=JobState.DEAD, finished_at=now, run_seconds=None
    )
    jobs = Job.objects.all()

    for group in [(), ("queue",), ("queue", "task_name")]:
        in_db = grouped_percentiles(
            jobs, field="run_seconds", fractions=(0.5, 0.95), group=group, in_database=True
        )
        in_python = grouped_percentiles(
            jobs, field="run_seconds", fractions=(0.5, 0.95), group=group, in_database=False
        )
        assert in_db.keys() == in_python.keys()
        for key in in_db:
            assert in_db[key] == pytest.approx(in_python[key]), (group, key)


# --- operations figures -----------------------------------------------------------------------


@pytest.mark.clock  # the UTC day of 5 minutes ago, in hourly trend buckets
def test_operations_figures_count_outcomes_retries_and_run_times():
    # given: 18 jobs in the period, 2 outside it, and dead letters
    finished = timezone.now() - timedelta(minutes=5)
    for seconds in [0.2, 0.4, 0.6, 0.8, 1.0, 1.2, 1.4, 1.6, 1.8, 2.0]:
        ledger_row(
            task="shop.invoice",
            queue="default",
            state=JobState.SUCCEEDED,
            finished_at=finished,
            run_seconds=seconds,
        )
    ledger_row(
        task="shop.invoice",
        queue="default",
        state=JobState.SUCCEEDED,
        finished_at=finished,
        run_seconds=3.0,
        attempts=3,
    )
    ledger_row(
        task="shop.invoice",
        queue="default",
        state=JobState.DEAD,
        finished_at=finished,
        run_seconds=9.0,
        attempts=5,
        crashes=1,
    )
    for _ in range(5):
        ledger_row(
            task="emails.send",
            queue="emails",
            state=JobState.SUCCEEDED,
            finished_at=finished,
            run_seconds=0.05,
        )
    ledger_row(
        task="emails.send",
        queue="emails",
        state=JobState.DEAD,
        finished_at=finished,
        run_seconds=0.1,
    )
    ledger_row(
        task="shop.invoice",
        queue="default",
        state=JobState.SUCCEEDED,
        finished_at=finished - timedelta(days=3),
        run_seconds=50.0,
    )
    Job.objects.create(task_name="shop.invoice", queue="default", state=JobState.RUNNING)
    for status in (DeadLetterStatus.DEAD, DeadLetterStatus.DEAD, DeadLetterStatus.REPLAYED):
        DeadLetter.objects.create(
            job_id_value=uuid.uuid4(),
            task_name="emails.send",
            queue="emails",
            exception_class="jobs.core.policies.Permanent",
            exception_message="550 refused for jane.doe@example.com",
            first_failed_at=finished,
            last_failed_at=finished,
            status=status,
            attempts=1,
        )
    sections: list[str] = []

    # when
    data = operations_data(period_around(finished), sections.append)

    # then
    summary = data["summary"]
    assert (summary["jobs"], summary["succeeded"], summary["dead"]) == (18, 16, 2)
    assert summary["success_rate"] == pytest.approx(16 / 18)
    assert (summary["retried"], summary["retries"], summary["recovered"], summary["crashes"]) == (
        2,
        6,
        1,
        1,
    )
    all_times = sorted(
        [0.2, 0.4, 0.6, 0.8, 1.0, 1.2, 1.4, 1.6, 1.8, 2.0, 3.0, 9.0] + [0.05] * 5 + [0.1]
    )
    assert summary["p50"] == pytest.approx(percentile(all_times, 0.5))
    assert summary["p95"] == pytest.approx(percentile(all_times, 0.95))
    queues = {row["queue"]: row for row in data["queues"]}
    assert (queues["default"]["jobs"], queues["default"]["dead"]) == (12, 1)
    assert queues["emails"]["success_rate"] == pytest.approx(5 / 6)
    assert [row["task_name"] for row in data["tasks"]] == ["shop.invoice", "emails.send"]
    assert data["dead_letters"]["counts"] == {
        "total": 3,
        "waiting": 2,
        "replayed": 1,
        "discarded": 0,
    }
    assert data["dead_letters"]["latest"][0]["message"] == "550 refused for j***@example.com"
    assert data["active_now"] == 1
    assert sections == ["summary", "queues", "tasks", "trend", "dead letters"]
    assert sum(bar.total for bar in data["trend"].bars) == 18


def test_operations_period_follows_its_time_zone():
    # 03:30 UTC on 10 March is still 9 March in New York (EDT, UTC-4)
    ledger_row(
        task="t",
        queue="default",
        state=JobState.SUCCEEDED,
        finished_at=datetime(2025, 3, 10, 3, 30, tzinfo=UTC),
        run_seconds=1.0,
    )
    new_york_9th = OperationsParams(
        start=date(2025, 3, 9), end=date(2025, 3, 9), timezone="America/New_York"
    )
    utc_9th = OperationsParams(start=date(2025, 3, 9), end=date(2025, 3, 9), timezone="UTC")

    assert operations_data(new_york_9th, lambda _: None)["summary"]["jobs"] == 1
    assert operations_data(utc_9th, lambda _: None)["summary"]["jobs"] == 0


# --- sales figures -------------------------------------------------------------------------------


@pytest.mark.clock  # demo orders by date (weekends, season), the last 14 days and the 14 before
def test_sales_figures_match_the_order_lines():
    demo_seed(days=60)
    today = timezone.localdate()
    params = SalesParams(start=today - timedelta(days=13), end=today)
    start, end = params.bounds()
    amount = ExpressionWrapper(
        F("quantity") * F("unit_price"), output_field=DecimalField(max_digits=14, decimal_places=2)
    )
    lines = OrderLine.objects.filter(order__placed_at__gte=start, order__placed_at__lt=end)
    paid = lines.filter(order__status=OrderStatus.PAID)

    data = sales_data(params, lambda _: None)

    summary = data["summary"]
    assert summary["revenue"] == paid.aggregate(total=Sum(amount))["total"]
    assert summary["refunds"] == (
        lines.filter(order__status=OrderStatus.REFUNDED).aggregate(total=Sum(amount))["total"]
        or Decimal("0.00")
    )
    assert summary["orders"] == Order.objects.placed_between(start, end).paid().count()
    assert summary["units"] == paid.aggregate(total=Sum("quantity"))["total"]
    assert sum(row["revenue"] for row in data["categories"]) == summary["revenue"]
    assert sum(row["share"] for row in data["regions"]) == pytest.approx(1.0)
    assert data["products"] == sorted(
        data["products"], key=lambda row: row["revenue"], reverse=True
    )
    assert len(data["products"]) == 10
    before = data["previous"]["revenue"]
    assert data["changes"]["revenue"] == pytest.approx(
        float(summary["revenue"]) / float(before) - 1
    )
    assert sum(bar.total for bar in data["trend"].bars) == pytest.approx(float(summary["revenue"]))


# --- demo data ------------------------------------------------------------------------------------


@pytest.mark.clock  # a year of demo orders ending today
def test_seed_demo_is_deterministic_idempotent_and_fast():
    first = demo_seed()
    numbers = list(
        Order.objects.order_by("number").values_list("number", "region", "channel", "status")[:50]
    )
    total = OrderLine.objects.aggregate(units=Sum("quantity"))["units"]

    again = demo_seed()
    reset = demo_seed(reset=True)

    assert first.created and not again.created and reset.created
    assert 2000 <= first.orders <= 6000 and first.products == 40
    assert (again.orders, again.lines) == (first.orders, first.lines) == (reset.orders, reset.lines)
    assert (
        list(
            Order.objects.order_by("number").values_list("number", "region", "channel", "status")[
                :50
            ]
        )
        == numbers
    )
    assert OrderLine.objects.aggregate(units=Sum("quantity"))["units"] == total
    newest = Order.objects.latest("placed_at")
    assert newest.placed_at.date() >= timezone.localdate() - timedelta(days=1)


def test_seed_demo_command_reports_what_it_did(capsys):
    call_command("seed_demo", "--days", "30")
    call_command("seed_demo")
    out = capsys.readouterr().out
    assert "Seeded 40 products" in out and "Demo data is current; kept" in out
    assert Product.objects.count() == 40


# --- rendering -----------------------------------------------------------------------------


def test_render_writes_the_pdf_under_media_root_with_a_generated_name(media_cleanup, admin_user):
    demo_seed(days=40)
    today = timezone.localdate()
    report = Report.objects.create(
        kind=ReportKind.SALES,
        owner=admin_user,
        params={
            "start": str(today - timedelta(days=6)),
            "end": str(today),
            "timezone": settings.TIME_ZONE,
        },
    )
    steps = []

    summary = services.report_render(
        report_id=report.pk, progress=lambda done, total, message: steps.append((done, total))
    )

    report.refresh_from_db()
    path = Path(settings.MEDIA_ROOT) / report.file.name
    assert (
        report.status == ReportStatus.READY
        and report.pages is not None
        and report.pages >= 1
        and report.size_bytes == path.stat().st_size
    )
    assert report.file.name == f"reports/{report.created_at:%Y/%m}/{report.uid.hex}.pdf"
    assert not list(path.parent.glob(f".{report.uid.hex}*"))  # no temporary file left behind
    reader, text = pdf_text(path.read_bytes())
    assert pdf_title(reader).startswith("Sales summary")
    assert "Sales summary" in text and "Top 10 products" in text
    assert [done for done, _ in steps] == list(range(9)) and {total for _, total in steps} == {8}
    assert summary["pages"] == report.pages

    # a second run (a redelivered message) keeps the file and does not render again
    stamp = path.stat().st_mtime_ns
    services.report_render(report_id=report.pk)
    assert path.stat().st_mtime_ns == stamp


def test_pdf_file_name_comes_from_the_token_only():
    token = uuid.UUID("12345678-1234-5678-1234-567812345678")
    assert (
        pdf_file_name(token=token, year=2025, month=3)
        == "reports/2025/03/12345678123456781234567812345678.pdf"
    )


# --- charts --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "days, size",
    [
        (1, "hour"),
        (2, "hour"),
        (3, "day"),
        (62, "day"),
        (63, "week"),
        (186, "week"),
        (187, "month"),
        (366, "month"),
    ],
)
def test_trend_granularity(days, size):
    assert bucket_size(days) == size


def test_buckets_cover_the_period():
    assert buckets(date(2025, 1, 30), date(2025, 2, 2), "day") == [
        date(2025, 1, 30),
        date(2025, 1, 31),
        date(2025, 2, 1),
        date(2025, 2, 2),
    ]
    assert buckets(date(2025, 1, 1), date(2025, 1, 14), "week") == [
        date(2024, 12, 30),
        date(2025, 1, 6),
        date(2025, 1, 13),
    ]
    assert buckets(date(2024, 11, 15), date(2025, 2, 1), "month") == [
        date(2024, 11, 1),
        date(2024, 12, 1),
        date(2025, 1, 1),
        date(2025, 2, 1),
    ]


@pytest.mark.parametrize(
    "day, hours", [(date(2025, 3, 9), 23), (date(2025, 7, 1), 24), (date(2025, 11, 2), 25)]
)
def test_hourly_buckets_follow_the_clock_change(day, hours):
    zone = ZoneInfo("America/New_York")
    found = buckets(day, day, "hour", zone)

    assert len(found) == hours
    assert found[0] == datetime.combine(day, datetime.min.time(), zone)
    instants = {bucket.astimezone(UTC) for bucket in found if isinstance(bucket, datetime)}
    assert len(instants) == hours


@pytest.mark.clock  # periods ending yesterday in New York, bucketed by hour, day, week, month
@pytest.mark.parametrize("days", [1, 20, 90, 300])
def test_trend_counts_every_job_at_each_granularity(days):
    zone = ZoneInfo("America/New_York")
    end = timezone.now().astimezone(zone).date() - timedelta(days=1)
    start = end - timedelta(days=days - 1)
    rng = random.Random(days)
    for _ in range(60):
        moment = datetime.combine(start, datetime.min.time(), zone) + timedelta(
            seconds=rng.uniform(0, days * 86400 - 1)
        )
        ledger_row(
            task="t", queue="default", state=JobState.SUCCEEDED, finished_at=moment, run_seconds=1
        )

    data = operations_data(
        OperationsParams(start=start, end=end, timezone=zone.key), lambda _: None
    )

    assert data["summary"]["jobs"] == 60
    assert sum(bar.total for bar in data["trend"].bars) == 60


def test_stacked_bars_scale_to_a_round_ceiling():
    chart = stacked_bars(
        [("a", {"ok": 30, "bad": 10}), ("b", {"ok": 70})],
        series=[("ok", "#00f", "OK"), ("bad", "#f00", "Bad")],
    )

    assert chart.gridlines[-1].label == "100"
    first, second = chart.bars
    assert [s.fill for s in first.segments] == ["#00f", "#f00"]
    plot = chart.gridlines[0].y - chart.gridlines[-1].y
    assert sum(s.height for s in first.segments) == pytest.approx(plot * 0.4, abs=0.02)
    assert second.segments[0].height == pytest.approx(plot * 0.7, abs=0.02)


def test_report_status_changes_move_only_from_the_statuses_they_name(admin_user):
    report = Report.objects.create(kind=ReportKind.SALES, owner=admin_user, params={})

    assert not report.mark_ready(file_name="x.pdf", pages=1, size_bytes=1, render_seconds=0.1)
    assert report.mark_rendering(job_id=str(uuid.uuid4())) and report.status == "rendering"
    assert report.mark_ready(file_name="x.pdf", pages=1, size_bytes=1, render_seconds=0.1)
    assert not report.mark_failed(error="late give-up")  # a ready report stays ready
    report.refresh_from_db()
    assert report.status == ReportStatus.READY and report.file.name == "x.pdf"
