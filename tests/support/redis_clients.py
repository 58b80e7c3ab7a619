"""Which Redis clients belong to a process: the local ports of its TCP sockets (from /proc),
matched against CLIENT LIST's addresses (tests/jobs/broker/test_fetch.py, the lost-message test)."""

from __future__ import annotations

import contextlib
import os
from typing import Any

from jobs.broker.redis import redis_client


def socket_ports(pid: int) -> set[int]:
    """Local TCP ports of the sockets process `pid` has open."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):  # closed meanwhile
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("socket:["):
                inodes.add(target[len("socket:[") : -1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as rows:
            next(rows)
            for row in rows:
                fields = row.split()
                if fields[9] in inodes:
                    ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def clients_of(*pids: int) -> list[dict[str, Any]]:
    """CLIENT LIST's entries of the connections processes `pids` hold to this Redis."""
    ports = set().union(*(socket_ports(pid) for pid in pids))
    return [
        client
        for client in redis_client().client_list()
        if int(client["addr"].rsplit(":", 1)[1]) in ports
    ]


def waiting_for_a_bell(pid: int) -> bool:
    """A client of `pid` is blocked in BRPOP (jobs.broker.fetch's consumer waiting for a bell)."""
    return any(
        client.get("cmd") == "brpop" and "b" in client["flags"] for client in clients_of(pid)
    )
