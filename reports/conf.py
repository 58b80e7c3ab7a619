"""Settings of the reports app, read from the environment when used (workers read their own)."""

from __future__ import annotations

import os

RECIPIENTS_VARIABLE = "BACKLOT_REPORT_RECIPIENTS"


def report_recipients() -> list[str]:
    """Who gets the scheduled reports by email: BACKLOT_REPORT_RECIPIENTS, comma-separated.

    Empty (the default) means scheduled reports are rendered and kept, not emailed.
    reports.checks validates the addresses at start-up (`manage.py check`).
    """
    raw = os.environ.get(RECIPIENTS_VARIABLE, "")
    return [address.strip() for address in raw.split(",") if address.strip()]
