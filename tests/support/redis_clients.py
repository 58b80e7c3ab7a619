"""Which Redis clients belong to a process: the local ports of its TCP sockets (from /proc),
matched against CLIENT LIST's addresses (tests/jobs/broker/test_fetch.py, the lost-message test);
and what they send (Monitor)."""

from __future__ import annotations

import contextlib
import os
import threading
import uuid
from typing import Any

import redis

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


class Monitor:
    """Every command a Redis runs from now until stop() (MONITOR), in order, as (client address,
    client port, command): a script's own commands follow its EVAL/EVALSHA from the client
    "lua". It ends on a command of its own, read after every command sent before it (a stop
    flag checked between reads dropped the commands still buffered when it was set)."""

    def __init__(self, url: str) -> None:
        # a client of its own with no read timeout: MONITOR may be silent for a while
        self.client = redis.Redis.from_url(url)
        self.lines: list[tuple[str, str, str]] = []
        self._stop = f"backlot-test-monitor-stop-{uuid.uuid4().hex}"
        ready = threading.Event()
        self._thread = threading.Thread(target=self._listen, args=(ready,), daemon=True)
        self._thread.start()
        assert ready.wait(10), "MONITOR did not start"

    def _listen(self, ready: threading.Event) -> None:
        with self.client.monitor() as monitor:  # MONITOR is on once its OK is read
            ready.set()
            for line in monitor.listen():
                command = str(line.get("command", ""))
                if self._stop in command:
                    return
                address = str(line.get("client_address", ""))
                self.lines.append((address, str(line.get("client_port", "")), command))

    def stop(self, client: redis.Redis) -> list[tuple[str, str, str]]:
        """What was seen until now (`client`, on the same Redis, sends the command that ends
        it)."""
        client.get(self._stop)
        self._thread.join(30)
        assert not self._thread.is_alive(), "MONITOR did not read its stop"
        return self.lines
