"""Email work: render, queue, deliver exactly once, campaigns and their CSV imports."""

from __future__ import annotations

import contextlib
import csv
import logging
import smtplib
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from celery import signature
from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.mail import EmailMultiAlternatives, get_connection
from django.core.validators import validate_email
from django.db import transaction
from django.template import TemplateDoesNotExist
from django.template.loader import get_template, render_to_string

from jobs import (
    AlreadyFinished,
    BacklotError,
    Permanent,
    Retryable,
    batch,
    cancel,
    enqueue_many,
    json_problem,
    mask_text,
)
from jobs.models import Job

from .models import (
    Campaign,
    CampaignRecipient,
    CampaignStatus,
    EmailMessage,
    EmailStatus,
    RecipientImport,
)

if TYPE_CHECKING:
    # PlatformTask[P, R] is what @job returns: a job passed in is checked against its arguments.
    from jobs import JobHandle, PlatformTask

logger = logging.getLogger(__name__)

# Recipients per fan-out transaction and import chunk: 1,000 rows keep each transaction
# short (~50 ms on PostgreSQL here) while a 100,000-row campaign takes 100 round trips.
CHUNK = 1000
# The campaign batch's on_complete callback (emails.tasks.campaign_done_job), by name: this
# module never imports the tasks.
CAMPAIGN_DONE_TASK = "emails.campaign_done"
# A campaign's reminder: at most 30 days after it is done, its subject prefixed.
MAX_REMIND_AFTER = 30 * 86_400
REMINDER_PREFIX = "Reminder: "
# Bad CSV rows kept with their reason; the rest are only counted.
MAX_REPORTED_ERRORS = 1000


class EmailError(BacklotError, ValueError):
    """Bad input for an email: unknown template, invalid address, unsafe attachment."""


class CampaignNotDraft(EmailError):
    """Recipients may join a campaign only while it is a draft (the API answers 409)."""


# A CSV import reads at most this many data rows (settings.EMAIL_IMPORT_MAX_ROWS overrides):
# a 100,000-row file imports in ~40 s on one worker; a larger list is a data migration.
DEFAULT_IMPORT_MAX_ROWS = 100_000


def email_templates() -> list[str]:
    """Template names that have an HTML part, a text part and a subject under templates/emails/."""
    folder = Path(settings.BASE_DIR) / "templates" / "emails"
    names = []
    for html in sorted(folder.glob("*.html")):
        name = html.stem
        if (folder / f"{name}.txt").exists() and (folder / f"{name}_subject.txt").exists():
            names.append(name)
    return names


def email_check_template(template: str) -> None:
    try:
        get_template(f"emails/{template}.html")
        get_template(f"emails/{template}.txt")
    except TemplateDoesNotExist:
        raise EmailError(
            f"Unknown email template {template!r}; available: {', '.join(email_templates())}"
        ) from None


def email_check_context(context: dict[str, Any]) -> dict[str, Any]:
    problem = json_problem(context, "context")
    if problem:
        raise EmailError(f"Invalid template context: {problem}.")
    return context


def email_check_address(address: str) -> str:
    try:
        validate_email(address)
    except ValidationError:
        raise EmailError("Enter a valid email address.") from None
    return address.strip()


def _attachment_path(relative: str) -> Path:
    root = Path(settings.MEDIA_ROOT).resolve()
    path = (root / relative).resolve()
    if root not in path.parents or not path.is_file():
        raise EmailError(f"Attachment {relative!r} is not a file under MEDIA_ROOT")
    return path


def email_render(
    *, template: str, context: dict[str, Any], subject: str = ""
) -> tuple[str, str, str]:
    """(subject, text, html) of a template rendered with `context`."""
    text = render_to_string(f"emails/{template}.txt", context)
    html = render_to_string(f"emails/{template}.html", context)
    if not subject:
        subject = render_to_string(f"emails/{template}_subject.txt", context)
    return " ".join(subject.split())[:255], text, html


