"""JSON API of media_pipeline (django-ninja router mounted in config/api.py)."""

from ninja import Router

router = Router(tags=["videos"])
