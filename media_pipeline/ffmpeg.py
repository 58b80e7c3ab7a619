"""ffmpeg as a subprocess: read a file's video stream, transcode it with live progress, take
a poster frame.

The binary is the one the imageio-ffmpeg wheel ships (or $IMAGEIO_FFMPEG_EXE, or ffmpeg on
PATH): pip-installable, no system package needed. Only ffmpeg is used, not ffprobe, which the
wheel does not ship; the probe reads the stream header ffmpeg prints for its input.
"""

from __future__ import annotations

import ctypes
import re
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import imageio_ffmpeg

from .exceptions import NotAVideo, TranscodeFailed, TranscodeInterrupted
from .ladder import Rung

# Demuxers a source may be read with. Anything else is refused before ffmpeg parses it:
# playlists (HLS, concat) that would open other local files or URLs named inside an upload,
# still images, audio-only formats.
SOURCE_DEMUXERS = (
    "mov", "matroska", "avi", "flv", "mpegts", "mpeg", "ogg", "asf", "mxf", "dv", "gif",
)  # fmt: skip
INPUT_OPTIONS = ("-format_whitelist", ",".join(SOURCE_DEMUXERS), "-protocol_whitelist", "file")
# Reading a header takes milliseconds; the copy pass that measures a file without a
# duration in its header reads the whole file without decoding (~1 GB/s on local disk).
PROBE_TIMEOUT = 60.0
MEASURE_TIMEOUT = 600.0
# One frame from a rendition we wrote: a seek before the input and one JPEG, ~0.1 s for 1080p.
POSTER_TIMEOUT = 60.0
# ffmpeg's error output kept in exception messages: its first lines name the cause (the
# encoder or demuxer that refused), its last ones the outcome; a failed encoder open is ~9 lines.
MESSAGE_HEAD_LINES = 3
MESSAGE_TAIL_LINES = 4
MESSAGE_MAX_CHARS = 2000


@cache
def ffmpeg_exe() -> str:
    return imageio_ffmpeg.get_ffmpeg_exe()


@dataclass(frozen=True)
class Probe:
    """What ffmpeg reports of a file's first video stream (size as displayed, rotated)."""

    container: str
    duration: float
    width: int
    height: int
    fps: float | None
    has_audio: bool


def probe(path: Path) -> Probe:
    """Read a video file's header; NotAVideo (with ffmpeg's message) when it is not one."""
    try:
        result = subprocess.run(
            [ffmpeg_exe(), "-hide_banner", "-nostdin", *INPUT_OPTIONS, "-i", f"file:{path}"],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=PROBE_TIMEOUT,
            check=False,  # a file that is not a video is an answer, not an error
        )
    except subprocess.TimeoutExpired:
        raise TimeoutError(f"ffmpeg did not read the header within {PROBE_TIMEOUT:.0f}s") from None
    text = result.stderr.decode("utf-8", "replace")
    header = re.search(r"^Input #0, (.+?), from ", text, re.MULTILINE)
    if header is None:
        raise NotAVideo(ffmpeg_message(text, path))
    video = next(
        (
            line
            for line in text.splitlines()
            if re.match(r"\s*Stream #0:\d+.*?: Video: ", line) and "(attached pic)" not in line
        ),
        None,
    )
    if video is None:
        raise NotAVideo(f"No video stream in the file (ffmpeg reads it as {header.group(1)})")
    size = re.search(r", (\d{1,5})x(\d{1,5})\b", video)
    if size is None or 0 in (int(size.group(1)), int(size.group(2))):
        raise NotAVideo(f"The video stream has no picture size: {video.strip()}")
    width, height = int(size.group(1)), int(size.group(2))
    rotation = re.search(r"rotation of (-?\d+(?:\.\d+)?) degrees|rotate\s*:\s*(-?\d+)", text)
    if rotation and round(float(rotation.group(1) or rotation.group(2))) % 180 == 90:
        width, height = height, width  # ffmpeg turns the picture upright when it decodes
    duration = _header_duration(text)
    if duration is None:
        duration = _measure_duration(path)
    if not duration or duration <= 0:
        raise NotAVideo("The video has no duration (ffmpeg found no timed frames)")
    return Probe(
        container=header.group(1),
        duration=duration,
        width=width,
        height=height,
        fps=_frame_rate(video),
        has_audio=bool(re.search(r"^\s*Stream #0:\d+.*?: Audio: ", text, re.MULTILINE)),
    )


