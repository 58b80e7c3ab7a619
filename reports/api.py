"""JSON API of reports (django-ninja router mounted in config/api.py)."""

from ninja import Router

router = Router(tags=["reports"])
