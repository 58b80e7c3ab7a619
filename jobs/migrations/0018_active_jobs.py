"""jobs_activejob, kept by triggers on jobs_job, and jobs_job without indexes on its state
columns (issue 26 item 4: the workers' UPDATEs become HOT on PostgreSQL).

The triggers copy an active job's state columns into jobs_activejob in the statement that
writes the job (jobs.models.active says why): a row is inserted with the job when the job is
active, updated when one of the copied columns changes while it stays active, and deleted when
the job ends or is deleted. PostgreSQL: the INSERT trigger is per statement over its transition
table (a 20,000-row COPY is one INSERT ... SELECT), the UPDATE and DELETE ones per row with a
WHEN clause (a progress or result write that changes no copied column runs no function).
SQLite: per row. The active states are written out as they are today (a migration is a
snapshot: jobs.core.states.ACTIVE_STATES).
"""

from typing import Any

import django.db.models.deletion
from django.db import migrations, models

ACTIVE = "('queued', 'scheduled', 'running', 'retrying')"
COPIED = (
    "task_name",
    "queue",
    "state",
    "enqueued_at",
    "scheduled_for",
    "published_at",
    "lease_expires_at",
    "crashes",
)
COLUMNS = ", ".join(("job_id", *COPIED))
# Rows a new version of a page keeps free for the UPDATEs of the rows it holds, so that a
# claim and a finish find room on the row's own page (a HOT update needs it there).
FILLFACTOR = 70


def _new(prefix: str) -> str:
    return ", ".join(f"{prefix}.{c}" for c in ("id", *COPIED))


POSTGRESQL = [
    f"""
CREATE FUNCTION jobs_activejob_inserted() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO jobs_activejob ({COLUMNS})
    SELECT {_new("n")} FROM jobs_activejob_new n WHERE n.state IN {ACTIVE}
    ON CONFLICT (job_id) DO NOTHING;
    RETURN NULL;
END $$""",
    """
CREATE TRIGGER jobs_job_active_insert AFTER INSERT ON jobs_job
REFERENCING NEW TABLE AS jobs_activejob_new
FOR EACH STATEMENT EXECUTE FUNCTION jobs_activejob_inserted()""",
    f"""
CREATE FUNCTION jobs_activejob_updated() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.state IN {ACTIVE} THEN
        INSERT INTO jobs_activejob ({COLUMNS}) VALUES ({_new("NEW")})
        ON CONFLICT (job_id) DO UPDATE SET
            {", ".join(f"{c} = EXCLUDED.{c}" for c in COPIED)};
    ELSE
        DELETE FROM jobs_activejob WHERE job_id = NEW.id;
    END IF;
    RETURN NULL;
END $$""",
    f"""
CREATE TRIGGER jobs_job_active_update AFTER UPDATE ON jobs_job FOR EACH ROW
WHEN (({", ".join(f"OLD.{c}" for c in COPIED)}) IS DISTINCT FROM
      ({", ".join(f"NEW.{c}" for c in COPIED)}))
EXECUTE FUNCTION jobs_activejob_updated()""",
    """
CREATE FUNCTION jobs_activejob_deleted() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM jobs_activejob WHERE job_id = OLD.id;
    RETURN NULL;
END $$""",
    f"""
CREATE TRIGGER jobs_job_active_delete AFTER DELETE ON jobs_job FOR EACH ROW
WHEN (OLD.state IN {ACTIVE}) EXECUTE FUNCTION jobs_activejob_deleted()""",
    """
CREATE FUNCTION jobs_activejob_truncated() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM jobs_activejob;
    RETURN NULL;
END $$""",
    """
CREATE TRIGGER jobs_job_active_truncate AFTER TRUNCATE ON jobs_job
FOR EACH STATEMENT EXECUTE FUNCTION jobs_activejob_truncated()""",
    # Retention and the operations report read the finished history by time: a BRIN index on
    # enqueued_at (never updated, so no UPDATE pays for it; a few pages for millions of rows).
    "CREATE INDEX job_enqueued_brin ON jobs_job USING brin (enqueued_at)",
    f"ALTER TABLE jobs_job SET (fillfactor = {FILLFACTOR})",
]
POSTGRESQL_REVERSE = [
    "ALTER TABLE jobs_job RESET (fillfactor)",
    "DROP INDEX IF EXISTS job_enqueued_brin",
    *(
        f"DROP TRIGGER IF EXISTS jobs_job_active_{event} ON jobs_job"
        for event in ("insert", "update", "delete", "truncate")
    ),
    *(
        f"DROP FUNCTION IF EXISTS jobs_activejob_{event}()"
        for event in ("inserted", "updated", "deleted", "truncated")
    ),
]

