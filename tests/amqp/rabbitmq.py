"""The RabbitMQ node the suite's sites use, and its rabbitmqctl: the one `make test` starts
(BACKLOT_TEST_AMQP_URL) when scripts/services.sh started it under .data/ (its rabbitmqctl is
then at hand: each site gets a vhost of its own, deleted afterwards); else a private node on
free ports, started and stopped with scripts/services.sh."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

from tests.conftest import ROOT

# The AMQP port range services.sh accepts (epmd on PORT-1300, distribution on PORT+20000).
PRIVATE_PORTS = range(20000, 25000)
RABBITMQ_SBIN = Path(os.environ.get("RABBITMQ_SBIN", "/usr/lib/rabbitmq/bin"))


def port_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class RabbitMQ:
    """A RabbitMQ node and its rabbitmqctl: `make test`'s, or a private one."""

    def __init__(self, tmp: Path) -> None:
        self.datadir: Path | None = None  # a private node's, stopped at the end
        url = os.environ.get("BACKLOT_TEST_AMQP_URL", "")
        node = self._services_node(url) if url else None
        if node is None:
            url, node = self._start_private(tmp)
        self.url = url
        self.node, self.home, self.epmd_port = node

    @staticmethod
    def _services_node(url: str) -> tuple[str, Path, int] | None:
        """The node scripts/services.sh started under .data/ for `url` (node, HOME, epmd port)."""
        port = urlsplit(url).port or 5672
        for description in (ROOT / ".data").glob("*/node"):
            name, node_port, _, epmd_port = description.read_text().split()
            if int(node_port) == port and (description.parent / "rabbitmq.pid").exists():
                return name, description.parent, int(epmd_port)
        return None

    def _start_private(self, tmp: Path) -> tuple[str, tuple[str, Path, int]]:
        candidates = list(PRIVATE_PORTS)
        random.shuffle(candidates)
        port = next(p for p in candidates if all(port_free(q) for q in (p, p - 1300, p + 20000)))
        url = f"amqp://guest:guest@127.0.0.1:{port}//"
        self.datadir = tmp / "rabbitmq"
        self._services("rabbitmq-up", url, str(self.datadir))
        name = (self.datadir / "node").read_text().split()[0]
        return url, (name, self.datadir, port - 1300)

    @staticmethod
    def _services(*args: str) -> None:
        done = subprocess.run(
            ["bash", str(ROOT / "scripts" / "services.sh"), *args],
            capture_output=True,
            text=True,
            timeout=180,
            check=False,
        )
        assert done.returncode == 0, f"services.sh {args[0]}: {done.stderr[-3000:]}"

    def ctl(self, *args: str) -> str:
        """rabbitmqctl ARGS against the node; its output."""
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(self.home),
            "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8",
            "ERL_EPMD_PORT": str(self.epmd_port),
        }
        done = subprocess.run(
            [str(RABBITMQ_SBIN / "rabbitmqctl"), "-n", self.node, "-q", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 0, f"rabbitmqctl {' '.join(args)}: {done.stderr[-2000:]}"
        return done.stdout

    def ctl_json(self, *args: str) -> list[dict[str, Any]]:
        """rabbitmqctl ARGS --formatter json: its rows."""
        return list(json.loads(self.ctl(*args, "--formatter", "json")))

    def add_vhost(self, name: str) -> str:
        """A fresh vhost the URL's user may use fully; its amqp:// URL."""
        parts = urlsplit(self.url)
        self.ctl("add_vhost", name)
        self.ctl("set_permissions", "-p", name, parts.username or "guest", ".*", ".*", ".*")
        return urlunsplit(parts._replace(path=f"/{quote(name, safe='')}"))

    def queues(self, vhost: str) -> dict[str, dict[str, Any]]:
        """name -> {type, durable, arguments} of the vhost's queues, as rabbitmqctl lists them."""
        rows = self.ctl_json("list_queues", "-p", vhost, "name", "type", "durable", "arguments")
        return {row["name"]: row for row in rows}

    def unacknowledged_by_port(self, vhost: str) -> dict[int, int]:
        """Client port -> messages delivered on that connection's channels and not yet
        acknowledged (a channel is named "CLIENT:PORT -> SERVER:PORT (N)")."""
        held: dict[int, int] = {}
        rows = self.ctl_json("list_channels", "-p", vhost, "name", "messages_unacknowledged")
        for row in rows:
            client = str(row["name"]).split(" -> ", 1)[0]
            port = int(client.rsplit(":", 1)[1])
            held[port] = held.get(port, 0) + int(row["messages_unacknowledged"])
        return held

    def stop(self) -> None:
        if self.datadir is not None:
            self._services("rabbitmq-down", str(self.datadir))
