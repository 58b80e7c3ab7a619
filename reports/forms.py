"""The request form of the reports page; its rules are the API's (reports.schemas)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django import forms
from django.utils import timezone

from .exceptions import ReportInputError
from .models import ReportKind
from .schemas import ReportRequest, report_input_parse


class ReportRequestForm(forms.Form):
    kind = forms.ChoiceField(label="Report", choices=ReportKind.choices)
    start = forms.DateField(label="From", widget=forms.DateInput(attrs={"type": "date"}))
    end = forms.DateField(label="To (included)", widget=forms.DateInput(attrs={"type": "date"}))
    email_to = forms.CharField(
        label="Email it to",
        required=False,
        help_text="Optional; comma-separated addresses.",
        widget=forms.TextInput(attrs={"placeholder": "you@example.com"}),
    )

    report_request: ReportRequest | None = None

    @classmethod
    def initial_values(cls) -> dict[str, Any]:
        today = timezone.localdate()
        return {"kind": ReportKind.OPERATIONS, "start": today - timedelta(days=29), "end": today}

    def clean(self) -> dict[str, Any]:
        super().clean()
        data = self.cleaned_data
        if self.errors:
            return data
        try:
            self.report_request = report_input_parse(
                {
                    "kind": data["kind"],
                    "params": {"start": data["start"].isoformat(), "end": data["end"].isoformat()},
                    "email_to": data.get("email_to", ""),
                }
            )
        except ReportInputError as exc:
            for error in exc.errors:
                names = [str(part) for part in error["loc"] if str(part) in self.fields]
                self.add_error(names[-1] if names else None, error["msg"])
        return data
