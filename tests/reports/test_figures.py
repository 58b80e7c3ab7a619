"""reports.figures: a report's template context as JSON (a durable step's result) and back."""

from __future__ import annotations

from datetime import UTC, date, datetime
from decimal import Decimal

import pytest

from reports.charts import Bar, Chart, Gridline, Segment
from reports.figures import figures_dump, figures_load
from reports.schemas import OperationsParams


def test_the_types_a_template_reads_come_back_as_they_were():
    chart = Chart(
        width=600, height=200, plot_left=40.0, plot_right=590.0, label_y=190.0,
        bars=[Bar(x=1.0, width=2.0, center=2.0, label="01 Dec", show_label=True, total=3.0,
                  segments=[Segment(y=1.0, height=2.0, fill="#0a0")])],
        gridlines=[Gridline(y=1.0, text_y=2.0, label="10")],
        legend=[("#0a0", "Succeeded")],
    )  # fmt: skip
    period = OperationsParams.model_construct(
        timezone="America/New_York", start=date(2026, 11, 1), end=date(2026, 11, 30)
    )
    context = {
        "generated_at": datetime(2026, 12, 2, 9, 0, tzinfo=UTC),
        "day": date(2026, 12, 1),
        "revenue": Decimal("1234.50"),
        "trend": chart,
        "previous_period": period,
        "rows": [{"task_name": "shop.invoice", "count": 3, "share": 0.5, "note": None}],
    }

    back = figures_load(figures_dump(context))

    assert back["generated_at"] == context["generated_at"] and back["day"] == context["day"]
    assert back["revenue"] == Decimal("1234.50") and isinstance(back["revenue"], Decimal)
    assert back["trend"].bars[0].segments[0].fill == "#0a0"
    assert back["trend"].legend == [["#0a0", "Succeeded"]]  # JSON has no tuples
    assert isinstance(back["previous_period"], OperationsParams)
    assert (
        back["previous_period"].days == 30 and back["previous_period"].timezone == period.timezone
    )
    assert back["rows"] == context["rows"]


@pytest.mark.parametrize(
    ("value", "named"),
    [({"x": object()}, "object"), ({1: "a"}, "plain text keys"), ({"$date": "x"}, "plain text")],
)
def test_a_value_figures_cannot_keep_is_refused_by_name(value, named):
    with pytest.raises(TypeError, match=named):
        figures_dump(value)
