"""System checks of the reports app."""

from __future__ import annotations

from reports.checks import check_report_recipients, check_report_schedules
from reports.conf import report_recipients


def test_recipients_are_read_from_the_environment(monkeypatch):
    monkeypatch.delenv("BACKLOT_REPORT_RECIPIENTS", raising=False)
    assert report_recipients() == []

    monkeypatch.setenv("BACKLOT_REPORT_RECIPIENTS", " ops@example.com, ,cto@example.com ")
    assert report_recipients() == ["ops@example.com", "cto@example.com"]
    assert check_report_recipients() == []


def test_a_bad_recipient_fails_the_check_without_echoing_it(monkeypatch):
    monkeypatch.setenv("BACKLOT_REPORT_RECIPIENTS", "ops@example.com,jane.doe at example")

    [error] = check_report_recipients()

    assert error.id == "reports.E001" and "entry 2" in error.msg
    assert "jane" not in error.msg


def test_declared_schedules_are_valid():
    assert check_report_schedules() == []
