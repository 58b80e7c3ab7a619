"""Django settings for django-tasks' database backend (peers venv only): the two apps, the
PostgreSQL database PEERS_DJTASKS_URL names, nothing else."""

from __future__ import annotations

import os
from urllib.parse import urlparse

_url = urlparse(os.environ.get("PEERS_DJTASKS_URL", "postgres://backlot@127.0.0.1:5432/x"))

SECRET_KEY = "bench-peers-only"
DEBUG = False
USE_TZ = True
INSTALLED_APPS = ["django_tasks", "django_tasks_db"]
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": _url.path.lstrip("/"),
        "USER": _url.username or "",
        "PASSWORD": _url.password or "",
        "HOST": _url.hostname or "",
        "PORT": str(_url.port or ""),
        "CONN_MAX_AGE": 60,
    }
}
TASKS = {"default": {"BACKEND": "django_tasks_db.DatabaseBackend"}}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
