"""Email jobs: thin wrappers that unpack ids and call emails.services (which never import this).

Each `<thing>_job` keeps the Celery name it was registered under, so messages already in a
queue, dead letters and the ledger's task names still find it.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings

from jobs import RetryPolicy, job

from . import services


def _provider(args: tuple, kwargs: dict) -> str:
    """Rate-limit bucket: one per SMTP provider, shared by every worker."""
    return settings.EMAIL_HOST


def _email_gave_up(exc: BaseException, args: tuple, kwargs: dict) -> None:
    services.email_mark_failed(email_id=args[0], reason=f"{type(exc).__name__}: {exc}")


@job(
    name="emails.send",
    queue="emails",
    retry=RetryPolicy(max_attempts=6, base_delay=5, factor=3, max_delay=900),
    time_limit=120,
    rate_limit=settings.EMAIL_RATE_LIMIT,
    rate_key=_provider,
    on_dead=_email_gave_up,
)
def email_send_job(email_id: int) -> str:
    return services.email_deliver(email_id=email_id)


@job(
    name="emails.campaign_fan_out",
    queue="emails",
    bind=True,
    time_limit=3600,
    retry=RetryPolicy(max_attempts=3, base_delay=10),
)
def campaign_fan_out_job(self: Any, campaign_id: int) -> int:
    return services.campaign_fan_out_run(
        campaign_id=campaign_id, send_job=email_send_job, progress=self.progress
    )


@job(
    name="emails.recipients_import",
    queue="emails",
    bind=True,
    time_limit=3600,
    retry=RetryPolicy(max_attempts=3, base_delay=10),
)
def recipients_import_job(self: Any, import_id: int) -> dict[str, int]:
    row = services.recipients_import_run(import_id=import_id, progress=self.progress)
    return {"imported": row.imported, "duplicates": row.duplicates, "skipped": row.skipped}
