"""Backlot's Django project: loading the Celery app with Django makes @shared_task use it."""

from .celery import app as celery_app

__all__ = ("celery_app",)
