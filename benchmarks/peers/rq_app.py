"""RQ's jobs (peers venv only); workers: `rq worker-pool -n 2`."""

from __future__ import annotations

from benchmarks.peers import _stamp


def noop(i: int) -> None:
    """Nothing: what the drain measures is the queue."""


def stamp(key: str) -> None:
    _stamp.stamp(key)
