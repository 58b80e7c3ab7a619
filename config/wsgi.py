"""WSGI entry point (gunicorn config.wsgi:application)."""

import os

from django.core.wsgi import get_wsgi_application

from config.tracing import configure_tracing

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
configure_tracing(web=True)  # OpenTelemetry, when OTEL_* asks for it (config/tracing.py)
application = get_wsgi_application()
