"""The Celery app: Django settings under the CELERY namespace, then Backlot's defaults."""

import os

from celery import Celery
from celery.signals import setup_logging

import jobs.worker.celery
from config.tracing import trace_worker_processes

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")

app = Celery("backlot")
app.config_from_object("django.conf:settings", namespace="CELERY")
jobs.worker.celery.configure(app)
app.autodiscover_tasks()
trace_worker_processes()  # OpenTelemetry, when OTEL_* asks for it (config/tracing.py)


@setup_logging.connect
def use_django_logging(**kwargs: object) -> None:
    """Workers log through Django's LOGGING (masked, optionally JSON), not Celery's own setup."""
    import logging.config

    from django.conf import settings

    logging.config.dictConfig(settings.LOGGING)
