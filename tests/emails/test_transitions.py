"""The message's status changes: each moves only from the statuses it names."""

from __future__ import annotations

import pytest

from emails.models import EmailMessage, EmailStatus

pytestmark = pytest.mark.django_db


def message(status: str) -> EmailMessage:
    return EmailMessage.objects.create(to="a@example.com", subject="s", template="t", status=status)


def test_a_sent_message_never_moves_again():
    sent = message(EmailStatus.SENT)

    assert not sent.mark_sending()
    assert not sent.mark_deferred(provider_reply="451")
    assert not sent.mark_refused(provider_reply="550", error="refused")
    assert not sent.mark_failed(error="gave up")
    assert not sent.count_attempt()
    sent.refresh_from_db()
    assert sent.status == EmailStatus.SENT and sent.attempts == 0


def test_the_way_out_moves_the_row_and_the_instance():
    queued = message(EmailStatus.QUEUED)

    assert queued.count_attempt() and queued.attempts == 1
    assert queued.mark_sending() and queued.status == EmailStatus.SENDING
    assert queued.mark_sent(provider_message_id="<x@backlot>", provider_reply="250 ok")
    queued.refresh_from_db()
    assert queued.status == EmailStatus.SENT and queued.attempts == 1
    assert queued.provider_reply == "250 ok"


def test_only_a_message_being_sent_becomes_unconfirmed():
    assert not message(EmailStatus.QUEUED).mark_unconfirmed(error="lost")
    sending = message(EmailStatus.SENDING)
    assert sending.mark_unconfirmed(error="lost")
    assert not sending.mark_unconfirmed(error="again")  # the first reason is kept
    sending.refresh_from_db()
    assert sending.status == EmailStatus.UNCONFIRMED and sending.error == "lost"
