"""The upload form of the videos page."""

from __future__ import annotations

from django import forms

from .models import RenditionFormat


class VideoUploadForm(forms.Form):
    file = forms.FileField(
        label="Video file",
        widget=forms.ClearableFileInput(attrs={"accept": "video/*"}),
    )
    formats = forms.MultipleChoiceField(
        label="Formats",
        choices=RenditionFormat.choices,
        initial=RenditionFormat.values,
        widget=forms.CheckboxSelectMultiple,
        error_messages={"required": "Choose at least one format."},
    )
