from django.apps import AppConfig
from django.db.models.signals import post_migrate


class ReportsConfig(AppConfig):
    default_auto_field = "django.db.models.BigAutoField"
    name = "reports"
    verbose_name = "Reports"

    def ready(self) -> None:
        from . import (
            checks,  # noqa: F401  (registers system checks)
            job_descriptions,
        )
        from .schedules import schedules_sync_after_migrate

        # Once per `migrate` (sender=this app): declared schedules into django-celery-beat.
        post_migrate.connect(
            schedules_sync_after_migrate, sender=self, dispatch_uid="reports.schedules_sync"
        )
        job_descriptions.register()  # how "My jobs" names this app's jobs (jobs.describe_jobs)
