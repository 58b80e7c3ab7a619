"""ffmpeg wrapper: probing real files, the progress parser, the encoding ladder's sizes."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from media_pipeline import ffmpeg
from media_pipeline.exceptions import NotAVideo
from media_pipeline.ladder import LADDER, frame_size
from media_pipeline.models import RenditionFormat
from tests.media_pipeline.conftest import CLIP_SECONDS

# `-progress pipe:1` of a 3 s 640x360 clip scaled to 1080p by ffmpeg 9.0 (frame, out_time_us
# per block): the audio runs ahead of the x264 lookahead, then the time falls back and is N/A.
RECORDED_BLOCKS = [
    ("0", "1880816"),
    ("0", "2438095"),
    ("21", "760000"),
    ("65", "N/A"),
    ("75", "3000000"),
]


def feed_blocks(progress: ffmpeg.TranscodeProgress, blocks: list[tuple[str, str]]) -> list[int]:
    seen = []
    for frame, out_time in blocks:
        for line in (f"frame={frame}", "fps=0.00", f"out_time_us={out_time}", "progress=continue"):
            value = progress.feed(line + "\n")
            if value is not None:
                seen.append(value)
    return seen


def test_progress_rises_only_and_holds_99_until_ffmpeg_exits():
    progress = ffmpeg.TranscodeProgress(duration=3.0, fps=25.0)

    seen = feed_blocks(progress, RECORDED_BLOCKS)

    # frame 0 keeps the audio's 81% out; 21/75 frames vs 0.76/3 s -> 25; 65/75 -> 86; end -> 99
    assert seen == [25, 86, 99]


def test_progress_without_a_frame_rate_follows_out_time_and_skips_na():
    progress = ffmpeg.TranscodeProgress(duration=10.0, fps=None)

    seen = feed_blocks(
        progress, [("1", "N/A"), ("2", "1000000"), ("3", "500000"), ("4", "5500000")]
    )

    assert seen == [10, 55]


def test_probe_reads_duration_size_rate_and_audio(clip: Path):
    found = ffmpeg.probe(clip)

    assert (found.width, found.height) == (640, 360)
    assert found.duration == pytest.approx(CLIP_SECONDS, abs=0.05)
    assert found.fps == 25
    assert found.has_audio
    assert found.container.startswith("mov,mp4")


def test_probe_of_a_text_file_is_not_a_video_with_ffmpegs_message(tmp_path: Path):
    path = tmp_path / "notes.mp4"
    path.write_text("these are my holiday notes, not a video\n" * 20)

    with pytest.raises(NotAVideo) as caught:
        ffmpeg.probe(path)

    assert "Invalid data found when processing input" in str(caught.value)
    assert str(tmp_path) not in str(caught.value)  # the server's paths stay out of messages


def test_still_images_and_playlists_are_refused_before_ffmpeg_parses_them(tmp_path: Path):
    image = tmp_path / "image.png"
    subprocess.run(
        [
            ffmpeg.ffmpeg_exe(),
            "-loglevel",
            "error",
            "-f",
            "lavfi",
            "-i",
            "testsrc=size=64x64",
            "-frames:v",
            "1",
            str(image),
        ],
        check=True,
    )
    # an HLS playlist would make ffmpeg open whatever local file or URL it names
    playlist = tmp_path / "list.m3u8"
    playlist.write_text(
        "#EXTM3U\n#EXT-X-TARGETDURATION:1\n#EXTINF:1,\nfile:///etc/passwd\n#EXT-X-ENDLIST\n"
    )

    for path in (image, playlist):
        with pytest.raises(NotAVideo, match="not on whitelist"):
            ffmpeg.probe(path)


def test_probe_of_a_file_without_video_names_the_container(tmp_path: Path):
    audio = tmp_path / "tone.mkv"
    subprocess.run(
        [
            ffmpeg.ffmpeg_exe(),
            "-loglevel",
            "error",
            "-f",
            "lavfi",
            "-i",
            "sine=duration=1",
            "-c:a",
            "aac",
            str(audio),
        ],
        check=True,
    )

    with pytest.raises(NotAVideo, match="No video stream"):
        ffmpeg.probe(audio)


@pytest.mark.parametrize(
    ("size", "lines", "expected"),
    [
        ((640, 360), 1080, (1920, 1080)),
        ((1920, 1080), 360, (640, 360)),
        ((1080, 1920), 720, (720, 1280)),  # portrait: the short side is the "p"
        ((720, 576), 360, (450, 360)),
        ((1280, 64), 1080, (21600, 1080)),
        ((641, 359), 720, (1286, 720)),  # rounded to even
    ],
)
def test_frame_size_keeps_aspect_with_even_sides(size, lines, expected):
    width, height = size
    assert frame_size(width, height, lines) == expected


def test_the_ladder_covers_every_format():
    assert set(LADDER) == {choice.value for choice in RenditionFormat}
    assert all(LADDER[f].lines == int(f.removesuffix("p")) for f in LADDER)
