"""The project's JSON API (django-ninja): session auth with CSRF, OpenAPI at /api/openapi.json."""

from ninja import NinjaAPI
from ninja.security import django_auth

from jobs.api import router as jobs_router

api = NinjaAPI(title="Backlot API", version="1", auth=django_auth, urls_namespace="api-1")
api.add_router("/jobs/", jobs_router)
