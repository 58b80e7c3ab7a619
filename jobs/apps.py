from django.apps import AppConfig


class JobsConfig(AppConfig):
    default_auto_field = "django.db.models.BigAutoField"
    name = "jobs"
    verbose_name = "Jobs"

    def ready(self) -> None:
        # Imported here, not at module level: they need the app registry (models).
        from . import checks, signals, telemetry  # noqa: F401  (system checks, worker hooks)

        telemetry.connect()
