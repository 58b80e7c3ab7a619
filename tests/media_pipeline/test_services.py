"""Service functions, called directly (no worker): store, probe, transcode, settle."""

from __future__ import annotations

import uuid

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile

from jobs.models import Job
from media_pipeline import services
from media_pipeline.exceptions import InvalidUpload, NotAVideo, UploadTooLarge
from media_pipeline.models import Rendition, RenditionStatus, Video, VideoStatus
from media_pipeline.tasks import video_process_job
from tests.media_pipeline.conftest import CLIP_SECONDS, upload_file, video_factory

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        (None, ["360p", "720p", "1080p"]),
        (["1080p", "360p"], ["360p", "1080p"]),
        (["720p,360p", "720P"], ["360p", "720p"]),
    ],
)
def test_formats_parse_orders_and_deduplicates(given, expected):
    assert services.formats_parse(given) == expected


@pytest.mark.parametrize(
    ("given", "message"), [(["4k"], "unknown format '4k'"), ([""], "at least one")]
)
def test_formats_parse_names_the_field(given, message):
    with pytest.raises(InvalidUpload, match=message) as caught:
        services.formats_parse(given)
    assert caught.value.field == "formats"


@pytest.mark.parametrize(
    ("name", "shown"),
    [
        ("../../etc/passwd", "passwd"),
        ("C:\\Users\\me\\clip.mov", "clip.mov"),
        ("a\x00b\n.mp4", "ab.mp4"),
    ],
)
def test_display_name_keeps_only_a_printable_base_name(name, shown):
    assert services.display_name(name) == shown


def test_video_create_stores_under_a_generated_name_and_enqueues(tmp_media, admin_user, clip):
    upload = upload_file(clip, name="../../../holiday 2024.mp4")

    video, handle = services.video_create(
        owner=admin_user, upload=upload, formats=["720p"], process_job=video_process_job
    )

    assert video.source.name == f"videos/{video.id}/source/original"
    assert (tmp_media / video.source.name).read_bytes() == clip.read_bytes()
    assert video.original_name == "holiday 2024.mp4" and video.source_size == clip.stat().st_size
    assert [r.format for r in video.renditions.all()] == ["720p"]
    job = Job.objects.get(id=handle.id)
    assert job.task_name == "media_pipeline.video_process" and job.args == [str(video.id)]
    assert job.owner == admin_user and str(video.job_id) == handle.id


def test_video_create_refuses_before_storing_anything(tmp_media, settings, admin_user, clip):
    settings.BACKLOT_MAX_UPLOAD_BYTES = 1000

    with pytest.raises(UploadTooLarge, match="limited to 1000 bytes"):
        services.video_create(
            owner=admin_user, upload=upload_file(clip), formats=None, process_job=video_process_job
        )
    with pytest.raises(InvalidUpload, match="empty"):
        services.video_create(
            owner=admin_user,
            upload=SimpleUploadedFile("a.mp4", b""),
            formats=None,
            process_job=video_process_job,
        )

    assert not Video.objects.exists() and not Job.objects.exists()
    assert not tmp_media.exists() or not any(tmp_media.rglob("*"))


def test_video_probe_records_duration_and_size(tmp_media, admin_user, clip):
    video = video_factory(owner=admin_user, source=clip)

    services.video_probe(video_id=str(video.id))

    video.refresh_from_db()
    assert video.status == VideoStatus.PROBING
    assert (video.width, video.height) == (640, 360)
    assert video.duration == pytest.approx(CLIP_SECONDS, abs=0.05)


def test_video_probe_of_a_non_video_marks_it_failed_and_raises_permanent(
    tmp_media, admin_user, tmp_path
):
    junk = tmp_path / "junk.mp4"
    junk.write_bytes(b"\x00\x01 not a video " * 64)
    video = video_factory(owner=admin_user, source=junk)

    with pytest.raises(NotAVideo, match="Invalid data found"):
        services.video_probe(video_id=str(video.id))

    video.refresh_from_db()
    assert video.status == VideoStatus.FAILED and "Invalid data found" in video.error


