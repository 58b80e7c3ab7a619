"""API tokens: bearer keys for the JSON API, stored as their SHA-256."""

from __future__ import annotations

import hashlib
import secrets
from typing import Any

from django.conf import settings
from django.db import models
from django.utils import timezone


class ApiToken(models.Model):
    """A bearer token for the JSON API; only its SHA-256 is stored."""

    user = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        on_delete=models.CASCADE,
        related_name="api_tokens",
        verbose_name="user",
        help_text="The API acts as this user.",
    )
    name = models.CharField("name", max_length=100, help_text="What the token is for.")
    key_hash = models.CharField(
        "key hash", max_length=64, unique=True, help_text="SHA-256 of the key."
    )
    created_at = models.DateTimeField("created", default=timezone.now, help_text="Issued.")
    last_used_at = models.DateTimeField(
        "last used", null=True, blank=True, help_text="Last request."
    )

    class Meta:
        # Created by the jobs app (jobs 0002) before the model moved here: the table keeps its name.
        db_table = "jobs_apitoken"
        verbose_name = "API token"
        verbose_name_plural = "API tokens"

    def __str__(self) -> str:
        return f"{self.name} ({self.user})"

    @staticmethod
    def hash(key: str) -> str:
        return hashlib.sha256(key.encode()).hexdigest()

    @classmethod
    def issue(cls, *, user: Any, name: str) -> tuple[ApiToken, str]:
        """Create a token; the plain key is returned once and never stored."""
        key = secrets.token_urlsafe(32)
        return cls.objects.create(user=user, name=name, key_hash=cls.hash(key)), key
