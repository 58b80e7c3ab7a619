"""Emails end to end: a real worker sends over SMTP to a real (aiosmtpd) server."""

from __future__ import annotations

import os
import signal
import uuid

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from emails.models import EmailMessage, EmailStatus
from jobs import dead_letter_replay
from jobs.models import DeadLetter, Job, JobState
from tests.conftest import wait_until


def send(client, **payload):
    body = {
        "to": "jane.doe@example.com",
        "template": "test",
        "context": {"name": "Jane"},
        **payload,
    }
    return client.post("/api/emails/", body, content_type="application/json")


def final(job_id: str, timeout: float = 40) -> Job:
    return wait_until(
        lambda: Job.objects.filter(
            id=job_id, state__in=[JobState.SUCCEEDED, JobState.DEAD]
        ).first(),
        timeout=timeout,
        what=f"job {job_id} to finish",
    )


def test_api_sends_a_multipart_email(worker, mailbox, client, admin_user):
    client.force_login(admin_user)
    response = send(client)

    assert response.status_code == 202
    body = response.json()
    assert set(body) == {"job_id", "email_id", "status_url"}
    assert final(body["job_id"]).state == JobState.SUCCEEDED
    message = EmailMessage.objects.get(pk=body["email_id"])
    assert message.status == EmailStatus.SENT and message.sent_at and message.attempts == 1
    [received] = mailbox.received(f"<{message.uid}@backlot>")
    assert received["To"] == "jane.doe@example.com"
    assert received["Subject"] == "Backlot test message"
    assert received.get_content_type() == "multipart/alternative"
    parts = {
        part.get_content_type(): part.get_payload(decode=True).decode()
        for part in received.get_payload()
    }
    assert "Hello Jane," in parts["text/plain"] and "<h2>Test message</h2>" in parts["text/html"]


def test_the_message_row_is_inserted_with_its_job_id(client, admin_user, transactional_db):
    client.force_login(admin_user)

    # when: an email is accepted
    with CaptureQueriesContext(connection) as queries:
        response = send(client)

    # then: its row names its send job from its INSERT on: no UPDATE of it after the enqueue;
    # the job names the message by its uid, and the row and the job are one statement
    assert response.status_code == 202
    body = response.json()
    message = EmailMessage.objects.get(pk=body["email_id"])
    assert str(message.job_id) == body["job_id"]
    assert Job.objects.get(id=body["job_id"]).args == [str(message.uid)]
    table, jobs_table = EmailMessage._meta.db_table, Job._meta.db_table
    writes = [q["sql"] for q in queries.captured_queries if f'"{table}"' in q["sql"]]
    assert len(writes) == 1 and f'INSERT INTO "{jobs_table}"' in writes[0]


@pytest.mark.parametrize(
    "payload, field",
    [
        ({"to": "not-an-address"}, "to"),
        ({"template": "nope"}, "nope"),
        ({"context": "x"}, "context"),
    ],
)
def test_bad_input_is_400_and_queues_nothing(client, admin_user, payload, field, transactional_db):
    client.force_login(admin_user)
    with CaptureQueriesContext(connection) as queries:
        response = send(client, **payload)

    assert response.status_code in (400, 422)
    assert field in response.content.decode()
    # nothing the request wrote: not the table's count, which a session worker finishing an
    # earlier test's job may write a row into meanwhile (CI once counted 1)
    writes = [q["sql"] for q in queries.captured_queries if q["sql"].startswith(("INSERT", "COPY"))]
    assert EmailMessage.objects.count() == 0 and writes == []


def test_refused_recipient_is_permanent_with_the_reply(worker, mailbox, client, admin_user):
    mailbox.refuse["bounce.me@example.com"] = "550 5.1.1 <bounce.me@example.com>: Recipient unknown"
    client.force_login(admin_user)
    body = send(client, to="bounce.me@example.com").json()

    job = final(body["job_id"])
    assert job.state == JobState.DEAD and job.attempts == 1
    dead = DeadLetter.objects.get(job_id_value=body["job_id"])
    assert dead.exception_class == "jobs.core.policies.Permanent"
    assert "550 5.1.1" in dead.exception_message
    assert "b***@example.com" in dead.exception_message
    assert "bounce.me@" not in dead.exception_message + dead.traceback  # no personal data
    assert EmailMessage.objects.get(pk=body["email_id"]).status == EmailStatus.FAILED
    assert mailbox.received() == []


