from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("jobs", "0009_job_pause_queue_permission"),
    ]

    operations = [
        migrations.AddField(
            model_name="job",
            name="trace_context",
            field=models.JSONField(
                blank=True,
                default=dict,
                help_text="OpenTelemetry context it was enqueued in (traceparent names the trace).",
                verbose_name="trace context",
            ),
        ),
    ]
