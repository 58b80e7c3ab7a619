"""Authentication of the JSON API: bearer tokens (stored hashed) or the Django session.

Unknown bearer tokens count against the client's address (jobs.throttle): past
TOKEN_FAILURES_PER_ADDRESS, every token from that address is refused 429 with Retry-After until
the lockout passes or an operator lifts it. The session is asked only of a signed-in user, and
only then is CSRF checked: an anonymous request is told which credentials it lacks (401), not
that its CSRF token is missing.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.http import HttpRequest
from django.utils import timezone
from ninja.errors import Throttled
from ninja.security import HttpBearer
from ninja.security import SessionAuth as DjangoSessionAuth

from jobs import throttle

from .models import ApiToken

# What a request without credentials is told (config.api: 401 with WWW-Authenticate: Bearer).
MISSING_CREDENTIALS = (
    "Authentication required: send 'Authorization: Bearer <token>' (a token from "
    "manage.py api_token), or sign in at /accounts/login/ and send the session cookie with "
    "an X-CSRFToken header."
)
# How fresh a token's last_used_at is kept: written when it is older than this, so a client
# busy on the API costs one UPDATE a minute, not one per request (the admin shows it to the
# minute; a revoked or deactivated token is refused on its next request all the same).
LAST_USED_RESOLUTION = timedelta(minutes=1)


class TokenAuth(HttpBearer):
    def authenticate(self, request: HttpRequest, token: str) -> Any:
        address = throttle.client_address(request)
        # the token is looked up while Redis answers whether the address is locked out; a
        # locked-out address is refused whatever the token
        with throttle.lockout_asked(throttle.TOKEN, address=address) as answer:
            found = ApiToken.objects.for_key(token)
            lockout = answer()
        if lockout is not None:
            raise Throttled(wait=lockout.retry_after)
        if found is None or not found.user.is_active:
            throttle.failed(throttle.TOKEN, address=address)
            return None
        now = timezone.now()
        if found.last_used_at is None or now - found.last_used_at >= LAST_USED_RESOLUTION:
            ApiToken.objects.filter(pk=found.pk).update(last_used_at=now)
        request.user = found.user
        return found.user


class SessionAuth(DjangoSessionAuth):
    """Django's session, for a signed-in user only: CSRF is checked for that user's requests;
    an anonymous one falls through to the API's 401."""

    def __call__(self, request: HttpRequest) -> Any:
        user = getattr(request, "user", None)
        if user is None or not user.is_authenticated:
            return None
        return super().__call__(request)
