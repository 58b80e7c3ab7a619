"""Email jobs: thin wrappers that unpack ids and call emails.services (which never import this).

Each `<thing>_job` keeps the Celery name it was registered under, so messages already in a
queue, dead letters and the ledger's task names still find it. Cancelling a campaign's fan-out
job cancels the send jobs it queued; each job's on_cancelled hook marks its rows cancelled.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.conf import settings

from jobs import JobCancelled, RetryPolicy, job

from . import services


def _provider(args: tuple, kwargs: dict) -> str:
    """Rate-limit bucket and concurrency key: one per SMTP provider, shared by every worker."""
    return settings.EMAIL_HOST


def _email_gave_up(exc: BaseException, args: tuple, kwargs: dict) -> None:
    services.email_mark_failed(email_id=args[0], reason=f"{type(exc).__name__}: {exc}")


def _email_cancelled(args: tuple, kwargs: dict) -> None:
    services.email_cancelled(email_id=kwargs.get("email_id") or args[0])


def _import_gave_up(exc: BaseException, args: tuple, kwargs: dict) -> None:
    services.recipients_import_failed(
        import_id=int(kwargs.get("import_id") or args[0]),
        reason=f"the import job gave up: {type(exc).__name__}: {exc}",
    )


def _import_cancelled(args: tuple, kwargs: dict) -> None:
    services.recipients_import_failed(
        import_id=int(kwargs.get("import_id") or args[0]), reason="the import job was cancelled"
    )


def _fan_out_gave_up(exc: BaseException, args: tuple, kwargs: dict) -> None:
    services.campaign_fan_out_gave_up(
        campaign_id=int(kwargs.get("campaign_id") or args[0]),
        reason=f"the fan-out job gave up: {type(exc).__name__}: {exc}",
    )


def _campaign_cancelled(args: tuple, kwargs: dict) -> None:
    services.campaign_cancelled(campaign_id=int(kwargs.get("campaign_id") or args[0]))


def _callback_campaign(args: tuple, kwargs: dict) -> int:
    """The campaign of a batch callback: called as (batch id, campaign id)."""
    return int(kwargs.get("campaign_id") or args[1])


def _done_gave_up(exc: BaseException, args: tuple, kwargs: dict) -> None:
    services.campaign_fan_out_gave_up(
        campaign_id=_callback_campaign(args, kwargs),
        reason=f"the completion job gave up: {type(exc).__name__}: {exc}",
    )


def _done_cancelled(args: tuple, kwargs: dict) -> None:
    services.campaign_cancelled(campaign_id=_callback_campaign(args, kwargs))


@job(
    name="emails.send",
    queue="emails",
    bind=True,
    retry=RetryPolicy(max_attempts=6, base_delay=5, factor=3, max_delay=900),
    time_limit=120,
    rate_limit=settings.EMAIL_RATE_LIMIT,
    rate_key=_provider,
    concurrency=settings.EMAIL_CONCURRENCY,
    concurrency_key=_provider,
    on_dead=_email_gave_up,
    on_cancelled=_email_cancelled,
)
def email_send_job(self: Any, email_id: int | str) -> str:
    """Send the message `email_id`: its id, or its uid (see EmailMessageQuerySet.named)."""

    def stop_if_cancelled() -> None:
        # Right before DATA: the server has the envelope, not the body, so a send cancelled
        # while it waited on the server stops here and the message never goes out.
        if self.cancelled():
            raise JobCancelled(f"email {email_id} was cancelled before its body went out")

    return services.email_deliver(email_id=email_id, before_data=stop_if_cancelled)


@job(
    name="emails.campaign_fan_out",
    queue="emails",
    bind=True,
    time_limit=3600,
    retry=RetryPolicy(max_attempts=3, base_delay=10),
    on_dead=_fan_out_gave_up,
    on_cancelled=_campaign_cancelled,
)
def campaign_fan_out_job(self: Any, campaign_id: int) -> int:
    return services.campaign_fan_out_run(
        campaign_id=campaign_id, send_job=email_send_job, progress=self.progress
    )


@job(
    name="emails.campaign_done",
    queue="emails",
    retry=RetryPolicy(max_attempts=5, base_delay=5),
    on_dead=_done_gave_up,
    on_cancelled=_done_cancelled,
)
def campaign_done_job(batch_id: str, campaign_id: int) -> str:
    """The campaign batch's on_complete callback (fires once): the campaign is done (and its
    reminder, if it asked for one, is scheduled)."""
    return services.campaign_batch_completed(
        campaign_id=campaign_id, batch_id=batch_id, remind_job=campaign_remind_job
    )


@job(name="emails.campaign_remind", queue="emails", bind=True, retry=RetryPolicy(max_attempts=5))
def campaign_remind_job(self: Any, campaign_id: int) -> int:
    """A done campaign's reminder: a durable sleep of `remind_after` seconds (the row waits in
    the ledger, scheduled; no worker is held, and a restart or a Redis flush loses no time),
    then one step that queues a reminder per recipient sent. A retry after the step runs none
    again (jobs' durable steps). Returns the reminders queued."""
    after = services.campaign_remind_after(campaign_id=campaign_id)
    self.sleep(timedelta(seconds=after))
    return int(
        self.step(
            "remind", services.campaign_remind_run, campaign_id=campaign_id, send_job=email_send_job
        )
    )


@job(
    name="emails.recipients_import",
    queue="emails",
    bind=True,
    time_limit=3600,
    retry=RetryPolicy(max_attempts=3, base_delay=10),
    on_dead=_import_gave_up,
    on_cancelled=_import_cancelled,
)
def recipients_import_job(self: Any, import_id: int) -> dict[str, int]:
    row = services.recipients_import_run(import_id=import_id, progress=self.progress)
    return {"imported": row.imported, "duplicates": row.duplicates, "skipped": row.skipped}
