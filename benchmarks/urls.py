"""The project's URLs plus two benchmark views (used via benchmarks.settings only).

POST /bench/trivial/  answers at once: the floor of a request through the same middleware.
POST /bench/enqueue/  enqueues one Backlot no-op (ledger on) and answers 202 with its id,
                      the shape of every enqueue endpoint in the project.
POST /bench/delay/    the same with a bare Celery delay().
"""

from __future__ import annotations

from django.http import HttpRequest, JsonResponse
from django.urls import include, path
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST

from benchmarks import jobs as bench


@csrf_exempt
@require_POST
def trivial(request: HttpRequest) -> JsonResponse:
    return JsonResponse({"ok": True})


@csrf_exempt
@require_POST
def enqueue(request: HttpRequest) -> JsonResponse:
    handle = bench.noop.enqueue(request.POST.get("n", "0"))
    return JsonResponse({"job_id": handle.id, "status_url": handle.status_url}, status=202)


@csrf_exempt
@require_POST
def delay(request: HttpRequest) -> JsonResponse:
    result = bench.bare_noop.delay(request.POST.get("n", "0"))
    return JsonResponse({"task_id": result.id}, status=202)


urlpatterns = [
    path("bench/trivial/", trivial),
    path("bench/enqueue/", enqueue),
    path("bench/delay/", delay),
    path("", include("config.urls")),
]
