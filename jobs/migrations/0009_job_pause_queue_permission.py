# The pause_queue permission: who may pause and resume a queue (dashboard button, API).

from django.db import migrations


class Migration(migrations.Migration):
    dependencies = [
        ("jobs", "0008_job_cancel_and_parent"),
    ]

    operations = [
        migrations.AlterModelOptions(
            name="job",
            options={
                "ordering": ("-enqueued_at",),
                "permissions": [
                    ("cancel_job", "Can cancel jobs"),
                    ("pause_queue", "Can pause and resume queues"),
                ],
                "verbose_name": "job",
                "verbose_name_plural": "jobs",
            },
        ),
    ]