def email_queue(
    *,
    to: str,
    template: str,
    context: dict[str, Any],
    subject: str | None = None,
    attachments: Sequence[str] = (),
    owner: Any = None,
    send_job: PlatformTask[[int | str], str],
) -> tuple[EmailMessage, JobHandle]:
    """Accept one email: the message row and its `send_job` (emails.tasks.email_send_job),
    committed together: on PostgreSQL one statement (the row inserted `alongside` the job),
    where a transaction around the two INSERTs cost three more round trips (BEGIN, the
    message's INSERT, COMMIT). The job names the message by its uid: its id is not known
    before that statement."""
    to = email_check_address(to)
    email_check_template(template)
    email_check_context(context)
    for relative in attachments:
        _attachment_path(relative)
    rendered_subject, _, _ = email_render(template=template, context=context, subject=subject or "")
    # The job's id is chosen first, so the message row is inserted with it: no UPDATE after the
    # enqueue (one database round trip of the API's POST /api/emails/).
    job_id = uuid.uuid4()
    message = EmailMessage(
        to=to,
        subject=rendered_subject,
        template=template,
        context=context,
        attachments=list(attachments),
        owner=owner if getattr(owner, "pk", None) else None,
        job_id=job_id,
    )
    handle = send_job.using(
        owner=owner, idempotency_key=f"email:{message.uid}", job_id=job_id, alongside=message
    ).enqueue(str(message.uid))
    if handle.id != str(job_id):  # the key was another job's (it names this new message)
        message.job_id = uuid.UUID(handle.id)
        message.save(update_fields=["job_id"])
    return message, handle


def _build(message: EmailMessage, connection: Any) -> EmailMultiAlternatives:
    subject, text, html = email_render(
        template=message.template, context=message.context, subject=message.subject
    )
    mail = EmailMultiAlternatives(
        subject=subject,
        body=text,
        to=[message.to],
        connection=connection,
        headers={"Message-ID": f"<{message.uid}@backlot>"},
    )
    mail.attach_alternative(html, "text/html")
    for relative in message.attachments:
        mail.attach_file(str(_attachment_path(relative)))
    return mail


def _reply_text(code: int, reply: bytes | str) -> str:
    text = reply.decode(errors="replace") if isinstance(reply, bytes) else str(reply)
    return mask_text(f"{code} {text}")[:500]


def email_deliver(*, email_id: int | str, before_data: Callable[[], None] | None = None) -> str:
    """Send one message unless it was sent (or may have been): the effect happens once.

    Transient failures (refused connection, timeout, SMTP 4xx) raise Retryable and leave the
    message queued; a refused recipient (5xx) raises Permanent. A message found "sending" was
    being sent by a worker that died after the server took the envelope: it may have arrived,
    so it becomes "unconfirmed" and goes to the dead letters instead of out again.
    `before_data` is called once the server took the envelope, before the body goes out; what
    it raises (the job's progress call: JobCancelled) aborts the send with the message queued.
    A cancelled message is not sent.
    """
    with transaction.atomic():
        message = EmailMessage.objects.select_for_update().named(email_id).get()
        if message.status == EmailStatus.QUEUED:
            message.count_attempt()
        elif message.status == EmailStatus.SENDING:
            message.mark_unconfirmed(error="A worker died while sending it.")
    if message.status == EmailStatus.SENT:
        logger.info("Email %s already sent; not sending again", email_id)
        return message.provider_message_id
    if message.status == EmailStatus.UNCONFIRMED:
        raise Permanent(
            f"Email {email_id}: delivery unconfirmed (a worker died during the SMTP "
            f"transaction); check the mail server for Message-ID <{message.uid}@backlot> "
            "before sending it again"
        )
    if message.status == EmailStatus.FAILED:
        raise Permanent(f"Email {email_id} failed for good: {message.error}")
    if message.status == EmailStatus.CANCELLED:
        logger.info("Email %s was cancelled; not sending it", email_id)
        return ""

    connection = get_connection(fail_silently=False)
    data_started = False

    def mark_sending() -> None:
        nonlocal data_started
        if before_data is not None:
            before_data()
        data_started = True
        message.mark_sending()

    if hasattr(connection, "before_data"):
        connection.before_data = mark_sending
    else:  # file/console backends in development: no SMTP conversation to hook into
        mark_sending()
    try:
        connection.send_messages([_build(message, connection)])
    except smtplib.SMTPRecipientsRefused as exc:
        replies = [_reply_text(code, reply) for code, reply in exc.recipients.values()]
        if all(400 <= code < 500 for code, _ in exc.recipients.values()):
            message.mark_deferred(provider_reply=replies[0])
            raise Retryable(f"Recipient deferred: {replies[0]}") from None
        message.mark_refused(provider_reply=replies[0], error=f"Recipient refused: {replies[0]}")
        raise Permanent(f"Recipient refused: {replies[0]}") from None
    except smtplib.SMTPResponseException as exc:
        reply = _reply_text(exc.smtp_code, exc.smtp_error)
        if 400 <= exc.smtp_code < 500:
            message.mark_deferred(provider_reply=reply)
            raise Retryable(f"SMTP server deferred: {reply}") from None
        message.mark_refused(provider_reply=reply, error=f"SMTP server refused: {reply}")
        raise Permanent(f"SMTP server refused: {reply}") from None
    except (TimeoutError, smtplib.SMTPServerDisconnected, smtplib.SMTPConnectError, OSError) as exc:
        detail = mask_text(f"{type(exc).__name__}: {exc}")
        if data_started:
            message.mark_unconfirmed(error=f"Connection lost during DATA: {detail}")
            raise Permanent(
                f"Email {email_id}: delivery unconfirmed, connection lost during DATA"
            ) from None
        message.mark_deferred(provider_reply=detail[:500])
        raise Retryable(f"SMTP unavailable: {detail}") from None
    finally:
        connection.close()
    last = getattr(connection, "last_reply", None)
    provider_message_id = f"<{message.uid}@backlot>"
    if message.mark_sent(
        provider_message_id=provider_message_id,
        provider_reply=_reply_text(*last) if last else "",
    ):
        _campaign_settle(message)
    return provider_message_id


