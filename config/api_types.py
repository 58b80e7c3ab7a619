"""The request type of the JSON API's views: what ninja's authentication leaves on it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from django.http import HttpRequest

if TYPE_CHECKING:
    from django.contrib.auth.models import User


class AuthenticatedRequest(HttpRequest):
    """A request that passed the API's auth (config.api: a bearer token or the session).

    Ninja sets `auth` to what the authenticator returned, the user in both cases. For type
    checking only: a view still receives Django's own request object.
    """

    auth: User
