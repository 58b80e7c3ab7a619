"""jobs_job keeps more than half of each page free on PostgreSQL (fillfactor 45, was 70).

A worker writes its short successes together, SUCCESS_BATCH rows in one UPDATE
(jobs.worker.finishes): the rows of one page, enqueued together, get their new versions in
one transaction, before any old one is dead, so the page must hold a second version of each
row, a finished one being a little wider than a queued one, for the UPDATE to stay HOT (no
index touched): 64 rows written 32 at a time were 42 % HOT at 70, 86 % at 50, >= 90 % at 45
(tests/jobs/models/test_active.py; the drain bench: 0.67 at 70, benchmarks/README.md, stop
47). A page holds fewer rows as inserted, but a non-HOT version takes room on another page:
under a bulk UPDATE the table ended smaller at 50 than at 70 (benchmarks/README.md, issue
16). Pages written before the change keep their fill; new ones take the new one.
"""

from __future__ import annotations

from typing import Any

from django.db import migrations

FILLFACTOR = 45
PREVIOUS = 70


def _set(fillfactor: int) -> Any:
    def run(apps: Any, schema_editor: Any) -> None:
        if schema_editor.connection.vendor == "postgresql":
            schema_editor.execute(f"ALTER TABLE jobs_job SET (fillfactor = {fillfactor})")

    return run


class Migration(migrations.Migration):
    dependencies = [
        ("jobs", "0018_active_jobs"),
    ]

    operations = [
        migrations.RunPython(_set(FILLFACTOR), _set(PREVIOUS), elidable=False),
    ]
