# ApiToken moved here from the jobs app; its table (jobs_apitoken, made by jobs 0002) stays as
# it is, so this migration changes Django's state only.

import django.db.models.deletion
import django.utils.timezone
from django.conf import settings
from django.db import migrations, models


class Migration(migrations.Migration):
    initial = True

    dependencies = [
        ("jobs", "0006_apitoken_moved_to_web"),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.CreateModel(
                    name="ApiToken",
                    fields=[
                        (
                            "id",
                            models.BigAutoField(
                                auto_created=True,
                                primary_key=True,
                                serialize=False,
                                verbose_name="ID",
                            ),
                        ),
                        (
                            "name",
                            models.CharField(
                                help_text="What the token is for.",
                                max_length=100,
                                verbose_name="name",
                            ),
                        ),
                        (
                            "key_hash",
                            models.CharField(
                                help_text="SHA-256 of the key.",
                                max_length=64,
                                unique=True,
                                verbose_name="key hash",
                            ),
                        ),
                        (
                            "created_at",
                            models.DateTimeField(
                                default=django.utils.timezone.now,
                                help_text="Issued.",
                                verbose_name="created",
                            ),
                        ),
                        (
                            "last_used_at",
                            models.DateTimeField(
                                blank=True,
                                help_text="Last request.",
                                null=True,
                                verbose_name="last used",
                            ),
                        ),
                        (
                            "user",
                            models.ForeignKey(
                                help_text="The API acts as this user.",
                                on_delete=django.db.models.deletion.CASCADE,
                                related_name="api_tokens",
                                to=settings.AUTH_USER_MODEL,
                                verbose_name="user",
                            ),
                        ),
                    ],
                    options={
                        "verbose_name": "API token",
                        "verbose_name_plural": "API tokens",
                        "db_table": "jobs_apitoken",
                    },
                ),
            ],
            database_operations=[],
        ),
    ]
