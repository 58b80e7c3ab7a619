"""An uploader reads every job of their video: the process job, each rendition job the process
job's chord sent, and the chord's callback are theirs, through the jobs API; nobody else's."""

from __future__ import annotations

import time
from typing import Any

import pytest

from jobs.models import Job, JobState
from tests.conftest import wait_until
from tests.media_pipeline.conftest import upload_file
from web.models import ApiToken

# Upload to ready for the 3 s clip takes ~4 s on 2 cores; the bound is for a loaded CI host.
FLOW_TIMEOUT = 120


@pytest.fixture
def uploader(django_user_model: Any) -> Any:
    return django_user_model.objects.create_user("maria", password="not-used-here")


@pytest.fixture
def stranger(django_user_model: Any) -> Any:
    return django_user_model.objects.create_user("olaf", password="not-used-here")


def bearer(user: Any) -> dict[str, str]:
    _, key = ApiToken.issue(user=user, name="uploads")
    return {"HTTP_AUTHORIZATION": f"Bearer {key}"}


def settled(client: Any, url: str, auth: dict[str, str]) -> dict[str, Any]:
    """GET the video's status URL until it is ready or failed."""
    deadline = time.monotonic() + FLOW_TIMEOUT
    while time.monotonic() < deadline:
        body = client.get(url, **auth).json()
        if body["state"] in ("ready", "failed"):
            return body
        time.sleep(0.1)
    raise AssertionError(f"video did not settle in {FLOW_TIMEOUT}s; last answer {body}")


def lineage(root: str) -> list[Job]:
    """The job `root` and every job enqueued under it (children, their children, ...)."""
    found = list(Job.objects.filter(id=root))
    frontier = [root]
    while frontier:
        children = list(Job.objects.filter(parent_id__in=frontier))
        found += children
        frontier = [str(job.id) for job in children]
    return found


def test_the_uploader_reads_every_job_of_their_video_and_nobody_else_does(
    worker, shared_media, client, uploader, stranger, clip
):
    # given: a normal user uploads through the API with their token
    mine = bearer(uploader)
    response = client.post(
        "/api/videos/", {"file": upload_file(clip), "formats": ["360p", "720p"]}, **mine
    )
    assert response.status_code == 202, response.content
    accepted = response.json()
    final = settled(client, accepted["status_url"], mine)
    assert final["state"] == "ready", final

    # the video's jobs: the process job, one transcode per format, the chord's callback
    jobs = lineage(accepted["job_id"])
    by_task = sorted(job.task_name for job in jobs)
    assert by_task == [
        "media_pipeline.rendition_transcode",
        "media_pipeline.rendition_transcode",
        "media_pipeline.video_finish",
        "media_pipeline.video_process",
    ], by_task
    rendition_jobs = {r["job_id"] for r in final["renditions"]}
    assert rendition_jobs <= {str(job.id) for job in jobs}
    # (a short job's success is written with others' by its worker, within SUCCESS_BATCH_SECONDS)
    wait_until(
        lambda: all(job.state == JobState.SUCCEEDED for job in lineage(accepted["job_id"])),
        timeout=10,
        what="every job of the video to read succeeded",
    )
    ids = {str(job.id) for job in jobs}

    # then: the uploader's job list holds all of them, and each one's page answers them
    listed = client.get("/api/jobs/?limit=200", **mine)
    assert listed.status_code == 200, listed.content
    assert ids <= {item["job_id"] for item in listed.json()["items"]}
    for job_id in ids:
        detail = client.get(f"/api/jobs/{job_id}/", **mine)
        assert detail.status_code == 200, (job_id, detail.content)
        assert detail.json()["state"] == "succeeded"

    # and another user sees none of them
    theirs = bearer(stranger)
    listed = client.get("/api/jobs/?limit=200", **theirs)
    assert listed.status_code == 200
    assert not ids & {item["job_id"] for item in listed.json()["items"]}
    for job_id in ids:
        assert client.get(f"/api/jobs/{job_id}/", **theirs).status_code == 404, job_id
