"""System checks: configuration mistakes fail `manage.py check`, not the first job at 3 a.m."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.checks import Error, Tags, Warning, register

from .ratelimit import parse_rate


@register(Tags.compatibility)
def check_celery_settings(app_configs: Any = None, **kwargs: Any) -> list[Any]:
    problems: list[Any] = []
    accepted = set(settings.CELERY_ACCEPT_CONTENT) | set(settings.CELERY_RESULT_ACCEPT_CONTENT)
    if accepted - {"json", "application/json"}:
        problems.append(
            Error(
                f"Celery accepts {sorted(accepted)}; only JSON is allowed (pickle runs code).",
                hint="Set CELERY_ACCEPT_CONTENT = ['json'].",
                id="jobs.E001",
            )
        )
    visibility = settings.CELERY_BROKER_TRANSPORT_OPTIONS.get("visibility_timeout", 3600)
    held = settings.BACKLOT["MAX_BROKER_COUNTDOWN"] + settings.BACKLOT["RATE_LIMIT_MAX_RESERVE"]
    if held >= visibility:
        problems.append(
            Error(
                f"Countdowns up to {held:.0f}s may sit in Redis but the visibility timeout is "
                f"{visibility}s: Redis would deliver those jobs twice.",
                hint="Lower BACKLOT['MAX_BROKER_COUNTDOWN'] or raise visibility_timeout.",
                id="jobs.E002",
            )
        )
    return problems


@register(Tags.compatibility)
def check_jobs(app_configs: Any = None, **kwargs: Any) -> list[Any]:
    from .registry import platform_tasks

    problems: list[Any] = []
    for task in platform_tasks():
        if task.queue_name not in settings.BACKLOT_QUEUES:
            problems.append(
                Error(
                    f"Job {task.name} uses queue {task.queue_name!r}, which is not configured.",
                    hint=f"Use one of {', '.join(settings.BACKLOT_QUEUES)}.",
                    obj=task.name,
                    id="jobs.E003",
                )
            )
        limit = task.cluster_rate_limit
        for rate in (limit.values() if isinstance(limit, dict) else [limit]):
            if rate is None:
                continue
            try:
                parse_rate(rate)
            except ValueError as exc:
                problems.append(Error(str(exc), obj=task.name, id="jobs.E004"))
        if task.policy.max_attempts > 1 and not task.policy.retry_on:
            problems.append(
                Warning(f"Job {task.name} allows retries but retries no exception.", id="jobs.W001")
            )
    return problems
