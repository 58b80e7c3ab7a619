"""py-spy around a benchmark, and a summary of its collapsed stacks (top self / inclusive).

py-spy is not a project dependency: install it into .venv for a profile run
(`.venv/bin/pip install py-spy`). Without it, callers fall back to cProfile.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^()]*?)(?::(?P<line>\d+))?\)$")


def py_spy() -> str | None:
    here = Path(sys.executable).parent / "py-spy"
    return str(here) if here.exists() else shutil.which("py-spy")


def record(
    pid: int,
    out: Path,
    *,
    seconds: float,
    subprocesses: bool = False,
    idle: bool = os.environ.get("BENCH_PROFILE_IDLE", "1") == "1",
    rate: int = 250,
) -> subprocess.Popen[bytes]:
    """Start py-spy recording `pid` as collapsed stacks into `out`; the caller waits on it."""
    command = [
        py_spy() or "py-spy",
        "record",
        "--pid",
        str(pid),
        "--format",
        "raw",
        "--rate",
        str(rate),
        "--duration",
        str(max(1, int(seconds))),
        "--output",
        str(out),
        "--nonblocking",
    ]
    if subprocesses:
        command.append("--subprocesses")
    if idle:
        command.append("--idle")
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def short(frame: str) -> str:
    match = _FRAME.match(frame.strip())
    if not match:
        return frame.strip()
    path = match["file"]
    for marker in ("site-packages/", "/work/main/", "lib/python3."):
        if marker in path:
            path = path.split(marker, 1)[1]
            if marker == "lib/python3.":
                path = "stdlib/" + path.split("/", 1)[-1]
            break
    return f"{match['func']} ({path})"


def summarize(
    collapsed: Path, top: int = 25, process_filter: str | None = None, within: str | None = None
) -> dict:
    """Self and inclusive sample shares per function; only the samples of one process
    (`process_filter`, "pid N") or with a frame containing `within` when given."""
    self_counts: Counter[str] = Counter()
    incl_counts: Counter[str] = Counter()
    per_process: Counter[str] = Counter()
    total = 0
    for line in collapsed.read_text(errors="replace").splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        frames = stack.split(";")
        process = "this process"
        while frames and frames[0].startswith("process "):  # parent;child;... with --subprocesses
            process = _process_kind(frames[0])
            frames = frames[1:]
        if process_filter and process != process_filter:
            continue
        if within and not any(within in frame for frame in frames):
            continue
        count = int(count_text)
        total += count
        per_process[process] += count
        names = [short(f) for f in frames if f]
        if not names:
            continue
        self_counts[names[-1]] += count
        for name in set(names):
            incl_counts[name] += count

    def pct(n: int) -> float:
        return round(n / total * 100, 1) if total else 0.0

    return {
        "samples": total,
        "processes": {k: pct(v) for k, v in per_process.most_common()},
        "self": [(name, pct(n)) for name, n in self_counts.most_common(top)],
        # Frames on (nearly) every stack are the process's scaffolding (runpy, click, the
        # worker's boot, the pool's fork), not where the time goes.
        "inclusive": [
            (name, pct(n))
            for name, n in incl_counts.most_common()
            if n < 0.95 * max(incl_counts.values(), default=1)
        ][:top],
    }


def _process_kind(frame: str) -> str:
    # 'process 1234:"python -m celery ... worker ..."' -> "pid 1234": pool processes share
    # the main process's command line, so only the pid tells them apart.
    match = re.match(r'process (\d+):"?(.*?)"?$', frame)
    return f"pid {match[1]}" if match else frame


def render(summary: dict, title: str) -> str:
    lines = [f"{title}: {summary['samples']} samples"]
    if len(summary["processes"]) > 1:
        lines.append(
            "  by process: " + ", ".join(f"{k} {v}%" for k, v in summary["processes"].items())
        )
    lines.append("  top inclusive (% of samples with the function on the stack):")
    lines += [f"    {pct:5.1f}%  {name}" for name, pct in summary["inclusive"]]
    lines.append("  top self (% of samples in the function itself):")
    lines += [f"    {pct:5.1f}%  {name}" for name, pct in summary["self"]]
    return "\n".join(lines)
