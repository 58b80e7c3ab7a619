"""Bearer-token authentication for the JSON API (tokens are stored hashed)."""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest
from django.utils import timezone
from ninja.security import HttpBearer

from .models import ApiToken


class TokenAuth(HttpBearer):
    def authenticate(self, request: HttpRequest, token: str) -> Any:
        found = (
            ApiToken.objects.select_related("user").filter(key_hash=ApiToken.hash(token)).first()
        )
        if found is None or not found.user.is_active:
            return None
        ApiToken.objects.filter(pk=found.pk).update(last_used_at=timezone.now())
        request.user = found.user
        return found.user
