"""Create the development superuser from DJANGO_SUPERUSER_* (defaults admin/admin), once."""

import os
from typing import Any

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand


class Command(BaseCommand):
    help = "Create the superuser named by DJANGO_SUPERUSER_USERNAME unless it exists (dev only)."

    def handle(self, *args: Any, **options: Any) -> None:
        username = os.environ.get("DJANGO_SUPERUSER_USERNAME", "admin")
        password = os.environ.get("DJANGO_SUPERUSER_PASSWORD", "admin")
        email = os.environ.get("DJANGO_SUPERUSER_EMAIL", "admin@example.com")
        User = get_user_model()
        if User.objects.filter(username=username).exists():
            self.stdout.write(
                f"Superuser {username!r} exists; log in at http://127.0.0.1:8000/admin/"
            )
            return
        User.objects.create_superuser(username=username, email=email, password=password)
        self.stdout.write(
            self.style.WARNING(
                f"Created superuser {username!r} with password {password!r} (development only) "
                "- log in at http://127.0.0.1:8000/admin/"
            )
        )
