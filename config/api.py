"""The project's JSON API (django-ninja): session auth with CSRF, or a bearer token (web.auth:
unknown tokens throttled per address, 429 with Retry-After; no credentials: 401 naming them).

OpenAPI at /api/openapi.json, interactive docs at /api/docs.
"""

from django.conf import settings
from django.core.exceptions import RequestDataTooBig
from django.db import DataError
from django.http import HttpRequest, HttpResponse
from ninja import NinjaAPI
from ninja.errors import AuthenticationError, HttpError, Throttled

from emails.api import router as emails_router
from jobs.web.api import router as jobs_router
from jobs.web.api_batches import router as batches_router
from jobs.web.api_queues import router as queues_router
from media_pipeline.api import router as videos_router
from reports.api import router as reports_router
from web.api_input import ApiParser, InputRefused, body_limit_of, refusal_response, too_large
from web.auth import MISSING_CREDENTIALS, SessionAuth, TokenAuth

api = NinjaAPI(
    title="Backlot API",
    version="1",
    auth=[TokenAuth(), SessionAuth()],
    urls_namespace="api-1",
    parser=ApiParser(),  # one JSON parser for every route (web.api_input)
)


@api.exception_handler(InputRefused)
def input_refused(request: HttpRequest, exc: InputRefused) -> HttpResponse:
    """A body over its limit (413) or text the API does not take (400), naming the field."""
    return refusal_response(exc)


@api.exception_handler(HttpError)
def http_error(request: HttpRequest, exc: HttpError) -> HttpResponse:
    """ninja wraps what the body parser raises in HttpError(400, "Cannot parse request body"):
    the parser's own refusal is the answer."""
    if isinstance(exc.__cause__, InputRefused):
        return refusal_response(exc.__cause__)
    if isinstance(exc, AuthenticationError):
        # no credentials, or a token that is not one: say which (RFC 9110 WWW-Authenticate)
        given = "Authorization" in request.headers
        detail = "The bearer token is not valid." if given else MISSING_CREDENTIALS
        response = api.create_response(request, {"detail": detail}, status=401)
        response["WWW-Authenticate"] = 'Bearer realm="api"'
        return response
    response = api.create_response(request, {"detail": str(exc)}, status=exc.status_code)
    if isinstance(exc, Throttled) and exc.wait:
        response["Retry-After"] = str(exc.wait)  # whole seconds (web.auth)
    return response


@api.exception_handler(RequestDataTooBig)
def body_too_big(request: HttpRequest, exc: RequestDataTooBig) -> HttpResponse:
    """A body past DATA_UPLOAD_MAX_MEMORY_SIZE, which Django refuses to read: 413 as well,
    naming the route's JSON limit, or for form data the form limit Django applied."""
    declared = str(request.META.get("CONTENT_LENGTH") or "")
    size = int(declared) if declared.isdigit() else None
    if "json" in (request.content_type or ""):
        limit = body_limit_of(request)
    else:
        limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
    return refusal_response(too_large(limit, size))


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
