"""JSON API of emails (django-ninja router mounted in config/api.py)."""

from ninja import Router

router = Router(tags=["emails"])