def test_deferred_recipient_is_retried(worker, mailbox, client, admin_user):
    mailbox.defer["later@example.com"] = ["451 4.7.1 Greylisted, try again"]
    client.force_login(admin_user)
    body = send(client, to="later@example.com").json()

    job = final(body["job_id"])
    assert job.state == JobState.SUCCEEDED and job.attempts == 2
    assert "451" in job.failures[0]["message"]
    assert len(mailbox.received()) == 1


def test_connection_refused_is_retried_until_the_server_is_back(
    worker, smtp_server, mailbox, client, admin_user
):
    smtp_server.stop()
    try:
        client.force_login(admin_user)
        body = send(client).json()
        wait_until(
            lambda: Job.objects.filter(id=body["job_id"], state=JobState.RETRYING).exists(),
            what="a failed attempt",
        )
    finally:
        smtp_server.start()

    job = final(body["job_id"], timeout=60)
    assert job.state == JobState.SUCCEEDED and job.attempts >= 2
    assert "ConnectionRefusedError" in job.failures[0]["message"]
    assert len(mailbox.received()) == 1


def kill_pool_processes(worker) -> None:
    for pid in worker.pool_pids():
        os.kill(pid, signal.SIGKILL)


def test_worker_killed_after_the_server_took_the_message_does_not_send_it_twice(
    worker, mailbox, client, admin_user
):
    # given the server holds its 250 reply after receiving the whole message
    mailbox.hold_at = "data"
    client.force_login(admin_user)
    body = send(client).json()
    wait_until(mailbox.held.is_set, what="the message to reach the SMTP server")

    # when the worker process dies right then (kill -9), before it hears the 250
    kill_pool_processes(worker)
    mailbox.release.set()

    # then the redelivered job does not send it again: it is flagged for an operator
    job = final(body["job_id"], timeout=60)
    message = EmailMessage.objects.get(pk=body["email_id"])
    assert len(mailbox.received(f"<{message.uid}@backlot>")) == 1
    assert message.status == EmailStatus.UNCONFIRMED
    assert job.state == JobState.DEAD and job.crashes == 1
    assert "unconfirmed" in DeadLetter.objects.get(job_id_value=body["job_id"]).exception_message


def test_worker_killed_before_the_message_left_sends_it_once(worker, mailbox, client, admin_user):
    mailbox.hold_at = "rcpt"  # the envelope is open, no message data yet
    client.force_login(admin_user)
    body = send(client).json()
    wait_until(mailbox.held.is_set, what="the SMTP transaction to start")

    kill_pool_processes(worker)
    mailbox.release.set()

    job = final(body["job_id"], timeout=60)
    message = EmailMessage.objects.get(pk=body["email_id"])
    assert job.state == JobState.SUCCEEDED and message.status == EmailStatus.SENT
    assert len(mailbox.received(f"<{message.uid}@backlot>")) == 1


def test_replaying_a_sent_message_does_not_send_it_again(worker, mailbox, client, admin_user):
    client.force_login(admin_user)
    body = send(client).json()
    final(body["job_id"])
    # an operator replays the send job (e.g. after a later failure of the same job)
    dead = DeadLetter.objects.create(
        job_id_value=uuid.uuid4(),
        task_name="emails.send",
        args=[body["email_id"]],
        kwargs={},
        queue="emails",
        exception_class="X",
        first_failed_at="2026-01-01T00:00Z",
        last_failed_at="2026-01-01T00:00Z",
    )

    replay = dead_letter_replay(dead_letter=dead)

    assert final(replay.id).state == JobState.SUCCEEDED
    assert len(mailbox.received()) == 1
