"""A real SMTP server for tests (aiosmtpd), with a mailbox tests can inspect and steer."""

from __future__ import annotations

import asyncio
import email
import socket
import threading
import time
from email.message import Message
from typing import Any

from aiosmtpd.controller import Controller


class Mailbox:
    """Messages the server accepted, plus knobs: refuse recipients, defer, hold mid-transaction."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self.lock:
            self.messages: list[Message] = []
            self.refuse: dict[str, str] = {}  # address -> SMTP reply, every time
            self.defer: dict[str, list[str]] = {}  # address -> replies, used up one per attempt
            self.hold_at: str | None = None  # "rcpt" or "data": stop there until released
            self.held = threading.Event()
            self.release = threading.Event()

    def received(self, message_id: str | None = None) -> list[Message]:
        with self.lock:
            return [m for m in self.messages if message_id is None or m["Message-ID"] == message_id]

    async def _hold(self, stage: str) -> None:
        if self.hold_at != stage:
            return
        self.held.set()
        deadline = time.monotonic() + 60
        while not self.release.is_set() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)

    async def handle_RCPT(
        self, server: Any, session: Any, envelope: Any, address: str, rcpt_options: list[str]
    ) -> str:
        with self.lock:
            if address in self.refuse:
                return self.refuse[address]
            if self.defer.get(address):
                return self.defer[address].pop(0)
        await self._hold("rcpt")
        envelope.rcpt_tos.append(address)
        return "250 OK"

    async def handle_DATA(self, server: Any, session: Any, envelope: Any) -> str:
        message = email.message_from_bytes(envelope.original_content or envelope.content)
        with self.lock:
            self.messages.append(message)
        await self._hold("data")  # the worst moment: the message is here, the 250 is not sent
        return "250 2.0.0 Message accepted for delivery"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class SMTPServer:
    def __init__(self) -> None:
        self.mailbox = Mailbox()
        self.port = _free_port()
        self.controller: Controller | None = None

    def start(self) -> None:
        self.controller = Controller(self.mailbox, hostname="127.0.0.1", port=self.port)
        self.controller.start()

    def stop(self) -> None:
        if self.controller is not None:
            self.controller.stop()
            self.controller = None
