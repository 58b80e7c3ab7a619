from django.apps import AppConfig


class MediaPipelineConfig(AppConfig):
    default_auto_field = "django.db.models.BigAutoField"
    name = "media_pipeline"

    def ready(self) -> None:
        from . import job_descriptions

        job_descriptions.register()  # how "My jobs" names this app's jobs (jobs.describe_jobs)
