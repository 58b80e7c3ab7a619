"""Each rendition's job is two steps, transcode then poster: a poster that fails once is retried
without running the finished transcode's ffmpeg again. Real worker, real ffmpeg, real
PostgreSQL; ffmpeg's runs are counted from the log of the test workers' ffmpeg wrapper."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.db import connection

from jobs.models import DeadLetter, Job, JobState, JobStep, StepState
from media_pipeline import services
from media_pipeline.models import Rendition, RenditionStatus, Video
from tests.conftest import FFMPEG_LOG, wait_until
from tests.media_pipeline.conftest import upload_file, video_factory
from tests.media_pipeline.test_transcode_flow import poll

# A first attempt's poster fails, the retry waits up to 30 s (the transcode job's backoff,
# base_delay 30 with full jitter); the two formats of the 3 s clip take ~5 s on 2 cores.
SETTLE_TIMEOUT = 150
# The separator of a logged run's fields (tests/support/ffmpeg_logged).
FIELD = "\x1f"


@pytest.fixture
def user(django_user_model: Any) -> Any:
    return django_user_model.objects.create_user("ines", password="not-used-here")


class FfmpegRuns:
    """Every ffmpeg run the test workers started on a file under MEDIA_ROOT/videos while this is
    open: {pid: argv}. The workers run ffmpeg through tests/support/ffmpeg_logged, which logs a
    run before it execs the real binary; a run of 0.1 s is counted as surely as one of a minute
    (a scan of /proc could miss a poster frame on a loaded host)."""

    def __init__(self) -> None:
        self.root = str(Path(settings.MEDIA_ROOT) / "videos")
        self.seen: dict[int, list[str]] = {}
        self._start = 0

    def __enter__(self) -> FfmpegRuns:
        FFMPEG_LOG.parent.mkdir(parents=True, exist_ok=True)
        FFMPEG_LOG.touch()
        self._start = FFMPEG_LOG.stat().st_size
        return self

    def __exit__(self, *exc: object) -> None:
        with FFMPEG_LOG.open("rb") as log:
            log.seek(self._start)
            lines = log.read().decode(errors="replace").splitlines()
        for line in lines:
            pid, *argv = line.split(FIELD)
            if any(self.root in arg for arg in argv):
                self.seen[int(pid)] = argv

    def of(self, video: Video, kind: str, fmt: str) -> int:
        """How many ffmpeg runs of `kind` (transcode: x264 writing the format; poster: a JPEG
        taken from the written format) were seen for the video."""
        folder = f"{self.root}/{video.id}/renditions/"
        count = 0
        for argv in self.seen.values():
            if kind == "transcode" and "libx264" in argv:
                count += argv[-1].startswith(f"file:{folder}.{fmt}.")
            elif kind == "poster" and "mjpeg" in argv:
                count += f"file:{folder}{fmt}.mp4" in argv
        return count


@contextmanager
def poster_write_refused(times: int = 1) -> Iterator[None]:
    """The first `times` writes of a rendition's poster path fail in PostgreSQL with a
    serialization failure (SQLSTATE 40001, Django's OperationalError: a transient error the
    retry policy retries). A sequence counts the refusals: nextval survives the rollback."""
    quote = connection.ops.quote_name
    table = quote(Rendition._meta.db_table)
    with connection.cursor() as cursor:
        cursor.execute("CREATE SEQUENCE test_poster_refusals")
        cursor.execute(
            "CREATE FUNCTION test_refuse_poster() RETURNS trigger LANGUAGE plpgsql AS $$ "
            f"BEGIN IF nextval('test_poster_refusals') <= {int(times)} THEN "
            "RAISE EXCEPTION 'test: poster write refused' USING ERRCODE = 'serialization_failure'; "
            "END IF; RETURN NEW; END $$"
        )
        cursor.execute(
            f"CREATE TRIGGER test_refuse_poster BEFORE UPDATE OF poster_path ON {table} "
            "FOR EACH ROW WHEN (NEW.poster_path <> '') EXECUTE FUNCTION test_refuse_poster()"
        )
    try:
        yield
    finally:
        with connection.cursor() as cursor:
            cursor.execute(f"DROP TRIGGER IF EXISTS test_refuse_poster ON {table}")
            cursor.execute("DROP FUNCTION IF EXISTS test_refuse_poster()")
            cursor.execute("DROP SEQUENCE IF EXISTS test_poster_refusals")


def test_a_poster_retried_after_two_renditions_redoes_neither_transcode(
    worker, shared_media, client, user, django_user_model, clip, ffprobe
):
    # given two formats, and the first poster frame's write refused once by the database
    client.force_login(user)
    with poster_write_refused(times=1), FfmpegRuns() as runs:
        accepted = client.post(
            "/api/videos/", {"file": upload_file(clip), "formats": "360p,720p"}
        ).json()

        # when the video is processed: one format's poster fails, its job is retried
        final = poll(client, accepted["status_url"], timeout=SETTLE_TIMEOUT)[-1]

    # then the video is ready with both renditions, each with its poster
    assert final["state"] == "ready", final
    video = Video.objects.get(id=accepted["video_id"])
    by_format = {r["format"]: r for r in final["renditions"]}
    assert set(by_format) == {"360p", "720p"}
    jobs = {fmt: Job.objects.get(id=answer["job_id"]) for fmt, answer in by_format.items()}
    retried = [fmt for fmt, job in jobs.items() if job.attempts == 2]
    assert len(retried) == 1, [(r["format"], r["job_id"]) for r in final["renditions"]]
    for fmt, answer in by_format.items():
        row = Rendition.objects.get(video=video, format=fmt)
        assert answer["state"] == "ready" and row.status == RenditionStatus.READY
        # the user downloads the rendition and its poster
        content = b"".join(client.get(answer["download_url"]).streaming_content)
        assert content == (Path(settings.MEDIA_ROOT) / row.path).read_bytes()
        assert answer["poster_url"], answer
        poster = client.get(answer["poster_url"])
        assert poster.status_code == 200 and poster["Content-Type"] == "image/jpeg"
        image = b"".join(poster.streaming_content)
        assert image[:3] == b"\xff\xd8\xff"  # a JPEG
        assert image == (Path(settings.MEDIA_ROOT) / row.poster_path).read_bytes()
        probed = ffprobe(Path(settings.MEDIA_ROOT) / row.poster_path)
        assert (probed["codec"], probed["width"], probed["height"]) == (
            "mjpeg",
            row.width,
            row.height,
        )

        # each format's transcode ffmpeg ran once, whether its job was retried or not
        job = jobs[fmt]
        steps = {s.name: s for s in JobStep.objects.filter(job=job)}
        assert sorted(steps, key=lambda n: steps[n].position) == ["transcode", "poster"]
        assert steps["transcode"].state == StepState.SUCCEEDED
        assert (steps["transcode"].attempts, steps["transcode"].job_attempt) == (1, 1)
        assert runs.of(video, "transcode", fmt) == 1, runs.seen
        print(
            f"\n{fmt}: job attempts {job.attempts}, transcode ffmpeg runs seen "
            f"{runs.of(video, 'transcode', fmt)}, poster ffmpeg runs seen "
            f"{runs.of(video, 'poster', fmt)}, poster step attempts {steps['poster'].attempts}"
        )
        assert job.state == JobState.SUCCEEDED
        if fmt in retried:
            # the retry started at the poster: attempt 2 ran only the poster's ffmpeg
            assert job.attempts == 2
            assert steps["poster"].state == StepState.SUCCEEDED
            assert (steps["poster"].attempts, steps["poster"].job_attempt) == (2, 2)
            assert runs.of(video, "poster", fmt) == 2, runs.seen
        else:
            assert job.attempts == 1 and steps["poster"].attempts == 1
            assert runs.of(video, "poster", fmt) == 1, runs.seen
    # another user sees neither the poster nor the video
    client.force_login(django_user_model.objects.create_user("someone-else", password="x"))
    assert client.get(by_format["360p"]["poster_url"]).status_code == 404
    assert not DeadLetter.objects.filter(
        job_id_value__in=[r["job_id"] for r in final["renditions"]]
    ).exists()
    # the batch's settling job made it ready, once both jobs had ended
    # (its success is written with others' by its worker, within SUCCESS_BATCH_SECONDS)
    finish = Job.objects.filter(
        task_name="media_pipeline.video_finish", parent_id=accepted["job_id"]
    )
    wait_until(
        lambda: finish.get().state == JobState.SUCCEEDED, timeout=10, what="the settling job"
    )
    assert not list((Path(settings.MEDIA_ROOT) / video.folder).rglob("*.part"))


@pytest.mark.parametrize(
    ("duration", "at"), [(None, 0.0), (0.0, 0.0), (3.0, 0.75), (40.0, 10.0), (7200.0, 10.0)]
)
def test_the_poster_frame_is_a_quarter_in_and_at_most_ten_seconds(duration, at):
    assert services.poster_time(duration) == at


@pytest.mark.django_db
def test_rendition_poster_writes_a_jpeg_of_the_written_file_once(
    tmp_media, admin_user, clip, ffprobe
):
    # given a written 360p
    video = video_factory(owner=admin_user, source=clip, formats=("360p", "720p"))
    rendition = video.renditions.get(format="360p")
    services.rendition_transcode(rendition_id=rendition.pk)

    # when its poster is taken, twice
    services.rendition_poster(rendition_id=rendition.pk)
    rendition.refresh_from_db()
    poster = tmp_media / rendition.poster_path
    taken = poster.stat().st_mtime_ns
    services.rendition_poster(rendition_id=rendition.pk)

    # then one JPEG of the rendition's size, next to it, taken once
    assert rendition.poster_path == f"videos/{video.id}/renditions/360p.jpg"
    probed = ffprobe(poster)
    assert (probed["codec"], probed["width"], probed["height"]) == ("mjpeg", 640, 360)
    assert poster.stat().st_mtime_ns == taken
    assert list(poster.parent.glob("*.part")) == []
    # a format not written (cancelled while its transcode was on its way) gets none
    other = video.renditions.get(format="720p")
    other.mark_cancelled()
    assert services.rendition_poster(rendition_id=other.pk).poster_path == ""
