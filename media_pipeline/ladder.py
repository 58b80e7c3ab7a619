"""The encoding ladder: what each rendition format means in pixels and bitrates."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Rung:
    """One format: `lines` is the short side in pixels (the "p" number)."""

    lines: int
    crf: int  # x264 constant quality; the caps below bound the bitrate of busy scenes
    max_video_kbps: int
    audio_kbps: int


# Caps follow common streaming ladders (YouTube's recommended upload bitrates, halved for
# delivery); CRF 23 is x264's default quality.
LADDER: dict[str, Rung] = {
    "360p": Rung(lines=360, crf=23, max_video_kbps=1_000, audio_kbps=96),
    "720p": Rung(lines=720, crf=23, max_video_kbps=3_000, audio_kbps=128),
    "1080p": Rung(lines=1080, crf=22, max_video_kbps=6_000, audio_kbps=160),
}


def frame_size(width: int, height: int, lines: int) -> tuple[int, int]:
    """The output size for a `lines`p rendition of a width x height picture.

    The short side becomes `lines` (so a portrait 1080p is 1080 wide), the long side keeps the
    aspect ratio, rounded to an even number as 4:2:0 chroma requires.
    """
    if width <= 0 or height <= 0:
        raise ValueError(f"picture size must be positive, got {width}x{height}")
    if width >= height:
        return _even(width * lines / height), lines
    return lines, _even(height * lines / width)


def _even(value: float) -> int:
    return max(2, 2 * round(value / 2))
