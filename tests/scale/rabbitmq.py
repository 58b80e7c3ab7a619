"""A RabbitMQ cluster for the multi-host tests: one node per network namespace, joined into one.

    bl-r1-<pid>  10.231.0.21  epmd :4369, node rabbit@10.231.0.21 (AMQP :5672, distribution :25672)
    bl-r2-<pid>  10.231.0.22  the same, joined to r1's cluster
    bl-r3-<pid>  10.231.0.23  the same, joined to r1's cluster

Nodes have long names on their IP addresses (RABBITMQ_USE_LONGNAME), so Erlang distribution needs
no name resolution and nothing is written to /etc/hosts or /etc/netns. Each namespace has its
own epmd on the standard port, started here in the foreground so that its PID is ours. A node
is started as scripts/services.sh starts one (env -i: only what we set, its HOME holding the
cluster's Erlang cookie, config, Mnesia and logs in its own directory, no plugins), and joined
with rabbitmqctl stop_app / join_cluster / start_app. rabbitmqctl and rabbitmq-queues run inside
the node's namespace with the same HOME (the cookie) and --longnames.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from tests.conftest import LOG_DIR, wait_until
from tests.scale.cluster import ClusterError, Service, netns

SUBNET = "10.231.0"
RABBIT_HOST_ADDRESSES = {"r1": f"{SUBNET}.21", "r2": f"{SUBNET}.22", "r3": f"{SUBNET}.23"}
AMQP_PORT = 5672
EPMD_PORT = 4369
DIST_PORT = 25672
RABBITMQ_SBIN = Path(os.environ.get("RABBITMQ_SBIN", "/usr/lib/rabbitmq/bin"))
# Each node's own bounds, not 40 % of the machine's memory each: three nodes on a small CI
# machine would otherwise each believe they may take most of it. Measured on 3.10.8: 123-136 MB
# resident once clustered, at most 155 MB through the failover test (its figures).
MEMORY_HIGH_WATERMARK = "512MiB"
DISK_FREE_LIMIT = "50MB"
# Quorum queues write to one WAL per node, kept in memory until it rolls over at this size
# (512 MiB by default): small enough here that it cannot be what raises the memory alarm.
WAL_MAX_SIZE_BYTES = 64 * 1024 * 1024
BOOT_TIMEOUT = 90.0


def rabbitmq_missing() -> list[str]:
    """What the RabbitMQ tests need that is not installed (scripts/scale.sh installs it)."""
    missing = []
    if not (RABBITMQ_SBIN / "rabbitmq-server").exists():
        missing.append(f"rabbitmq-server ({RABBITMQ_SBIN}/rabbitmq-server)")
    if not shutil.which("epmd"):
        missing.append("epmd (erlang-base)")
    return missing


class Epmd(Service):
    """The namespace's Erlang port mapper, in the foreground (`-daemon` would fork away)."""

    def __init__(self, namespace: str, tag: str) -> None:
        super().__init__(f"epmd on {namespace}", LOG_DIR / f"scale-epmd-{namespace}.log")
        self.namespace = namespace

    def start(self) -> None:
        self.spawn(netns(self.namespace, "epmd", "-port", str(EPMD_PORT)))


