from django.apps import AppConfig


class JobsConfig(AppConfig):
    default_auto_field = "django.db.models.BigAutoField"
    name = "jobs"
    verbose_name = "Jobs"

    def ready(self) -> None:
        from . import checks, signals  # noqa: F401  (registers system checks and worker hooks)