SQLITE = [
    f"""
CREATE TRIGGER jobs_job_active_insert AFTER INSERT ON jobs_job
WHEN NEW.state IN {ACTIVE}
BEGIN
    INSERT OR REPLACE INTO jobs_activejob ({COLUMNS}) VALUES ({_new("NEW")});
END""",
    f"""
CREATE TRIGGER jobs_job_active_update AFTER UPDATE OF {", ".join(COPIED)} ON jobs_job
BEGIN
    DELETE FROM jobs_activejob WHERE job_id = NEW.id AND NEW.state NOT IN {ACTIVE};
    INSERT OR REPLACE INTO jobs_activejob ({COLUMNS})
    SELECT {_new("NEW")} WHERE NEW.state IN {ACTIVE};
END""",
    """
CREATE TRIGGER jobs_job_active_delete AFTER DELETE ON jobs_job
BEGIN
    DELETE FROM jobs_activejob WHERE job_id = OLD.id;
END""",
]
SQLITE_REVERSE = [
    f"DROP TRIGGER IF EXISTS jobs_job_active_{event}" for event in ("insert", "update", "delete")
]

BACKFILL = f"""
INSERT INTO jobs_activejob ({COLUMNS})
SELECT {_new("j")} FROM jobs_job j WHERE j.state IN {ACTIVE}"""


def install(apps: Any, schema_editor: Any) -> None:
    vendor = schema_editor.connection.vendor
    statements = {"postgresql": POSTGRESQL, "sqlite": SQLITE}.get(vendor)
    if statements is None:
        raise RuntimeError(f"jobs: the ledger supports PostgreSQL and SQLite, not {vendor}")
    for sql in (BACKFILL, *statements):
        schema_editor.execute(sql)


def uninstall(apps: Any, schema_editor: Any) -> None:
    vendor = schema_editor.connection.vendor
    for sql in {"postgresql": POSTGRESQL_REVERSE, "sqlite": SQLITE_REVERSE}.get(vendor, []):
        schema_editor.execute(sql)


class Migration(migrations.Migration):
    dependencies = [
        ("jobs", "0017_step_sleeping_idx"),
    ]

    operations = [
        migrations.CreateModel(
            name="ActiveJob",
            fields=[
                (
                    "job",
                    models.OneToOneField(
                        db_constraint=False,
                        help_text="The active job.",
                        on_delete=django.db.models.deletion.DO_NOTHING,
                        primary_key=True,
                        related_name="+",
                        serialize=False,
                        to="jobs.job",
                        verbose_name="job",
                    ),
                ),
                (
                    "task_name",
                    models.CharField(
                        help_text="Copied from the job.", max_length=200, verbose_name="task"
                    ),
                ),
                (
                    "queue",
                    models.CharField(
                        help_text="Copied from the job.", max_length=100, verbose_name="queue"
                    ),
                ),
                (
                    "state",
                    models.CharField(
                        help_text="Copied from the job.", max_length=16, verbose_name="state"
                    ),
                ),
                (
                    "enqueued_at",
                    models.DateTimeField(help_text="Copied from the job.", verbose_name="enqueued"),
                ),
                (
                    "scheduled_for",
                    models.DateTimeField(
                        blank=True,
                        help_text="Copied from the job.",
                        null=True,
                        verbose_name="scheduled for",
                    ),
                ),
                (
                    "published_at",
                    models.DateTimeField(
                        blank=True,
                        help_text="Copied from the job.",
                        null=True,
                        verbose_name="published",
                    ),
                ),
                (
                    "lease_expires_at",
                    models.DateTimeField(
                        blank=True,
                        help_text="Copied from the job.",
                        null=True,
                        verbose_name="lease expires",
                    ),
                ),
                (
                    "crashes",
                    models.PositiveIntegerField(
                        default=0, help_text="Copied.", verbose_name="worker crashes"
                    ),
                ),
            ],
            options={
                "verbose_name": "active job",
                "verbose_name_plural": "active jobs",
            },
        ),
        migrations.RemoveIndex(
            model_name="job",
            name="job_state_queue_idx",
        ),
        migrations.RemoveIndex(
            model_name="job",
            name="job_due_idx",
        ),
        migrations.RemoveIndex(
            model_name="job",
            name="job_finished_idx",
        ),
        migrations.AddIndex(
            model_name="activejob",
            index=models.Index(
                fields=["state", "queue", "enqueued_at"], name="active_state_queue_idx"
            ),
        ),
        migrations.RunPython(install, uninstall),
    ]
