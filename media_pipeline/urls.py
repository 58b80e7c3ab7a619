"""Pages of media_pipeline."""

from django.urls import path  # noqa: F401

app_name = "media_pipeline"
urlpatterns: list = []