def _header_duration(text: str) -> float | None:
    found = re.search(r"Duration: (\d+):(\d{2}):(\d{2}(?:\.\d+)?)", text)
    if found is None:
        return None  # "Duration: N/A": streamed formats (some .ts, .webm) do not say
    hours, minutes, seconds = found.groups()
    return int(hours) * 3600 + int(minutes) * 60 + float(seconds)


def _measure_duration(path: Path) -> float | None:
    """Copy the video stream to nowhere and read how far it got."""
    try:
        # fmt: off
        result = subprocess.run(
            [ffmpeg_exe(), "-hide_banner", "-nostdin", "-loglevel", "error", *INPUT_OPTIONS,
             "-i", f"file:{path}", "-map", "0:v:0", "-c", "copy", "-f", "null",
             "-progress", "pipe:1", "-nostats", "-"],
            stdin=subprocess.DEVNULL, capture_output=True, timeout=MEASURE_TIMEOUT, check=False,
        )
        # fmt: on
    except subprocess.TimeoutExpired:
        raise TimeoutError(
            f"ffmpeg did not measure the video within {MEASURE_TIMEOUT:.0f}s"
        ) from None
    times = re.findall(
        r"^out_time_us=(\d+)$", result.stdout.decode("ascii", "replace"), re.MULTILINE
    )
    return int(times[-1]) / 1e6 if times else None


def _frame_rate(video_line: str) -> float | None:
    for unit in ("fps", "tbr"):
        found = re.search(rf"(\d+(?:\.\d+)?)(k?) {unit}\b", video_line)
        if found:
            rate = float(found.group(1)) * (1000 if found.group(2) else 1)
            # "90k tbr" and friends are time bases, not frame rates
            return rate if 0 < rate <= 240 else None
    return None