def email_mark_failed(*, email_id: int | str, reason: str) -> None:
    """The send job gave up: a message still queued is failed (sent/unconfirmed ones stay).

    Every failed outcome (refused, unconfirmed, out of attempts) ends here, through the job's
    on_dead hook: the message's campaign is settled too.
    """
    message = EmailMessage.objects.named(email_id).first()
    if message is not None:
        message.mark_failed(error=mask_text(reason)[:2000])
        _campaign_settle(message)


def email_cancelled(*, email_id: int | str) -> None:
    """The send job was cancelled: a message not yet out is cancelled (a sent one stays sent)
    and its campaign settled."""
    message = EmailMessage.objects.named(email_id).first()
    if message is not None and message.mark_cancelled():
        _campaign_settle(message)


def _campaign_settle(message: EmailMessage) -> None:
    """A message reached its outcome: a campaign started before batches (no batch_id) is done
    once none is pending. A campaign on a batch is done by the batch's on_complete callback."""
    campaign = Campaign.objects.filter(
        recipients__email_message=message, status=CampaignStatus.SENDING, batch_id__isnull=True
    ).first()
    if campaign is not None:
        campaign.mark_done()


# --- campaigns ---------------------------------------------------------------------------


def campaign_create(
    *,
    name: str,
    template: str,
    context: dict[str, Any],
    subject: str = "",
    owner: Any = None,
    recipients: Sequence[dict[str, str]] = (),
    remind_after: int | None = None,
) -> Campaign:
    email_check_template(template)
    email_check_context(context)
    if remind_after is not None and not 1 <= remind_after <= MAX_REMIND_AFTER:
        raise EmailError(f"remind_after: between 1 and {MAX_REMIND_AFTER} seconds (30 days)")
    for field, value in (("name", name), ("subject", subject)):
        if "\x00" in value:
            raise EmailError(f"{field} contains a NUL character.")
    with transaction.atomic():
        campaign = Campaign.objects.create(
            name=name,
            template=template,
            context=context,
            subject=subject,
            owner=owner if getattr(owner, "pk", None) else None,
            remind_after=remind_after,
        )
        rows = []
        for index, recipient in enumerate(recipients):
            try:
                address = email_check_address(recipient["email"]).lower()
            except (EmailError, KeyError):
                raise EmailError(f"recipients[{index}]: enter a valid email address") from None
            name = recipient.get("name", "").replace("\x00", "")
            rows.append(CampaignRecipient(campaign=campaign, email=address, name=name))
        CampaignRecipient.objects.bulk_create(rows, ignore_conflicts=True, batch_size=CHUNK)
    return campaign


