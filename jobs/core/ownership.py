"""Who may read a row: the one ownership queryset every app with owned rows builds on."""

from __future__ import annotations

from typing import Any, Self, TypeVar

from django.db import models

_Model = TypeVar("_Model", bound=models.Model)


class OwnedQuerySet(models.QuerySet[_Model]):
    """A queryset of rows that belong to a user through `owner_field` (a foreign key).

    Subclass it (or use it as is) for a model with an owner; set `owner_field` when the
    foreign key has another name.
    """

    owner_field = "owner"

    def visible_to(self, user: Any) -> Self:
        """Rows `user` may read: their own; all of them for active staff; none when anonymous."""
        if getattr(user, "is_staff", False) and getattr(user, "is_active", False):
            return self
        if not getattr(user, "is_authenticated", False):
            return self.none()
        return self.filter(**{self.owner_field: user})

    def owned_by(self, user: Any) -> Self:
        """Rows that belong to `user`, whoever asks (a staff member's own list, for instance)."""
        return self.filter(**{self.owner_field: user})
