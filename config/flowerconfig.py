"""Flower settings (celery -A config flower --conf=config/flowerconfig.py).

Flower 2.2 serves /metrics without authentication even when basic auth is on; Backlot puts
it behind the same login as every other Flower page.
"""

from flower.views.monitor import Metrics
from tornado import web

Metrics.get = web.authenticated(Metrics.get)