def campaign_start(
    *, campaign: Campaign, owner: Any = None, fan_out_job: PlatformTask[[int], int]
) -> JobHandle:
    """Start a draft campaign: its batch opens with the `fan_out_job`
    (emails.tasks.campaign_fan_out_job) as its first member, and the campaign is sending,
    together; EmailError when it was started before.

    The fan-out job keeps the batch open while it adds each chunk's send jobs to it; the
    batch's on_complete callback (emails.campaign_done) marks the campaign done, once.
    """
    if campaign.status != CampaignStatus.DRAFT:
        raise EmailError(f"Campaign {campaign.pk} is already {campaign.status}")
    with transaction.atomic():
        with batch(
            description=f"Campaign {campaign.pk}: {campaign.name}"[:255],
            on_complete=signature(CAMPAIGN_DONE_TASK, args=(campaign.pk,)),
            owner=owner if getattr(owner, "pk", None) else campaign.owner,
        ) as sending:
            handle = fan_out_job.using(
                owner=owner, idempotency_key=f"campaign:{campaign.pk}"
            ).enqueue(campaign.pk)
        if not campaign.mark_sending(job_id=handle.id, batch_id=sending.id):  # started meanwhile
            raise EmailError(f"Campaign {campaign.pk} is already started")
    return handle


def campaign_batch_completed(
    *, campaign_id: int, batch_id: str, remind_job: PlatformTask[[int], int] | None = None
) -> str:
    """The campaign's batch completed (every send job and the fan-out ended): a sending
    campaign is done. Returns its status. A campaign with `remind_after` gets its reminder
    job (`remind_job`, emails.tasks.campaign_remind_job) in the same transaction: it sleeps
    until the reminder is due without holding a worker, then sends it."""
    campaign = Campaign.objects.filter(pk=campaign_id, batch_id=batch_id).first()
    if campaign is None:
        raise Permanent(f"Campaign {campaign_id} has no batch {batch_id}")
    with transaction.atomic():
        done = campaign.mark_done()
        if done and campaign.remind_after and remind_job is not None:
            handle = remind_job.using(
                owner=campaign.owner, idempotency_key=f"campaign-reminder:{campaign.pk}"
            ).enqueue(campaign.pk)
            Campaign.objects.filter(pk=campaign.pk).update(reminder_job_id=handle.id)
    if not done:
        campaign.refresh_from_db(fields=["status"])
        if campaign.status == CampaignStatus.SENDING:
            logger.warning(
                "Campaign %s: its batch completed with recipients never fanned out (the "
                "fan-out job gave up); it stays sending",
                campaign_id,
            )
    return str(campaign.status)


def campaign_fan_out_run(
    *,
    campaign_id: int,
    send_job: PlatformTask[[int], str],
    progress: Callable[[int, int, str], None] | None = None,
) -> int:
    """One message and one `send_job` (emails.tasks.email_send_job) per recipient, in chunks;
    safe to run again.

    A recipient gets its message in the same transaction as the message's job rows, so a
    re-run after a crash skips everyone already fanned out.
    """
    campaign = Campaign.objects.get(pk=campaign_id)
    pending = campaign.recipients.filter(email_message__isnull=True)
    total = campaign.recipients.count()
    fanned = total - pending.count()
    while True:
        with transaction.atomic():
            # The campaign's row lock: campaign_cancel waits for a chunk being fanned out, and
            # once it is cancelled no further chunk starts.
            locked = Campaign.objects.select_for_update().filter(pk=campaign_id)
            if list(locked.values_list("status", flat=True)) == [CampaignStatus.CANCELLED]:
                logger.info("Campaign %s is cancelled; fan-out stops", campaign_id)
                break
            chunk = list(pending.select_for_update(skip_locked=True).order_by("pk")[:CHUNK])
            if not chunk:
                break
            messages = _campaign_messages(campaign, chunk)
            EmailMessage.objects.bulk_create(messages)
            # The chunk's send jobs join the campaign's batch in this transaction (the fan-out
            # job, still running, keeps it open); one started before batches has none.
            joining = (
                batch(campaign.batch_id)
                if campaign.batch_id is not None
                else contextlib.nullcontext()
            )
            with joining:
                job_ids = enqueue_many(
                    send_job, [((m.pk,), {}) for m in messages], owner=campaign.owner
                )
            for recipient, message, job_id in zip(chunk, messages, job_ids, strict=True):
                recipient.email_message = message
                message.job_id = uuid.UUID(job_id)
            CampaignRecipient.objects.bulk_update(chunk, ["email_message"])
            EmailMessage.objects.bulk_update(messages, ["job_id"])
        fanned += len(chunk)
        if progress:
            progress(fanned, total, f"{fanned} of {total} recipients queued")
    return fanned


