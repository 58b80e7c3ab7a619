"""The Celery app: configured from Django settings under the CELERY namespace."""

import os

import billiard.common
from celery import Celery
from celery.signals import setup_logging

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
# SIGTERM (a deploy) should drain for CELERY_WORKER_SOFT_SHUTDOWN_TIMEOUT, then requeue what is
# left; Celery does that only when SIGTERM is remapped to SIGQUIT, a flag billiard reads at import.
billiard.common.REMAP_SIGTERM = os.environ.setdefault("REMAP_SIGTERM", "SIGQUIT")

app = Celery("backlot")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


@setup_logging.connect
def use_django_logging(**kwargs: object) -> None:
    """Workers log through Django's LOGGING (masked, optionally JSON), not Celery's own setup."""
    import logging.config

    from django.conf import settings

    logging.config.dictConfig(settings.LOGGING)
