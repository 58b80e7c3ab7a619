# ApiToken moved to the reference project's web app (web 0001 takes it over, after this one);
# its table, jobs_apitoken, stays, so this migration changes Django's state only. It depends on
# nothing outside jobs: a host project without that app migrates jobs on its own.

from django.db import migrations


class Migration(migrations.Migration):
    dependencies = [
        ("jobs", "0005_job_result"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[migrations.DeleteModel(name="ApiToken")],
            database_operations=[],
        ),
    ]