def _campaign_messages(
    campaign: Campaign, recipients: Sequence[CampaignRecipient], *, prefix: str = ""
) -> list[EmailMessage]:
    """One unsaved message per recipient, rendered from the campaign's template."""
    messages = []
    for recipient in recipients:
        context = {**campaign.context, **recipient.data, "name": recipient.name}
        subject, _, _ = email_render(
            template=campaign.template, context=context, subject=campaign.subject
        )
        messages.append(
            EmailMessage(
                to=recipient.email,
                subject=f"{prefix}{subject}"[:255],
                template=campaign.template,
                context=context,
                owner=campaign.owner,
            )
        )
    return messages


def campaign_remind_after(*, campaign_id: int) -> int:
    """How long a campaign's reminder sleeps after the campaign is done (seconds)."""
    after = Campaign.objects.filter(pk=campaign_id).values_list("remind_after", flat=True).first()
    if not after:
        raise Permanent(f"Campaign {campaign_id} asks for no reminder")
    return int(after)


def campaign_remind_run(*, campaign_id: int, send_job: PlatformTask[[int], str]) -> int:
    """The reminder of a done campaign: one message ("Reminder: " and the campaign's subject)
    and one `send_job` per recipient whose campaign message was sent; safe to run again (a
    recipient gets its reminder in the transaction of the reminder's job rows, so a re-run
    skips everyone reminded). A campaign that is not done (cancelled since) sends none.
    Returns the number of reminders queued by this run."""
    campaign = Campaign.objects.get(pk=campaign_id)
    if campaign.status != CampaignStatus.DONE:
        logger.info("Campaign %s is %s: no reminder", campaign_id, campaign.status)
        return 0
    pending = campaign.recipients.filter(
        email_message__status=EmailStatus.SENT, reminder_message__isnull=True
    )
    queued = 0
    while True:
        with transaction.atomic():
            chunk = list(pending.select_for_update(skip_locked=True).order_by("pk")[:CHUNK])
            if not chunk:
                break
            messages = _campaign_messages(campaign, chunk, prefix=REMINDER_PREFIX)
            EmailMessage.objects.bulk_create(messages)
            job_ids = enqueue_many(
                send_job, [((m.pk,), {}) for m in messages], owner=campaign.owner
            )
            for recipient, message, job_id in zip(chunk, messages, job_ids, strict=True):
                recipient.reminder_message = message
                message.job_id = uuid.UUID(job_id)
            CampaignRecipient.objects.bulk_update(chunk, ["reminder_message"])
            EmailMessage.objects.bulk_update(messages, ["job_id"])
        queued += len(chunk)
    logger.info("Campaign %s: %d reminder(s) queued", campaign_id, queued)
    return queued


def campaign_cancel(*, campaign: Campaign, by: Any = None) -> int:
    """Stop a sending campaign: no more messages are fanned out or sent; those sent stay sent.

    The campaign is cancelled first (under its row lock, so a chunk being fanned out commits
    before and no later chunk starts), then its fan-out job is cancelled with the send jobs it
    queued, then the send job of every message still queued (the fan-out job may have finished
    long ago). Each send job's on_cancelled hook marks its message cancelled; a send job already
    talking to the server stops before the body goes out. Returns the number of send jobs
    cancelled or asked to stop; EmailError when the campaign is not sending.
    """
    if not campaign.mark_cancelled():
        campaign.refresh_from_db(fields=["status"])
        raise EmailError(f"Campaign {campaign.pk} is {campaign.status}, not sending")
    if campaign.job_id is not None:
        # Finished: it fanned out already, and its send jobs are cancelled one by one below.
        with contextlib.suppress(AlreadyFinished, Job.DoesNotExist):
            cancel(campaign.job_id, by=by)
    stopped = _campaign_cancel_pending(campaign, by=by)
    logger.info("Campaign %s cancelled; %s send jobs stopped", campaign.pk, stopped)
    return stopped


def campaign_fan_out_gave_up(*, campaign_id: int, reason: str) -> bool:
    """The fan-out job (or the batch's completion job) was dead-lettered: a sending campaign
    is failed, with the reason."""
    campaign = Campaign.objects.filter(pk=campaign_id).first()
    return campaign is not None and campaign.mark_failed(error=reason[:2000])


