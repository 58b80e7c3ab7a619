"""ActingAsMiddleware: jobs enqueued while a request is handled belong to its user.
SignInThrottleMiddleware: sign-in pages refuse attempts while their account or address is locked
out (jobs.web.throttle)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.contrib.auth import get_user_model
from django.contrib.auth.signals import user_logged_in, user_login_failed
from django.dispatch import receiver
from django.http import HttpRequest, HttpResponse

from jobs.core.conf import backlot_settings
from jobs.core.context import acting_as
from jobs.web import throttle


class ActingAsMiddleware:
    """Add after AuthenticationMiddleware. The request itself is what is acted for, so a user
    that the API's token authentication sets later is the one that counts."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        with acting_as(request):
            return self.get_response(request)


def _account_of(data: Any) -> str | None:
    field = get_user_model().USERNAME_FIELD
    value = data.get(field) or data.get("username")
    return str(value) if value else None


class SignInThrottleMiddleware:
    """A POST to a sign-in view (BACKLOT['SIGNIN_VIEWS']: the login page and the admin's) while
    its account or client address is locked out is answered 429 with Retry-After, before the
    password is checked. Failures are recorded from Django's user_login_failed signal, so any
    view that calls authenticate() with the request counts them."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        return self.get_response(request)

    def process_view(
        self, request: HttpRequest, view: Any, args: Any, kwargs: Any
    ) -> HttpResponse | None:
        match = request.resolver_match
        if request.method != "POST" or match is None:
            return None
        if match.view_name not in backlot_settings().SIGNIN_VIEWS:
            return None
        lockout = throttle.locked_out(
            throttle.SIGNIN,
            address=throttle.client_address(request),
            account=_account_of(request.POST),
        )
        if lockout is None:
            return None
        response = HttpResponse(lockout.message(), status=429, content_type="text/plain")
        response["Retry-After"] = str(lockout.retry_after)
        return response


@receiver(user_login_failed, dispatch_uid="backlot-signin-failed")
def _signin_failed(sender: Any, credentials: dict[str, Any], request: Any = None, **_: Any) -> None:
    if request is None:  # authenticate() outside a request: no address to hold it against
        return
    throttle.failed(
        throttle.SIGNIN, address=throttle.client_address(request), account=_account_of(credentials)
    )


@receiver(user_logged_in, dispatch_uid="backlot-signin-passed")
def _signin_passed(sender: Any, request: Any, user: Any, **_: Any) -> None:
    throttle.succeeded(account=str(user.get_username()))
