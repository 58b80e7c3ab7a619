"""Issue a bearer token for the JSON API: manage.py api_token USERNAME --name NAME."""

from typing import Any

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError, CommandParser

from web.models import ApiToken


class Command(BaseCommand):
    help = "Issue an API token for a user; the key is printed once."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("username")
        parser.add_argument("--name", default="cli")

    def handle(self, *args: Any, **options: Any) -> None:
        user = get_user_model().objects.filter(username=options["username"]).first()
        if user is None:
            raise CommandError(f"No user named {options['username']!r}")
        _, key = ApiToken.issue(user=user, name=options["name"])
        self.stdout.write(key)