def test_plan_assigns_job_ids_once(tmp_media, admin_user, clip):
    video = video_factory(owner=admin_user, source=clip, formats=("360p", "1080p"))
    services.video_probe(video_id=str(video.id))

    plan = services.video_transcode_plan(video_id=str(video.id))

    assert [p.format for p in plan] == ["360p", "1080p"]
    sizes = {r.format: (r.width, r.height) for r in video.renditions.all()}
    assert sizes == {"360p": (640, 360), "1080p": (1920, 1080)}
    video.refresh_from_db()
    assert video.status == VideoStatus.TRANSCODING
    # a crash before the jobs were sent: the re-run gets the same plan
    assert services.video_transcode_plan(video_id=str(video.id)) == plan
    # once the jobs exist, a re-run starts nothing
    Job.objects.create(
        id=plan[0].job_id, task_name="media_pipeline.rendition_transcode", queue="media"
    )
    assert services.video_transcode_plan(video_id=str(video.id)) == []


def test_rendition_transcode_writes_a_probed_file_with_rising_progress(
    tmp_media, admin_user, clip, ffprobe
):
    video = video_factory(owner=admin_user, source=clip, formats=("360p",))
    rendition = video.renditions.get()
    seen: list[int] = []

    services.rendition_transcode(rendition_id=rendition.pk, on_progress=seen.append)

    rendition.refresh_from_db()
    assert rendition.status == RenditionStatus.READY and rendition.progress == 100
    assert rendition.path == f"videos/{video.id}/renditions/360p.mp4"
    written = tmp_media / rendition.path
    probed = ffprobe(written)
    assert (probed["width"], probed["height"]) == (640, 360) == (rendition.width, rendition.height)
    assert probed["duration"] == pytest.approx(CLIP_SECONDS, abs=0.1)
    assert probed["codec"] == "h264" and probed["audio_codec"] == "aac"
    assert rendition.size_bytes == written.stat().st_size
    assert seen == sorted(set(seen)) and all(0 < p <= 99 for p in seen)
    assert list(written.parent.glob("*.part")) == []


def test_a_transcode_cut_short_leaves_no_file_recorded(tmp_media, admin_user, clip):
    video = video_factory(owner=admin_user, source=clip, formats=("720p",))
    rendition = video.renditions.get()

    def worker_dies(percent: int) -> None:
        raise SystemExit("the worker is going away")  # not an Exception: like a kill

    with pytest.raises(SystemExit):
        services.rendition_transcode(rendition_id=rendition.pk, on_progress=worker_dies)

    rendition.refresh_from_db()
    folder = tmp_media / video.folder / "renditions"
    assert rendition.status == RenditionStatus.RUNNING and rendition.path == ""
    assert list(folder.iterdir()) == []  # no final file and no temporary one


def test_a_failed_attempt_is_recorded_and_giving_up_fails_the_video(tmp_media, admin_user, clip):
    video = video_factory(
        owner=admin_user, source=clip, formats=("360p",), status=VideoStatus.TRANSCODING
    )
    rendition = video.renditions.get()
    (tmp_media / video.source.name).write_bytes(b"replaced by garbage")

    with pytest.raises(NotAVideo):
        services.rendition_transcode(rendition_id=rendition.pk)

    # the attempt failed: the job's retry policy decides what comes next
    rendition.refresh_from_db()
    assert rendition.status == RenditionStatus.QUEUED and "Invalid data" in rendition.error
    assert rendition.path == "" and rendition.progress == 0
    # the job gave up (its on_dead hook)
    settled = services.rendition_give_up(rendition_id=rendition.pk, error=rendition.error)
    assert settled.status == VideoStatus.FAILED
    assert settled.error.startswith("360p failed: ") and "Invalid data" in settled.error


