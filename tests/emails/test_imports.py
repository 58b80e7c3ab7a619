"""CSV recipient imports that cannot finish: validated as they stream (an over-long field, a
line that is not UTF-8, a row past EMAIL_IMPORT_MAX_ROWS) and ended failed with the row
number; an import whose job dies ends failed with the reason (the on_dead hook); a campaign
that is no longer a draft refuses imports (409). Real worker, real PostgreSQL and Redis."""

from __future__ import annotations

import csv
import io
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings as django_settings
from django.db import transaction

from emails import services
from emails.models import CampaignStatus, ImportStatus, RecipientImport
from jobs import Permanent
from jobs.models import Job, JobState
from tests.conftest import wait_until


def upload(data: bytes) -> io.BytesIO:
    handle = io.BytesIO(data)
    handle.name = "people.csv"
    return handle


def post_import(client: Any, campaign: Any, data: bytes) -> Any:
    return client.post(f"/api/campaigns/{campaign.pk}/recipients/import", {"file": upload(data)})


def ended(client: Any, campaign: Any, import_id: int) -> dict[str, Any]:
    url = f"/api/campaigns/{campaign.pk}/imports/{import_id}/"
    return wait_until(
        lambda: (b := client.get(url).json())["status"] in ("done", "failed") and b,
        what="the import to end",
    )


@pytest.fixture
def draft(admin_user: Any, client: Any) -> Any:
    client.force_login(admin_user)
    return services.campaign_create(name="imp", template="campaign", context={}, owner=admin_user)


def test_a_field_over_the_csv_limit_fails_the_import_with_its_row(worker, client, draft):
    # given a CSV whose third row holds a 131,073-character field (csv's limit is 131,072)
    limit = csv.field_size_limit()
    data = (
        b"email,name\nann@example.com,Ann\nbob@example.com," + b"x" * (limit + 1) + b"\n"
        b"cy@example.com,Cy\n"
    )
    # when it is imported
    response = post_import(client, draft, data)
    assert response.status_code == 202
    body = ended(client, draft, response.json()["import_id"])
    # then the import is failed, naming the row and the limit, and its job is dead
    assert body["status"] == "failed"
    assert body["errors"][-1] == {
        "row": 3,
        "reason": f"a field is longer than {limit} characters",
    }
    assert body["imported"] == 1  # the rows before it stay imported
    # (the job marks the row failed, then raises: its own end is recorded a moment later)
    wait_until(
        lambda: Job.objects.get(pk=response.json()["job_id"]).state == JobState.DEAD,
        timeout=90,
        what="the job to die",
    )


def test_a_line_that_is_not_utf8_fails_the_import_with_its_row(worker, client, draft):
    data = b"email,name\nann@example.com,Ann\ncy@example.com,Cy\nbo\xe9@example.com,Bo\n"
    response = post_import(client, draft, data)
    body = ended(client, draft, response.json()["import_id"])
    assert body["status"] == "failed"
    assert body["errors"][-1] == {"row": 4, "reason": "not UTF-8 (byte 0xe9 at column 3)"}


def test_rows_past_the_row_limit_fail_the_import_with_the_first_row_over(
    transactional_db, admin_user, settings, tmp_path
):
    # EMAIL_IMPORT_MAX_ROWS is the worker's setting (its environment): the service is run here
    settings.MEDIA_ROOT = str(tmp_path)
    settings.EMAIL_IMPORT_MAX_ROWS = 3
    campaign = services.campaign_create(name="c", template="campaign", context={}, owner=admin_user)
    (tmp_path / "imports").mkdir()
    rows = "".join(f"u{n}@example.com,U{n}\n" for n in range(5))
    (tmp_path / "imports" / "five.csv").write_text("email,name\n" + rows)
    record = RecipientImport.objects.create(campaign=campaign, file="imports/five.csv")

    with pytest.raises(Permanent, match="row 5: more than 3 rows"):
        services.recipients_import_run(import_id=record.pk)

    record.refresh_from_db()
    assert record.status == ImportStatus.FAILED
    assert record.errors[-1] == {"row": 5, "reason": "more than 3 rows (EMAIL_IMPORT_MAX_ROWS)"}
    assert record.rows_read == 3
    assert services.DEFAULT_IMPORT_MAX_ROWS == 100_000
    assert django_settings.EMAIL_IMPORT_MAX_ROWS == 3


def test_an_import_whose_job_dies_ends_failed_with_the_reason(worker, client, draft):
    # given an accepted import whose file is gone before the worker reads it: accepted in a
    # transaction of the test's, so its job's message goes out at that commit, after the file
    # vanished (a permanent error, FileNotFoundError); an idle worker could read it first
    with transaction.atomic():
        response = post_import(client, draft, b"email\nann@example.com\n")
        import_id = response.json()["import_id"]
        record = RecipientImport.objects.get(pk=import_id)
        (Path(django_settings.MEDIA_ROOT) / record.file).unlink()
    body = ended(client, draft, import_id)
    # then the job is dead and the on_dead hook failed the row with the reason
    assert wait_until(
        lambda: Job.objects.get(pk=response.json()["job_id"]).state == JobState.DEAD,
        timeout=90,
        what="the job to die",
    )
    assert body["status"] == "failed"
    assert body["errors"][-1]["reason"].startswith("the import job gave up: FileNotFoundError")


@pytest.mark.parametrize("status", [CampaignStatus.SENDING, CampaignStatus.DONE])
def test_an_import_into_a_campaign_that_is_no_longer_a_draft_is_409(
    transactional_db, client, draft, status, settings, tmp_path
):
    settings.MEDIA_ROOT = str(tmp_path)
    type(draft).objects.filter(pk=draft.pk).update(status=status)
    response = post_import(client, draft, b"email\nann@example.com\n")
    assert response.status_code == 409
    assert f"is {status.value}" in response.json()["detail"]
    assert not RecipientImport.objects.exists()
    assert not (tmp_path / "imports").exists()
