"""The project's JSON API (django-ninja): session auth with CSRF, or a bearer token.

OpenAPI at /api/openapi.json, interactive docs at /api/docs.
"""

from django.db import DataError
from django.http import HttpRequest, HttpResponse
from ninja import NinjaAPI
from ninja.security import django_auth

from emails.api import router as emails_router
from jobs.web.api import router as jobs_router
from jobs.web.api_batches import router as batches_router
from jobs.web.api_queues import router as queues_router
from media_pipeline.api import router as videos_router
from reports.api import router as reports_router
from web.auth import TokenAuth

api = NinjaAPI(
    title="Backlot API", version="1", auth=[TokenAuth(), django_auth], urls_namespace="api-1"
)


@api.exception_handler(DataError)
def database_refused_input(request: HttpRequest, exc: DataError) -> HttpResponse:
    """Input the database cannot store (e.g. a NUL character) is the client's error: 400."""
    return api.create_response(
        request, {"detail": "The input contains characters that cannot be stored."}, status=400
    )


api.add_router("/jobs/", jobs_router)
api.add_router("/batches/", batches_router)
api.add_router("/queues/", queues_router)
api.add_router("/", emails_router)
api.add_router("/reports/", reports_router)
api.add_router("/videos/", videos_router)
