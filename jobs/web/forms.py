"""The operator's forms: a dead letter's arguments, edited before it is replayed."""

from __future__ import annotations

import json
from typing import Any

from django import forms

from jobs.core.conf import backlot_settings
from jobs.core.exceptions import InvalidPayload
from jobs.core.payload import payload_check


class EditedReplayForm(forms.Form):
    args = forms.CharField(
        widget=forms.Textarea(attrs={"rows": 6, "cols": 80}), help_text="A JSON list."
    )
    kwargs = forms.CharField(
        widget=forms.Textarea(attrs={"rows": 6, "cols": 80}), help_text="A JSON object."
    )

    def __init__(self, *args: Any, task_name: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.task_name = task_name

    def _json(self, field: str, kind: type) -> Any:
        try:
            value = json.loads(self.cleaned_data[field])
        except json.JSONDecodeError as exc:
            raise forms.ValidationError(f"Not valid JSON: {exc}") from None
        if not isinstance(value, kind):
            raise forms.ValidationError(f"Must be a JSON {'list' if kind is list else 'object'}.")
        return value

    def clean_args(self) -> list:
        return self._json("args", list)

    def clean_kwargs(self) -> dict:
        return self._json("kwargs", dict)

    def clean(self) -> dict[str, Any] | None:
        data = super().clean()
        if data is not None and "args" in data and "kwargs" in data:
            try:
                payload_check(
                    task_name=self.task_name,
                    args=data["args"],
                    kwargs=data["kwargs"],
                    max_bytes=backlot_settings().MAX_PAYLOAD_BYTES,
                )
            except InvalidPayload as exc:
                raise forms.ValidationError(str(exc)) from None
        return data
