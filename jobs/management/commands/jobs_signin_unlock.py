"""Lift a sign-in lockout (jobs.web.throttle): manage.py jobs_signin_unlock --account NAME
and/or --address IP. An account's lockout covers the login page and the admin's; an address's
also covers bearer tokens tried from it."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from jobs.web import throttle


class Command(BaseCommand):
    help = "Lift the sign-in lockout of an account and/or a client address."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--account", help="the account's username")
        parser.add_argument("--address", help="the client's IP address")

    def handle(self, *args: Any, account: str | None, address: str | None, **options: Any) -> None:
        if not account and not address:
            raise CommandError("Name an --account, an --address or both.")
        lifted = throttle.lift(account=account, address=address)
        # the account is not echoed: operators' terminals end up in logs too
        self.stdout.write(f"{lifted} lockout bucket(s) lifted.")
