"""ActingAsMiddleware: jobs enqueued while a request is handled belong to its user."""

from __future__ import annotations

from collections.abc import Callable

from django.http import HttpRequest, HttpResponse

from jobs.core.context import acting_as


class ActingAsMiddleware:
    """Add after AuthenticationMiddleware. The request itself is what is acted for, so a user
    that the API's token authentication sets later is the one that counts."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        with acting_as(request):
            return self.get_response(request)