def campaign_cancelled(*, campaign_id: int) -> None:
    """The fan-out job was cancelled (by campaign_cancel, the jobs API or admin): the campaign
    is cancelled, with every message still queued."""
    campaign = Campaign.objects.filter(pk=campaign_id).first()
    if campaign is not None:
        campaign.mark_cancelled()
        _campaign_cancel_pending(campaign, by=None)


def _campaign_cancel_pending(campaign: Campaign, *, by: Any) -> int:
    """Cancel the send job of each of the campaign's messages still queued."""
    stopped = 0
    queued = EmailMessage.objects.filter(
        recipient__campaign=campaign, status=EmailStatus.QUEUED, job_id__isnull=False
    )
    for message in queued.only("pk", "job_id", "status").iterator(chunk_size=CHUNK):
        try:
            cancel(message.job_id, by=by)
            stopped += 1
        except AlreadyFinished as exc:
            if exc.state == "cancelled":
                message.mark_cancelled()  # its hook did not get to say so
        except Job.DoesNotExist:
            pass
    return stopped


# --- CSV import -------------------------------------------------------------------------


def recipients_import_create(
    *,
    campaign: Campaign,
    upload: IO[bytes],
    owner: Any = None,
    import_job: PlatformTask[[int], dict[str, int]],
) -> tuple[RecipientImport, JobHandle]:
    """Store the uploaded CSV under a generated name and queue its `import_job`
    (emails.tasks.recipients_import_job). A campaign that is no longer a draft takes no
    recipients: CampaignNotDraft, nothing stored."""
    if campaign.status != CampaignStatus.DRAFT:
        raise CampaignNotDraft(
            f"Campaign {campaign.pk} is {campaign.status}: recipients may be imported only "
            "into a draft campaign."
        )
    relative = f"imports/{uuid.uuid4().hex}.csv"
    path = Path(settings.MEDIA_ROOT) / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as out:
        for block in iter(lambda: upload.read(1 << 16), b""):
            out.write(block)
    with transaction.atomic():
        row = RecipientImport.objects.create(
            campaign=campaign, file=relative, owner=owner if getattr(owner, "pk", None) else None
        )
        handle = import_job.using(owner=owner, idempotency_key=f"import:{row.pk}").enqueue(row.pk)
        RecipientImport.objects.filter(pk=row.pk).update(job_id=handle.id)
    return row, handle


class ImportRefused(EmailError):
    """The CSV cannot be imported past `row` (1 = the header): `reason` says why."""

    def __init__(self, row: int, reason: str) -> None:
        super().__init__(f"row {row}: {reason}")
        self.row = row
        self.reason = reason


class _CountingLines:
    """Lines of a binary file decoded as UTF-8, counting bytes read (for progress); a line that
    is not UTF-8 is refused (ImportRefused with its row), not imported garbled."""

    def __init__(self, handle: IO[bytes]) -> None:
        self.handle = handle
        self.bytes_read = 0
        self.row = 1  # the CSV row the next line belongs to (set by the reader's loop)

    def __iter__(self) -> Iterator[str]:
        first = True
        for raw in self.handle:
            self.bytes_read += len(raw)
            try:
                yield raw.decode("utf-8-sig" if first else "utf-8")
            except UnicodeDecodeError as exc:
                raise ImportRefused(
                    self.row, f"not UTF-8 (byte 0x{raw[exc.start]:02x} at column {exc.start + 1})"
                ) from None
            first = False


def import_max_rows() -> int:
    return int(getattr(settings, "EMAIL_IMPORT_MAX_ROWS", DEFAULT_IMPORT_MAX_ROWS))


def recipients_import_failed(*, import_id: int, reason: str, row: int | None = None) -> bool:
    """The import's job ended without finishing it (dead-lettered or cancelled): the import is
    failed, with the reason; one that already ended keeps its outcome."""
    record = RecipientImport.objects.filter(pk=import_id).first()
    if record is None:
        return False
    errors = [*record.errors[: MAX_REPORTED_ERRORS - 1], {"row": row, "reason": reason}]
    return record.mark_failed(errors=errors)


