from django.apps import AppConfig


class EmailsConfig(AppConfig):
    default_auto_field = "django.db.models.BigAutoField"
    name = "emails"

    def ready(self) -> None:
        from . import job_descriptions

        job_descriptions.register()  # how "My jobs" names this app's jobs (jobs.describe_jobs)