def test_progress_never_goes_down(admin_user):
    rendition = video_factory(owner=admin_user, formats=("360p",)).renditions.get()

    assert rendition.report_progress(40)
    assert not rendition.report_progress(10)  # a retry starting over
    assert rendition.report_progress(41)
    rendition.refresh_from_db()
    assert rendition.progress == 41


def _settle(video: Video, states: dict[str, str], errors: dict[str, str] | None = None) -> Video:
    for rendition in video.renditions.all():
        rendition.status = states[rendition.format]
        rendition.error = (errors or {}).get(rendition.format, "")
        rendition.job_id = uuid.uuid4()
        rendition.save()
    return services.video_finish(video_id=str(video.id))


def test_video_finish_is_ready_when_every_format_is(admin_user):
    video = video_factory(
        owner=admin_user, formats=("360p", "720p"), status=VideoStatus.TRANSCODING
    )

    assert _settle(video, {"360p": "ready", "720p": "ready"}).status == VideoStatus.READY


def test_video_finish_names_the_failed_format(admin_user):
    video = video_factory(
        owner=admin_user, formats=("360p", "720p"), status=VideoStatus.TRANSCODING
    )

    settled = _settle(
        video, {"360p": "ready", "720p": "failed"}, {"720p": "ffmpeg exited with status 1"}
    )

    assert settled.status == VideoStatus.FAILED
    assert settled.error == "720p failed: ffmpeg exited with status 1"


def test_video_finish_waits_while_a_format_still_runs(admin_user):
    video = video_factory(
        owner=admin_user, formats=("360p", "720p"), status=VideoStatus.TRANSCODING
    )

    assert _settle(video, {"360p": "failed", "720p": "running"}).status == VideoStatus.TRANSCODING


def test_a_transcode_killed_for_good_fails_its_rendition_and_settles_the_video(admin_user):
    video = video_factory(
        owner=admin_user, formats=("360p", "720p"), status=VideoStatus.TRANSCODING
    )
    Rendition.objects.filter(video=video, format="360p").update(status=RenditionStatus.READY)
    killed = Rendition.objects.get(video=video, format="720p")
    Rendition.objects.filter(pk=killed.pk).update(status=RenditionStatus.RUNNING)

    settled = services.rendition_give_up(
        rendition_id=killed.pk, error="WorkerLostError: worker process died 3 times"
    )

    assert settled.status == VideoStatus.FAILED
    assert settled.error == "720p failed: WorkerLostError: worker process died 3 times"


def test_a_replayed_format_that_succeeds_turns_a_failed_video_ready(admin_user):
    video = video_factory(owner=admin_user, formats=("360p",), status=VideoStatus.FAILED)
    Rendition.objects.filter(video=video).update(status=RenditionStatus.READY)

    assert services.video_finish(video_id=str(video.id)).status == VideoStatus.READY


def test_a_processing_job_that_gives_up_fails_the_waiting_video(admin_user):
    from media_pipeline import tasks

    waiting = video_factory(owner=admin_user, status=VideoStatus.PROBING)
    started = video_factory(owner=admin_user, status=VideoStatus.TRANSCODING)

    for video in (waiting, started):  # the job's on_dead hook
        tasks._process_gave_up(TimeoutError("ffmpeg hung"), (str(video.id),), {})

    waiting.refresh_from_db()
    started.refresh_from_db()
    assert waiting.status == VideoStatus.FAILED and waiting.error == "TimeoutError: ffmpeg hung"
    assert started.status == VideoStatus.TRANSCODING


def test_a_started_video_is_not_failed_by_a_late_processing_give_up(admin_user):
    video = video_factory(owner=admin_user, status=VideoStatus.TRANSCODING)

    assert not video.mark_failed(error="late")
    assert not video.mark_probing()
    assert video.mark_transcode_failed(error="360p failed: x")
    video.refresh_from_db()
    assert video.status == VideoStatus.FAILED and video.error == "360p failed: x"
