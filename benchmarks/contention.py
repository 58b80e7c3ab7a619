"""How much of the machine other work took while a case ran ("foreign" CPU).

The machine's busy time (/proc/stat) minus the CPU of our own processes: this runner and
every process it waited for (cases, workers, gunicorn, via cutime/cstime), and the benchmark
PostgreSQL, Redis and RabbitMQ servers (found by their ports). Whatever is left ran beside the case
and slowed it; a figure measured under a large foreign share is not worth much.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

HZ = os.sysconf("SC_CLK_TCK")


def _stat(pid: int | str) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _ticks(fields: list[str], children: bool = True) -> int:
    # fields[0] is the state (3rd field of stat): utime=11, stime=12, cutime=13, cstime=14
    own = int(fields[11]) + int(fields[12])
    return own + (int(fields[13]) + int(fields[14]) if children else 0)


def _processes() -> dict[int, tuple[int, list[str]]]:
    out = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            fields = _stat(entry.name)
            if fields:
                out[int(entry.name)] = (int(fields[1]), fields)
    return out


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
    except OSError:
        return b""


def server_pids(
    *, pg_port: int | None = None, redis_port: int | None = None, amqp_port: int | None = None
) -> list[int]:
    """PIDs of the benchmark's servers listening on these ports: PostgreSQL's postmaster,
    redis-server, and the RabbitMQ node scripts/services.sh starts (its beam.smp is told its
    own epmd, on the AMQP port - 1300)."""
    roots = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        line = _cmdline(int(entry.name))
        if (
            (
                pg_port
                and line.startswith(b"/")
                and b"postgres" in line
                and f"-p {pg_port}".encode() in line
            )
            or (
                redis_port
                and line.startswith(b"redis-server")
                and f":{redis_port}".encode() in line
            )
            or (
                amqp_port
                and b"beam.smp" in line
                and f"-epmd_port {amqp_port - 1300} ".encode() in line
            )
        ):
            roots.append(int(entry.name))
    return roots


class Contention:
    def __init__(
        self, pg_port: int | None, redis_port: int | None, amqp_port: int | None = None
    ) -> None:
        self.ports = {"pg_port": pg_port, "redis_port": redis_port, "amqp_port": amqp_port}
        self.mark = self._snapshot()

    def _ours(self, procs: dict[int, tuple[int, list[str]]]) -> int:
        roots = [os.getpid(), *(p for p in server_pids(**self.ports) if p in procs)]
        children: dict[int, list[int]] = {}
        for pid, (ppid, _) in procs.items():
            children.setdefault(ppid, []).append(pid)
        total, seen, stack = 0, set(), list(roots)
        while stack:
            pid = stack.pop()
            if pid in seen or pid not in procs:
                continue
            seen.add(pid)
            total += _ticks(procs[pid][1])
            stack.extend(children.get(pid, []))
        return total

    def _snapshot(self) -> tuple[float, int, int]:
        values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        busy = sum(values) - values[3] - values[4]
        return time.monotonic(), busy, self._ours(_processes())

    def foreign_pct(self) -> float:
        """Foreign CPU since the last call, in % of one core (200 % = both cores of 2)."""
        then, busy0, ours0 = self.mark
        self.mark = now, busy1, ours1 = self._snapshot()
        elapsed = max(1e-6, now - then)
        return round(max(0.0, (busy1 - busy0) - (ours1 - ours0)) / HZ / elapsed * 100, 1)
