"""Health and Prometheus metrics endpoints."""

from __future__ import annotations

import hmac

from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from .metrics import BacklotCollector
from .monitoring import health_report

_registry = CollectorRegistry(auto_describe=False)
_registry.register(BacklotCollector())


@never_cache
@require_GET
def health(request: HttpRequest) -> JsonResponse:
    status, details = health_report()
    return JsonResponse({"status": status, **details}, status=503 if status == "down" else 200)


@never_cache
@require_GET
def metrics(request: HttpRequest) -> HttpResponse:
    token = settings.BACKLOT["METRICS_TOKEN"]
    if token:
        given = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
        if not hmac.compare_digest(given.encode(), token.encode()):
            return HttpResponse("metrics need a bearer token\n", status=401, content_type="text/plain")
    return HttpResponse(generate_latest(_registry), content_type=CONTENT_TYPE_LATEST)
