# ApiToken moved to the web app (web 0001 takes it over); its table, jobs_apitoken, stays, so
# this migration changes Django's state only.

from django.db import migrations


class Migration(migrations.Migration):
    dependencies = [
        ("jobs", "0005_job_result"),
        ("web", "0001_initial"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[migrations.DeleteModel(name="ApiToken")],
            database_operations=[],
        ),
    ]
