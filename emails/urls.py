"""Pages of emails."""

from django.urls import path  # noqa: F401

app_name = "emails"
urlpatterns: list = []
