"""Alerts: a degraded health check warns (log line + email to ADMINS) once per cause per
interval, and says so again when the cause clears."""

from __future__ import annotations

import logging
import re

from django.core.mail import mail_admins

from jobs.broker.redis import redis_client, redis_text
from jobs.core.conf import backlot_settings
from jobs.web.monitoring import health_report

logger = logging.getLogger("backlot.alerts")

ACTIVE = "backlot:alerts:active"  # set of causes currently alerted
SENT = "backlot:alerts:sent:"  # + cause: present while the interval since the last alert runs


def cause_of(problem: str) -> str:
    """A problem's stable identity: its text with the numbers taken out."""
    return re.sub(r"\d+(\.\d+)?", "N", problem)


def alerts_check() -> dict[str, list[str]]:
    """Compare health with the alerted causes; alert new ones, announce recoveries."""
    status, details = health_report()
    problems = (
        details["checks"].get("problems", []) if status != "down" else ["database or Redis down"]
    )
    client = redis_client()
    interval = backlot_settings().ALERT_INTERVAL
    current = {cause_of(p): p for p in problems}
    fired, recovered = [], []
    for cause, problem in current.items():
        if client.set(SENT + cause, 1, nx=True, ex=interval):
            client.sadd(ACTIVE, cause)
            logger.warning("Jobs health %s: %s", status, problem)
            mail_admins(
                f"jobs {status}: {problem}", f"{problem}\n\nHealth: {status}\n", fail_silently=True
            )
            fired.append(problem)
    for raw in client.smembers(ACTIVE):
        cause = redis_text(raw)
        if cause not in current:
            client.srem(ACTIVE, cause)
            client.delete(SENT + cause)
            logger.info("Jobs health recovered: %s", cause)
            mail_admins(f"jobs recovered: {cause}", f"Cleared: {cause}\n", fail_silently=True)
            recovered.append(cause)
    return {"fired": fired, "recovered": recovered}
