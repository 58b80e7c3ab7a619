"""The project's URLs plus two benchmark views (used via benchmarks.settings only).

POST /bench/trivial/  answers at once: the floor of a request through the same middleware.
POST /bench/enqueue/  enqueues one Backlot no-op (ledger on) and answers 202 with its id,
                      the shape of every enqueue endpoint in the project.
POST /bench/delay/    the same with a bare Celery delay().

The parts of the project's POST /api/emails/ beyond an enqueue, each alone (issue 26, item 6):
POST /bench/token/       the API's bearer-token authentication (lockout check, token lookup).
POST /bench/render/      the email's templates rendered (subject, text, HTML).
POST /bench/idempotent/  the no-op's enqueue holding an idempotency key (its record's row).
POST /bench/gated/       the enqueue of a no-op behind emails.send's gates (a keyed rate limit
                         and concurrency limit: it is parked at them).
"""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest, JsonResponse
from django.urls import include, path
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST

from benchmarks import jobs as bench
from emails.services import email_render
from web.auth import TokenAuth

_token_auth = TokenAuth()


def _accepted(handle: Any) -> JsonResponse:
    """202 with the job's id and status URL, as every enqueue endpoint of the project answers."""
    return JsonResponse({"job_id": handle.id, "status_url": handle.status_url}, status=202)


@csrf_exempt
@require_POST
def trivial(request: HttpRequest) -> JsonResponse:
    return JsonResponse({"ok": True})


@csrf_exempt
@require_POST
def enqueue(request: HttpRequest) -> JsonResponse:
    handle = bench.noop.enqueue(request.POST.get("n", "0"))
    return _accepted(handle)


@csrf_exempt
@require_POST
def delay(request: HttpRequest) -> JsonResponse:
    result = bench.bare_noop.delay(request.POST.get("n", "0"))
    return JsonResponse({"task_id": result.id}, status=202)


@csrf_exempt
@require_POST
def token(request: HttpRequest) -> JsonResponse:
    bearer = request.headers.get("Authorization", "").removeprefix("Bearer ")
    user = _token_auth.authenticate(request, bearer)
    if user is None:
        return JsonResponse({"detail": "unknown token"}, status=401)
    return JsonResponse({"user": user.pk})


@csrf_exempt
@require_POST
def render(request: HttpRequest) -> JsonResponse:
    subject, text, html = email_render(template="test", context={"name": request.POST["name"]})
    return JsonResponse({"subject": subject, "length": len(text) + len(html)})


@csrf_exempt
@require_POST
def idempotent(request: HttpRequest) -> JsonResponse:
    key = request.POST["key"]
    handle = bench.noop.using(idempotency_key=key).enqueue(request.POST.get("n", "0"))
    return _accepted(handle)


@csrf_exempt
@require_POST
def gated(request: HttpRequest) -> JsonResponse:
    handle = bench.gated.enqueue(request.POST.get("n", "0"))
    return _accepted(handle)


urlpatterns = [
    path("bench/trivial/", trivial),
    path("bench/enqueue/", enqueue),
    path("bench/delay/", delay),
    path("bench/token/", token),
    path("bench/render/", render),
    path("bench/idempotent/", idempotent),
    path("bench/gated/", gated),
    path("", include("config.urls")),
]
