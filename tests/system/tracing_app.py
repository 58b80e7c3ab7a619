"""A real web process for tests/system/test_tracing.py: the project's settings and WSGI
application (so config.tracing instruments it from OTEL_*), served by wsgiref on the port
given, with two views that enqueue test jobs the way a domain view does.

    python -m tests.system.tracing_app PORT
"""

from __future__ import annotations

import os
import signal
import sys

from django.http import HttpRequest, JsonResponse
from django.urls import path
from django.views.decorators.csrf import csrf_exempt


@csrf_exempt
def enqueue_flaky(request: HttpRequest) -> JsonResponse:
    from tests.support import tasks

    handle = tasks.flaky.using(queue="reports").enqueue(request.GET["key"], 1)
    return JsonResponse({"job_id": handle.id}, status=202)


@csrf_exempt
def enqueue_later(request: HttpRequest) -> JsonResponse:
    """A job due in an hour: it waits in the ledger and the relay publishes it."""
    from tests.support import tasks

    handle = tasks.record.using(queue="reports", delay=3600).enqueue(request.GET["key"], "late")
    return JsonResponse({"job_id": handle.id}, status=202)


urlpatterns = [path("flaky/", enqueue_flaky), path("later/", enqueue_later)]


def main(port: int) -> None:
    from wsgiref.simple_server import WSGIRequestHandler, make_server

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    from django.conf import settings

    settings.ROOT_URLCONF = "tests.system.tracing_app"
    from config.wsgi import application

    class Quiet(WSGIRequestHandler):
        def log_message(self, format: str, *args: object) -> None:
            pass

    server = make_server("127.0.0.1", port, application, handler_class=Quiet)
    # Stop as gunicorn does on SIGTERM: exit cleanly, so the SDK flushes its spans at exit.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print("serving", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main(int(sys.argv[1]))
