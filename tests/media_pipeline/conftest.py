"""Fixtures for media_pipeline: real clips made by ffmpeg, ffprobe to check outputs, clean media."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.core.files.uploadedfile import SimpleUploadedFile

from media_pipeline.ffmpeg import ffmpeg_exe
from media_pipeline.models import Rendition, Video

CLIP_SECONDS = 3.0
# x264 refuses pictures wider than 16384 px: at 20:1 the 360p (7200x360) transcodes and the
# 1080p (21600x1080) fails in ffmpeg, a real per-format failure.
WIDE_CLIP_SIZE = (1280, 64)


def make_clip(path: Path, *, size: tuple[int, int], seconds: float, audio: bool = True) -> Path:
    width, height = size
    command = [
        ffmpeg_exe(),
        "-hide_banner",
        "-loglevel",
        "error",
        "-nostdin",
        "-y",
        "-f",
        "lavfi",
        "-i",
        f"testsrc=size={width}x{height}:rate=25:duration={seconds}",
    ]
    if audio:
        command += ["-f", "lavfi", "-i", f"sine=frequency=440:duration={seconds}", "-c:a", "aac"]
    command += [
        "-c:v",
        "libx264",
        "-preset",
        "ultrafast",
        "-pix_fmt",
        "yuv420p",
        "-shortest",
        str(path),
    ]
    subprocess.run(command, check=True, timeout=60)
    return path


@pytest.fixture(scope="session")
def clip(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 3 s 640x360 test pattern with a 440 Hz tone, H.264/AAC in MP4."""
    return make_clip(
        tmp_path_factory.mktemp("clips") / "clip.mp4", size=(640, 360), seconds=CLIP_SECONDS
    )


@pytest.fixture(scope="session")
def wide_clip(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_clip(
        tmp_path_factory.mktemp("clips") / "wide.mp4", size=WIDE_CLIP_SIZE, seconds=1.0
    )


@pytest.fixture(scope="session")
def ffprobe() -> Callable[[Path], dict[str, Any]]:
    """Probe a file with ffprobe (installed by `make test`; waited for while it is installed)."""
    deadline = time.monotonic() + 300
    while (exe := shutil.which("ffprobe")) is None:
        if time.monotonic() > deadline:
            pytest.fail("ffprobe is not installed (make test installs it)")
        time.sleep(5)

    def run(path: Path) -> dict[str, Any]:
        out = subprocess.run(
            [
                exe,
                "-v",
                "error",
                "-print_format",
                "json",
                "-show_format",
                "-show_streams",
                str(path),
            ],
            check=True,
            capture_output=True,
            timeout=30,
        ).stdout
        data = json.loads(out)
        video = next(s for s in data["streams"] if s["codec_type"] == "video")
        audio = next((s for s in data["streams"] if s["codec_type"] == "audio"), None)
        return {
            "width": video["width"],
            "height": video["height"],
            "codec": video["codec_name"],
            "audio_codec": audio["codec_name"] if audio else None,
            "duration": float(data["format"]["duration"]),
        }

    return run


@pytest.fixture
def tmp_media(settings: Any, tmp_path: Path) -> Path:
    """MEDIA_ROOT in a temporary folder, for tests that run no worker."""
    settings.MEDIA_ROOT = tmp_path / "media"
    return settings.MEDIA_ROOT


@pytest.fixture
def shared_media() -> Iterator[Path]:
    """The MEDIA_ROOT the worker process also uses; video folders made by the test are removed."""
    videos = Path(settings.MEDIA_ROOT) / "videos"
    before = set(videos.iterdir()) if videos.exists() else set()
    yield Path(settings.MEDIA_ROOT)
    for folder in (set(videos.iterdir()) if videos.exists() else set()) - before:
        shutil.rmtree(folder, ignore_errors=True)


def video_folders() -> set[Path]:
    videos = Path(settings.MEDIA_ROOT) / "videos"
    return set(videos.iterdir()) if videos.exists() else set()


def upload_file(path: Path, name: str | None = None) -> SimpleUploadedFile:
    return SimpleUploadedFile(name or path.name, path.read_bytes(), content_type="video/mp4")


def video_factory(
    *, owner: Any, source: Path | None = None, formats: tuple[str, ...] = ("360p",), **fields: Any
) -> Video:
    """A Video row (with its source stored under MEDIA_ROOT when given) and its renditions."""
    video = Video(owner=owner, original_name=fields.pop("original_name", "clip.mp4"), **fields)
    if source is not None:
        video.source.save("original", upload_file(source), save=False)
        video.source_size = source.stat().st_size
    video.save(force_insert=True)
    Rendition.objects.bulk_create(Rendition(video=video, format=f) for f in formats)
    return video