def ffmpeg_message(stderr: str, path: Path | None = None) -> str:
    """What ffmpeg wrote (its first and last lines), with the server-side path as "source"."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    if len(lines) > MESSAGE_HEAD_LINES + MESSAGE_TAIL_LINES:
        lines = [*lines[:MESSAGE_HEAD_LINES], "...", *lines[-MESSAGE_TAIL_LINES:]]
    message = "; ".join(lines) or "ffmpeg gave no reason"
    if path is not None:
        message = message.replace(f"file:{path}", "source").replace(str(path), "source")
    return message[:MESSAGE_MAX_CHARS]


class TranscodeProgress:
    """Turns ffmpeg's `-progress` key=value blocks into a percentage that only rises.

    out_time_us is how far the output has got; it is read against the probed duration. While
    the x264 lookahead holds the first ~40 video frames back, the audio runs ahead and
    out_time_us can report 80% of a 3 s clip at frame 0, then fall back (measured with
    ffmpeg 9.0). The frame count against duration x fps shows that lag, so the lower of the
    two estimates counts, and the value never goes down. It stops at 99 until ffmpeg exits:
    the last percent is the muxer moving the index to the front (+faststart).
    """

    def __init__(self, *, duration: float, fps: float | None) -> None:
        self.duration_us = duration * 1e6
        self.frames = duration * fps if fps else None
        self.percent = 0
        self._block: dict[str, str] = {}

    def feed(self, line: str) -> int | None:
        """Read one line; return the new percentage when a block ends higher than before."""
        key, _, value = line.strip().partition("=")
        if key != "progress":
            self._block[key] = value.strip()
            return None
        block, self._block = self._block, {}
        estimates = []
        out_time = _number(block.get("out_time_us"))
        if out_time is not None and self.duration_us > 0:
            estimates.append(out_time / self.duration_us)
        frame = _number(block.get("frame"))
        if frame is not None and self.frames:
            estimates.append(frame / self.frames)
        if not estimates:
            return None
        percent = max(0, min(99, int(100 * min(estimates))))
        if percent <= self.percent:
            return None
        self.percent = percent
        return percent


def _number(value: str | None) -> float | None:
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None  # "N/A"


def transcode(
    *,
    source: Path,
    target: Path,
    size: tuple[int, int],
    rung: Rung,
    source_probe: Probe,
    on_progress: Callable[[int], None],
) -> None:
    """Write an H.264/AAC MP4 of `source` at `size` to `target`, reporting 0-99 as it goes.

    TranscodeFailed carries ffmpeg's message when it exits with an error; the caller owns
    `target` (a temporary name) and removes it on failure.
    """
    width, height = size
    # fmt: off
    command = [
        ffmpeg_exe(), "-hide_banner", "-nostdin", "-y", "-loglevel", "error",
        *INPUT_OPTIONS, "-i", f"file:{source}",
        "-map", "0:v:0", "-map", "0:a:0?", "-sn", "-dn",
        "-vf", f"scale={width}:{height},setsar=1",
        "-c:v", "libx264", "-preset", "medium", "-crf", str(rung.crf),
        "-maxrate", f"{rung.max_video_kbps}k", "-bufsize", f"{2 * rung.max_video_kbps}k",
        "-pix_fmt", "yuv420p",
        "-c:a", "aac", "-b:a", f"{rung.audio_kbps}k", "-ac", "2",
        "-movflags", "+faststart",
        "-progress", "pipe:1", "-nostats",
        "-f", "mp4", f"file:{target}",
    ]
    # fmt: on
    progress = TranscodeProgress(duration=source_probe.duration, fps=source_probe.fps)
    # stderr goes to a file, not a pipe: a chatty ffmpeg cannot block on a full pipe
    with tempfile.TemporaryFile() as errors:
        process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=errors,
            preexec_fn=_die_with_parent,  # noqa: PLW1509 - only a prctl call; see below
        )
        try:
            assert process.stdout is not None
            for raw in process.stdout:
                percent = progress.feed(raw.decode("ascii", "replace"))
                if percent is not None:
                    on_progress(percent)
            returncode = process.wait()
        finally:
            if process.poll() is None:  # the job is unwinding (time limit, progress error)
                process.kill()
                process.wait()
            if process.stdout is not None:
                process.stdout.close()
        if returncode < 0:
            raise TranscodeInterrupted(f"ffmpeg was killed by signal {-returncode}")
        if returncode != 0:
            errors.seek(0)
            text = errors.read()[-16384:].decode("utf-8", "replace")
            raise TranscodeFailed(
                f"ffmpeg exited with status {returncode}: {ffmpeg_message(text, source)}"
            )


def poster(*, source: Path, target: Path, at: float) -> None:
    """Write one frame of `source`, `at` seconds in, to `target` as a JPEG.

    TranscodeFailed carries ffmpeg's message when it exits with an error (or writes nothing);
    the caller owns `target` (a temporary name) and removes it on failure.
    """
    # fmt: off
    command = [
        ffmpeg_exe(), "-hide_banner", "-nostdin", "-y", "-loglevel", "error",
        "-ss", f"{max(0.0, at):.3f}", *INPUT_OPTIONS, "-i", f"file:{source}",
        "-map", "0:v:0", "-frames:v", "1",
        "-c:v", "mjpeg", "-q:v", "3", "-pix_fmt", "yuvj420p",  # JPEG's full-range YUV
        "-f", "image2", "-update", "1", f"file:{target}",
    ]
    # fmt: on
    try:
        result = subprocess.run(
            command,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=POSTER_TIMEOUT,
            check=False,
            preexec_fn=_die_with_parent,  # only a prctl call; see below
        )
    except subprocess.TimeoutExpired:
        raise TimeoutError(f"ffmpeg took no poster frame within {POSTER_TIMEOUT:.0f}s") from None
    if result.returncode < 0:
        raise TranscodeInterrupted(f"ffmpeg was killed by signal {-result.returncode}")
    if result.returncode != 0 or not target.is_file() or target.stat().st_size == 0:
        text = result.stderr[-16384:].decode("utf-8", "replace")
        raise TranscodeFailed(
            f"ffmpeg took no poster frame (status {result.returncode}): "
            f"{ffmpeg_message(text, source)}"
        )


# ffmpeg must not outlive the job's process: a hard time limit or a crash kills the pool
# process with SIGKILL, and an orphaned ffmpeg would keep encoding for nobody (measured: it
# does, -progress to a closed pipe does not stop it). Linux's parent-death signal ends it.
_PR_SET_PDEATHSIG = 1
_prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None


def _die_with_parent() -> None:
    # Runs in the child between fork and exec: only the prctl call, looked up beforehand.
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
