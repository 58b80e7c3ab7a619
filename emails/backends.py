"""An SMTP backend that tells the caller when the message body is about to go out.

Between the server's acceptance of the recipients and its 250 reply to DATA lies the only
moment a crash leaves it unknown whether the message was delivered. The send service marks the
message "sending" right there (`before_data`), so a redelivered job can tell "never reached the
server" (send it) from "may have been delivered" (do not send it twice).
"""

from __future__ import annotations

import smtplib
from collections.abc import Callable

from django.conf import settings
from django.core.mail.backends.smtp import EmailBackend
from django.core.mail.message import EmailMessage, sanitize_address


class TrackedSMTPBackend(EmailBackend):
    before_data: Callable[[], None] | None = None
    last_reply: tuple[int, bytes] | None = None

    def _send(self, email_message: EmailMessage) -> bool:
        if not email_message.recipients():
            return False
        encoding = email_message.encoding or settings.DEFAULT_CHARSET
        from_email = sanitize_address(email_message.from_email, encoding)
        recipients = [sanitize_address(addr, encoding) for addr in email_message.recipients()]
        body = email_message.message().as_bytes(linesep="\r\n")
        conn = self.connection
        if conn is None:  # send_messages() opens the connection before it calls _send()
            raise smtplib.SMTPServerDisconnected("please run connect() first")
        conn.ehlo_or_helo_if_needed()
        options = [f"size={len(body)}"] if conn.does_esmtp and conn.has_extn("size") else []
        code, reply = conn.mail(from_email, options)
        if code != 250:
            conn.rset()
            raise smtplib.SMTPSenderRefused(code, reply, from_email)
        refused = {}
        for recipient in recipients:
            code, reply = conn.rcpt(recipient)
            if code not in (250, 251):
                refused[recipient] = (code, reply)
        if refused:
            conn.rset()
            raise smtplib.SMTPRecipientsRefused(refused)
        if self.before_data is not None:
            self.before_data()
        code, reply = conn.data(body)
        if code != 250:
            conn.rset()
            raise smtplib.SMTPDataError(code, reply)
        self.last_reply = (code, reply)
        return True