def recipients_import_run(
    *, import_id: int, progress: Callable[[int, int, str], None] | None = None
) -> RecipientImport:
    """Import a CSV (header with an `email` column; `name` and others optional) in chunks.

    Streams the file (a 100,000-row CSV never sits in memory), skips and reports bad rows
    with their row number, and is safe to run again: known recipients count as duplicates.
    A file that cannot be read on (a field over csv's field limit, a line that is not UTF-8,
    more rows than EMAIL_IMPORT_MAX_ROWS) or a campaign that is no longer a draft ends the
    import failed with the row number, raising Permanent: the rows before stay imported.
    """
    record = RecipientImport.objects.select_related("campaign").get(pk=import_id)
    path = Path(settings.MEDIA_ROOT) / record.file
    size = path.stat().st_size or 1
    if not record.mark_running():
        logger.info("Import %s is already %s; not run again", import_id, record.status)
        return record
    counts = {"rows_read": 0, "imported": 0, "duplicates": 0, "skipped": 0}
    errors: list[dict[str, Any]] = []
    try:
        if record.campaign.status != CampaignStatus.DRAFT:
            raise ImportRefused(1, f"the campaign is {record.campaign.status}, not a draft")
        _import_rows(record, path, size, counts, errors, progress)
    except (ImportRefused, csv.Error) as exc:
        row = exc.row if isinstance(exc, ImportRefused) else counts["rows_read"] + 2
        reason = exc.reason if isinstance(exc, ImportRefused) else _csv_reason(exc)
        record.record_counts(counts=counts, errors=errors)
        recipients_import_failed(import_id=import_id, reason=reason, row=row)
        raise Permanent(f"Import {import_id}: row {row}: {reason}") from None
    record.mark_done(counts=counts, errors=errors)
    if progress:
        progress(size, size, f"{counts['imported']} imported, {counts['skipped']} skipped")
    return record


def _csv_reason(exc: csv.Error) -> str:
    if "field larger than field limit" in str(exc):
        return f"a field is longer than {csv.field_size_limit()} characters"
    return f"not readable as CSV ({exc})"


def _import_rows(
    record: RecipientImport,
    path: Path,
    size: int,
    counts: dict[str, int],
    errors: list[dict[str, Any]],
    progress: Callable[[int, int, str], None] | None,
) -> None:
    limit = import_max_rows()
    with open(path, "rb") as handle:
        lines = _CountingLines(handle)
        reader = csv.DictReader(lines)
        fields = [f.strip().lower() for f in (reader.fieldnames or [])]
        if "email" not in fields:
            raise ImportRefused(1, "no 'email' column in the header")
        reader.fieldnames = fields
        chunk: dict[str, CampaignRecipient] = {}
        lines.row = 2
        try:
            for number, row in enumerate(reader, start=2):  # row 1 is the header
                lines.row = number + 1
                if number - 1 > limit:
                    raise ImportRefused(number, f"more than {limit} rows (EMAIL_IMPORT_MAX_ROWS)")
                counts["rows_read"] += 1
                address = (row.get("email") or "").strip().lower()
                try:
                    validate_email(address)
                except ValidationError:
                    counts["skipped"] += 1
                    if len(errors) < MAX_REPORTED_ERRORS:
                        errors.append(
                            {
                                "row": number,
                                "reason": "invalid email address" if address else "email is empty",
                            }
                        )
                    continue
                if address in chunk:
                    counts["duplicates"] += 1
                    continue
                extra = {
                    k.replace("\x00", ""): (v or "").replace("\x00", "")
                    for k, v in row.items()
                    if k and k not in ("email", "name") and isinstance(v, str)
                }
                chunk[address] = CampaignRecipient(
                    campaign=record.campaign,
                    email=address,
                    data=extra,
                    name=(row.get("name") or "").replace("\x00", "").strip()[:200],
                )
                if len(chunk) >= CHUNK:
                    _import_chunk(record, chunk, counts)
                    record.record_counts(counts=counts, errors=errors)
                    if progress:
                        progress(lines.bytes_read, size, f"{counts['rows_read']} rows read")
        except (ImportRefused, csv.Error):
            _import_chunk(record, chunk, counts)  # the rows before the refused one stay
            raise
        _import_chunk(record, chunk, counts)


def _import_chunk(
    record: RecipientImport, chunk: dict[str, CampaignRecipient], counts: dict[str, int]
) -> None:
    if not chunk:
        return
    known = set(
        CampaignRecipient.objects.filter(
            campaign=record.campaign, email__in=list(chunk)
        ).values_list("email", flat=True)
    )
    fresh = [r for address, r in chunk.items() if address not in known]
    CampaignRecipient.objects.bulk_create(fresh, ignore_conflicts=True, batch_size=CHUNK)
    counts["imported"] += len(fresh)
    counts["duplicates"] += len(known)
    chunk.clear()
