"""The reference project's site pieces that are not about jobs: API tokens, upload limits, log
formatters, the home page, admin bootstrap commands."""

from django.apps import AppConfig


class WebConfig(AppConfig):
    default_auto_field = "django.db.models.BigAutoField"
    name = "web"