class RabbitNode(Service):
    """One RabbitMQ node at `address` in `namespace`. The process we spawn is the
    rabbitmq-server script, which turns SIGTERM into a graceful stop of its beam.smp child;
    kill() is kill -9 of the beam.smp itself (its PID from the pid file the node writes)."""

    stop_timeout = 30.0

    def __init__(
        self, namespace: str, address: str, directory: Path, tag: str, cookie: str
    ) -> None:
        # Beside the node's files, not in LOG_DIR: the worker-log scan (tests/system/security)
        # reads every log there, and RabbitMQ's banner names its log file after the node,
        # "rabbit@10.231.0.21.log", which reads as an email address.
        super().__init__(f"rabbitmq {address}", directory.parent / f"rabbitmq-{namespace}.out")
        self.namespace = namespace
        self.address = address
        self.dir = directory
        self.cookie = cookie
        self.nodename = f"rabbit@{address}"
        self.url = f"amqp://guest:guest@{address}:{AMQP_PORT}//"
        self.epmd = Epmd(namespace, tag)

    def env(self) -> dict[str, str]:
        """The environment of the node and of its CLI tools: nothing of ours but this."""
        return {
            "PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"),
            "HOME": str(self.dir),  # .erlang.cookie
            "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8",
            "RABBITMQ_USE_LONGNAME": "true",
        }

    def start(self) -> None:
        """Spawn epmd and the node; does not wait for it (wait_ready)."""
        for sub in ("log", "mnesia"):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        cookie = self.dir / ".erlang.cookie"
        cookie.write_text(self.cookie)
        cookie.chmod(0o400)
        (self.dir / "rabbitmq.conf").write_text(
            "loopback_users = none\n"
            f"vm_memory_high_watermark.absolute = {MEMORY_HIGH_WATERMARK}\n"
            f"disk_free_limit.absolute = {DISK_FREE_LIMIT}\n"
            f"raft.wal_max_size_bytes = {WAL_MAX_SIZE_BYTES}\n"
        )
        (self.dir / "enabled_plugins").write_text("[].\n")
        self.epmd.start()
        d = self.dir
        env = {
            **self.env(),
            "RABBITMQ_NODENAME": self.nodename,
            "RABBITMQ_NODE_IP_ADDRESS": self.address,
            "RABBITMQ_NODE_PORT": str(AMQP_PORT),
            "RABBITMQ_DIST_PORT": str(DIST_PORT),
            # our epmd or none: the node fails rather than start a stray one
            "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS": "-start_epmd false",
            "RABBITMQ_CONF_ENV_FILE": str(d / "rabbitmq-env.conf"),
            "RABBITMQ_CONFIG_FILE": str(d / "rabbitmq.conf"),
            "RABBITMQ_ADVANCED_CONFIG_FILE": str(d / "advanced.config"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(d / "enabled_plugins"),
            "RABBITMQ_ENABLED_PLUGINS": "",
            "RABBITMQ_MNESIA_BASE": str(d / "mnesia"),
            "RABBITMQ_LOG_BASE": str(d / "log"),
            "RABBITMQ_PID_FILE": str(d / "rabbitmq.pid"),
        }
        self.spawn(netns(self.namespace, str(RABBITMQ_SBIN / "rabbitmq-server")), env=env, cwd=d)

    def wait_ready(self, timeout: float = BOOT_TIMEOUT) -> None:
        """Until the broker has booted (its startup banner), then the CLI's await_startup."""

        def booted() -> bool:
            self.alive()
            return "Starting broker... completed" in self.tail(2000)

        wait_until(booted, timeout=timeout, interval=0.2, what=f"{self.name} to boot")
        self.ctl("await_startup", "--timeout", "30", timeout=45)

    def cli(self, tool: str, *args: str, timeout: float = 30) -> str:
        done = subprocess.run(
            netns(
                self.namespace, str(RABBITMQ_SBIN / tool), "-n", self.nodename, "--longnames",
                *args,
            ),
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )  # fmt: skip
        if done.returncode != 0:
            raise ClusterError(
                f"{tool} {' '.join(args)} on {self.nodename} exited {done.returncode}:\n"
                f"{done.stdout[-1500:]}{done.stderr[-1500:]}"
            )
        return done.stdout

    def ctl(self, *args: str, timeout: float = 30) -> str:
        return self.cli("rabbitmqctl", *args, timeout=timeout)

    def join(self, seed: RabbitNode) -> None:
        """Join `seed`'s cluster (this node's own data, empty, is reset by the join)."""
        self.ctl("stop_app")
        self.ctl("join_cluster", seed.nodename, timeout=60)
        self.ctl("start_app", timeout=60)

    def running_nodes(self) -> list[str]:
        status = json.loads(self.ctl("cluster_status", "--formatter", "json"))
        return sorted(status["running_nodes"])

    def quorum_status(self, queue: str) -> dict[str, str]:
        """The Raft state of each reachable member of `queue` ("leader", "follower", ...)."""
        members = json.loads(self.cli("rabbitmq-queues", "quorum_status", queue,
                                      "--formatter", "json", timeout=20))  # fmt: skip
        return {member["Node Name"]: member["Raft State"] for member in members}

    def beam_pid(self) -> int:
        return int((self.dir / "rabbitmq.pid").read_text().strip())

    def usage(self) -> tuple[int, int]:
        """(resident kB, CPU clock ticks used) of the node's beam.smp."""
        pid = self.beam_pid()
        rss = 0
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1])
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return rss, int(fields[11]) + int(fields[12])  # utime + stime

    def kill(self) -> None:
        """kill -9 of the node's beam.smp; returns once the launcher saw it die."""
        os.kill(self.beam_pid(), signal.SIGKILL)
        assert self.process is not None
        self.process.wait(timeout=30)

    def stop(self) -> None:
        super().stop()
        with contextlib.suppress(Exception):
            self.epmd.stop()


def new_cookie() -> str:
    return secrets.token_hex(16).upper()


def leader_of(nodes: list[RabbitNode], queue: str, *, ask: RabbitNode) -> str | None:
    """The node `ask` reports as `queue`'s leader, when one of `nodes` (None while electing)."""
    names = {node.nodename for node in nodes}
    try:
        states = ask.quorum_status(queue)
    except (ClusterError, subprocess.TimeoutExpired, ValueError):
        return None
    leaders = [name for name, state in states.items() if state == "leader" and name in names]
    return leaders[0] if leaders else None


def form_cluster(nodes: list[RabbitNode], timings: dict[str, float], began: float) -> None:
    """Wait for every node's boot, then join the others to the first, one after the other
    (RabbitMQ joins a node at a time); fails unless all of them run in one cluster."""
    for node in nodes:
        node.wait_ready()
    timings["rabbitmq_booted"] = time.monotonic() - began
    seed, *others = nodes
    for node in others:
        node.join(seed)
    expected = sorted(node.nodename for node in nodes)
    wait_until(lambda: seed.running_nodes() == expected, timeout=60, interval=0.5,
               what=f"the cluster to run {expected}")  # fmt: skip
    timings["rabbitmq_clustered"] = time.monotonic() - began


def usage_sample(nodes: list[RabbitNode]) -> dict[str, Any]:
    """One reading of every node (those alive) and of the machine's CPU time."""
    sample: dict[str, Any] = {"at": time.time(), "nodes": {}}
    for node in nodes:
        with contextlib.suppress(OSError, ValueError):
            sample["nodes"][node.nodename] = node.usage()
    cpu = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    ticks = [int(value) for value in cpu]
    sample["machine"] = (sum(ticks) - ticks[3] - ticks[4], sum(ticks))  # busy, total
    return sample
