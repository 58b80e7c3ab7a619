"""ASGI entry point."""

import os

from django.core.asgi import get_asgi_application

from config.tracing import configure_tracing

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
configure_tracing(web=True)  # OpenTelemetry, when OTEL_* asks for it (config/tracing.py)
application = get_asgi_application()
