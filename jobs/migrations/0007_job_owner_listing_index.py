# GET /api/jobs/ lists a user's jobs newest first by (enqueued_at, id) in keyset pages, and
# job_owner_list_idx serves it in index order. It also serves every query job_owner_idx did (it
# starts with the same columns), so that one goes: the table keeps the same number of indexes.
# Neither owner nor enqueued_at is updated by the hot path (which moves state, lease and
# timestamps), so this index never turns a HOT update into a non-HOT one.

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("jobs", "0006_apitoken_moved_to_web"),
    ]

    operations = [
        migrations.RemoveIndex(model_name="job", name="job_owner_idx"),
        migrations.AddIndex(
            model_name="job",
            index=models.Index(fields=["owner", "-enqueued_at", "-id"], name="job_owner_list_idx"),
        ),
    ]
