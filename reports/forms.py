"""The request form of the reports page; its rules are the API's (reports.schemas, .access)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django import forms
from django.utils import timezone

from . import access
from .exceptions import ReportInputError, ReportPermissionDenied
from .models import ReportKind
from .schemas import ReportRequest, report_input_parse


class ReportRequestForm(forms.Form):
    """A report request of `user`: it offers the kinds they may request and says to whom the PDF
    may be sent; a request they may not make is refused with the permission it needs."""

    # The field accepts every kind and only the menu is narrowed to the user's: a forged kind is
    # then refused by reports.access, naming its permission, as the API refuses it.
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
    # Set when the request is valid but not allowed: the page answers 403 with the form.
    refusal: ReportPermissionDenied | None = None

    def __init__(self, *args: Any, user: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.user = user
        self.kinds = access.kinds_allowed(user)
        self.fields["kind"].widget.choices = [(kind.value, kind.label) for kind in self.kinds]
        if self.kinds and self.initial.get("kind") not in self.kinds:
            self.initial["kind"] = self.kinds[0]
        own = access.own_address(user)
        email_to = self.fields["email_to"]
        if own:
            email_to.widget.attrs["placeholder"] = own
        if not user.has_perm(access.EMAIL_ELSEWHERE_PERMISSION):
            email_to.help_text = (
                f"Optional; your own address ({own}) only: "
                if own
                else "Leave empty: your account has no email address, and "
            ) + "other addresses need the permission to email reports elsewhere."

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
        try:
            access.report_request_authorize(request=self.report_request, user=self.user)
        except ReportPermissionDenied as exc:
            self.refusal = exc
            field = "email_to" if exc.permission == access.EMAIL_ELSEWHERE_PERMISSION else "kind"
            self.add_error(field, str(exc))
        return data
