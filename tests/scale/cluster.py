"""A three-host cluster on one machine: Linux network namespaces joined by veth pairs.

    bl-svc-<pid>  10.231.0.1   bridge br0; redis-server :6379 and PostgreSQL :5432
    bl-h1-<pid>   10.231.0.11  one `celery -A config worker`, UTS hostname bl-h1-<pid>
    bl-h2-<pid>   10.231.0.12  one `celery -A config worker`, UTS hostname bl-h2-<pid>

Each host namespace has its own loopback and one veth whose peer sits on the bridge inside the
services namespace; nothing (no address, no interface, no route) is added to the machine's own
namespace, so the fixed addresses and ports cannot collide with anything else on the machine,
including another run of this test. Processes enter a namespace with `ip netns exec`, which
execs the command: the PID we hold is the server's or worker's own, and we stop it by that PID.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import IO, Any

from tests.conftest import LOG_DIR, ROOT, wait_until

SUBNET = "10.231.0"
SERVICES_ADDRESS = f"{SUBNET}.1"
REDIS_PORT = 6379
POSTGRES_PORT = 5432
HOST_ADDRESSES = {"h1": f"{SUBNET}.11", "h2": f"{SUBNET}.12"}
# The failover test's Redis hosts (tests/scale/test_failover.py): the primary and its replica.
REDIS_HOST_ADDRESSES = {"pri": f"{SUBNET}.2", "rep": f"{SUBNET}.3"}
SENTINEL_PORTS = (26379, 26380, 26381)
# r1-r3: the RabbitMQ nodes of tests/scale/test_rabbitmq_failover.py (tests/scale/rabbitmq.py).
NAME_RE = re.compile(r"^bl-(svc|h1|h2|pri|rep|r1|r2|r3)-(\d+)$")


class ClusterError(AssertionError):
    """The cluster could not be built; the message says what to fix."""


def run(args: list[str], timeout: float = 30, **kwargs: Any) -> subprocess.CompletedProcess:
    """Run a command to completion; fail with its output when it exits non-zero."""
    done = subprocess.run(
        args, capture_output=True, text=True, timeout=timeout, check=False, **kwargs
    )
    if done.returncode != 0:
        raise ClusterError(
            f"{' '.join(args)} exited {done.returncode}:\n"
            f"{done.stdout[-2000:]}{done.stderr[-2000:]}"
        )
    return done


def require_privileges() -> None:
    """Fail (never skip) with what is missing: CI runs this as root, so a skip would hide it."""
    if os.geteuid() != 0:
        raise ClusterError(
            "the scale test builds Linux network namespaces and must run as root "
            "(make test-scale as root; CI runs as root)"
        )
    missing = [
        tool for tool in ("ip", "unshare", "redis-server", "redis-cli") if not shutil.which(tool)
    ]
    if postgres_bin() is None:
        missing.append("PostgreSQL server binaries (/usr/lib/postgresql/*/bin)")
    if missing:
        raise ClusterError(
            f"the scale test needs {', '.join(missing)}; "
            "scripts/scale.sh (make test-scale) installs them with apt-get"
        )
    try:
        pwd.getpwnam("postgres")
    except KeyError:
        raise ClusterError("no `postgres` system user to run PostgreSQL as") from None
    done = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise ClusterError(f"`ip netns` does not work here: {done.stderr.strip()}")


def postgres_bin() -> Path | None:
    """The newest installed PostgreSQL's bin directory (as scripts/services.sh picks it)."""
    found = [
        path
        for path in Path("/usr/lib/postgresql").glob("*/bin")
        if (path / "postgres").exists() and (path / "initdb").exists()
    ]
    if not found:
        return None
    return max(found, key=lambda path: int(path.parent.name) if path.parent.name.isdigit() else 0)


def remove_stale_namespaces() -> list[str]:
    """Delete namespaces of earlier runs (bl-svc/h1/h2-<pid>) whose pytest process is gone and
    in which no process runs any more: a run killed with SIGKILL cannot clean up after itself."""
    done = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False)
    removed = []
    for line in done.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        match = NAME_RE.match(name)
        if not match or Path(f"/proc/{match[2]}").exists():
            continue
        pids = subprocess.run(
            ["ip", "netns", "pids", name], capture_output=True, text=True, check=False
        ).stdout.split()
        if not pids:
            subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)
            removed.append(name)
    return removed


class Network:
    """The three namespaces and their links; delete() is safe to call at any point."""

    def __init__(self, tag: str, extra: dict[str, str] | None = None) -> None:
        self.services = f"bl-svc-{tag}"
        self.hosts = {host: f"bl-{host}-{tag}" for host in HOST_ADDRESSES}
        # More hosts on the bridge (name -> address), e.g. REDIS_HOST_ADDRESSES.
        self.extra = {host: f"bl-{host}-{tag}" for host in extra or {}}
        self.addresses = {**HOST_ADDRESSES, **(extra or {})}
        self.created: list[str] = []

    def namespaces(self) -> list[str]:
        return [self.services, *self.hosts.values(), *self.extra.values()]

    def set_link(self, host: str, up: bool) -> None:
        """Connect or cut `host` (its bridge port in the services namespace): while cut, its
        packets go nowhere and nothing reaches it; the processes in it notice nothing."""
        run(["ip", "-n", self.services, "link", "set", f"v{host}", "up" if up else "down"])

    def create(self) -> None:
        for name in self.namespaces():
            run(["ip", "netns", "add", name])
            self.created.append(name)
            run(["ip", "-n", name, "link", "set", "lo", "up"])
        svc = self.services
        run(["ip", "-n", svc, "link", "add", "br0", "type", "bridge"])
        run(["ip", "-n", svc, "addr", "add", f"{SERVICES_ADDRESS}/24", "dev", "br0"])
        run(["ip", "-n", svc, "link", "set", "br0", "up"])
        for host, name in {**self.hosts, **self.extra}.items():
            # eth0 in the host's namespace; its peer is created directly in the services one
            peer = f"v{host}"
            run(
                [
                    "ip",
                    "-n",
                    name,
                    "link",
                    "add",
                    "eth0",
                    "type",
                    "veth",
                    "peer",
                    "name",
                    peer,
                    "netns",
                    svc,
                ]
            )
            run(["ip", "-n", svc, "link", "set", peer, "master", "br0"])
            run(["ip", "-n", svc, "link", "set", peer, "up"])
            run(["ip", "-n", name, "addr", "add", f"{self.addresses[host]}/24", "dev", "eth0"])
            run(["ip", "-n", name, "link", "set", "eth0", "up"])

    def delete(self) -> list[str]:
        """Delete every namespace we created (their veths and the bridge go with them)."""
        errors = []
        for name in reversed(self.created):
            done = subprocess.run(
                ["ip", "netns", "del", name], capture_output=True, text=True, check=False
            )
            if done.returncode != 0:
                errors.append(f"ip netns del {name}: {done.stderr.strip()}")
        self.created.clear()
        return errors


def netns(namespace: str, *command: str) -> list[str]:
    return ["ip", "netns", "exec", namespace, *command]


class Service:
    """A process we started inside a namespace, stopped by its PID (and its process group)."""

    stop_signal = signal.SIGTERM
    stop_timeout = 30.0

    def __init__(self, name: str, log_path: Path) -> None:
        self.name = name
        self.log_path = log_path
        self.log: IO[bytes] | None = None
        self.process: subprocess.Popen | None = None
        self.stopping = False

    def spawn(self, args: list[str], env: dict[str, str] | None = None, cwd: Path = ROOT) -> None:
        LOG_DIR.mkdir(parents=True, exist_ok=True)
        self.log = open(self.log_path, "wb")  # noqa: SIM115 (the process writes it until stop())
        self.process = subprocess.Popen(
            args,
            cwd=cwd,
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: pool children go with it
        )

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def alive(self) -> bool:
        if self.process is None or self.process.poll() is not None:
            raise AssertionError(f"{self.name} exited:\n{self.tail()}")
        return True

    def tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"

    def signal_stop(self) -> None:
        """Send the stop signal once (stop() waits for it); lets several stop in parallel."""
        if self.process is not None and self.process.poll() is None and not self.stopping:
            self.process.send_signal(self.stop_signal)
            self.stopping = True

    def stop(self) -> None:
        """Stop by signal; if not gone within stop_timeout, SIGKILL the process group."""
        process = self.process
        if process is not None and process.poll() is None:
            self.signal_stop()
            try:
                process.wait(timeout=self.stop_timeout)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=10)
        if process is not None:
            # Children that outlived a clean exit of their leader (none expected): same group.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
        if self.log is not None:
            self.log.close()
            self.log = None


class Redis(Service):
    """redis-server in the services namespace, bound to its bridge address only (or in another
    namespace at `address`, a replica of `replicaof` when given)."""

    def __init__(
        self,
        namespace: str,
        directory: Path,
        tag: str,
        *,
        address: str = SERVICES_ADDRESS,
        replicaof: str | None = None,
        role: str = "redis",
    ) -> None:
        super().__init__(f"redis-server ({role})", LOG_DIR / f"scale-{role}-{tag}.log")
        self.namespace = namespace
        self.dir = directory
        self.address = address
        self.replicaof = replicaof
        self.url = f"redis://{address}:{REDIS_PORT}/0"

    def start(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        # The options of scripts/services.sh (AOF everysec, noeviction, no snapshots), not
        # daemonized so that the PID is ours. Protected mode would refuse the other hosts: the
        # server listens on the private bridge only.
        self.spawn(
            netns(
                self.namespace,
                "redis-server",
                "--bind", self.address,
                "--port", str(REDIS_PORT),
                "--protected-mode", "no",
                "--appendonly", "yes",
                "--appendfsync", "everysec",
                "--dir", str(self.dir),
                "--save", "",
                "--maxmemory-policy", "noeviction",
                "--daemonize", "no",
                *(["--replicaof", *self.replicaof.split(":")] if self.replicaof else []),
            )
        )  # fmt: skip
        wait_until(self.answers, timeout=30, interval=0.1, what=f"{self.name} to answer")

    def answers(self) -> bool:
        self.alive()
        return self.cli("ping") == "PONG"

    def cli(self, *command: str) -> str:
        """One redis-cli command against this server, from inside its namespace."""
        return redis_cli(self.namespace, self.address, REDIS_PORT, *command)

    def kill(self) -> None:
        """kill -9, and wait until the process is gone (its sockets closed)."""
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=30)


def redis_cli(namespace: str, host: str, port: int, *command: str) -> str:
    done = subprocess.run(
        netns(namespace, "redis-cli", "-h", host, "-p", str(port), *command),
        capture_output=True,
        text=True,
        timeout=10,
        check=False,
    )
    return done.stdout.strip()


class Sentinel(Service):
    """`redis-server sentinel.conf --sentinel` (Redis' own Sentinel mode: the redis-sentinel
    package is only a link to it) in the services namespace, watching `master` as MASTER_NAME.

    A failover starts once `quorum` Sentinels have found the master unreachable for
    `down_after` ms; the config file is the Sentinel's own (it rewrites it)."""

    MASTER_NAME = "backlot"

    def __init__(
        self,
        namespace: str,
        directory: Path,
        tag: str,
        port: int,
        master: str,
        *,
        quorum: int = 2,
        down_after: int = 3000,
    ) -> None:
        super().__init__(f"sentinel :{port}", LOG_DIR / f"scale-sentinel-{port}-{tag}.log")
        self.namespace = namespace
        self.dir = directory
        self.port = port
        self.master = master
        self.quorum = quorum
        self.down_after = down_after
        self.address = f"{SERVICES_ADDRESS}:{port}"

    def start(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        host, port = self.master.split(":")
        config = self.dir / "sentinel.conf"
        config.write_text(
            f"port {self.port}\nbind {SERVICES_ADDRESS}\nprotected-mode no\ndir {self.dir}\n"
            f"sentinel monitor {self.MASTER_NAME} {host} {port} {self.quorum}\n"
            f"sentinel down-after-milliseconds {self.MASTER_NAME} {self.down_after}\n"
            f"sentinel failover-timeout {self.MASTER_NAME} 20000\n"
            f"sentinel parallel-syncs {self.MASTER_NAME} 1\n"
        )
        self.spawn(netns(self.namespace, "redis-server", str(config), "--sentinel"))
        wait_until(self.answers, timeout=30, interval=0.1, what=f"{self.name} to answer")

    def answers(self) -> bool:
        self.alive()
        return self.cli("ping") == "PONG"

    def cli(self, *command: str) -> str:
        return redis_cli(self.namespace, SERVICES_ADDRESS, self.port, *command)

    def master_address(self) -> str:
        """host:port of the master this Sentinel names now."""
        reply = self.cli("sentinel", "get-master-addr-by-name", self.MASTER_NAME).split()
        return ":".join(reply)

    def known(self) -> tuple[int, int]:
        """(replicas, other Sentinels) this Sentinel knows of the master."""
        fields = self.cli("sentinel", "master", self.MASTER_NAME).splitlines()
        info = dict(zip(fields[::2], fields[1::2], strict=False))
        return int(info.get("num-slaves", 0)), int(info.get("num-other-sentinels", 0))


class Process(Service):
    """Any command of the project (e.g. `manage.py jobs relay`) in a namespace."""

    def __init__(self, namespace: str, name: str, env: dict[str, str], *args: str) -> None:
        super().__init__(f"{name} on {namespace}", LOG_DIR / f"scale-{name}-{namespace}.log")
        self.namespace = namespace
        self.env = env
        self.args = args

    def start(self) -> None:
        self.spawn(netns(self.namespace, *self.args), env=self.env)

    def json_lines(self) -> list[dict[str, Any]]:
        """The JSON lines it logged so far (a load driver's progress reports), in order."""
        return [
            json.loads(line)
            for line in self.log_path.read_text(errors="replace").splitlines()
            if line.startswith("{")
        ]

    def accepted(self) -> int:
        """How many jobs a load driver reported accepted so far (0 before its first report)."""
        lines = self.json_lines()
        return int(lines[-1]["accepted"]) if lines else 0


class Postgres(Service):
    """A fresh PostgreSQL cluster in the services namespace, listening on its bridge address.

    As scripts/services.sh makes it (initdb as the postgres user, role backlot, trust, fsync off)
    but started in the foreground through setpriv, which execs: the PID is the postmaster's.
    Trust is extended to the private /24 so that the worker hosts can connect.
    """

    stop_signal = signal.SIGINT  # PostgreSQL's fast shutdown: sessions end, the server exits

    def __init__(self, namespace: str, directory: Path, tag: str) -> None:
        super().__init__("postgres", LOG_DIR / f"scale-postgres-{tag}.log")
        self.namespace = namespace
        self.dir = directory
        self.bin = postgres_bin() or Path("/nonexistent")
        self.url = f"postgres://backlot@{SERVICES_ADDRESS}:{POSTGRES_PORT}/backlot"

    def as_postgres(self, *command: str) -> list[str]:
        return ["setpriv", "--reuid=postgres", "--regid=postgres", "--init-groups", "--", *command]

    def start(self) -> None:
        self.dir.mkdir(parents=True)
        shutil.chown(self.dir, "postgres", "postgres")
        self.dir.chmod(0o700)
        run(
            self.as_postgres(
                str(self.bin / "initdb"), "-D", str(self.dir), "-U", "backlot",
                "--auth=trust", "-E", "UTF8", "--locale=C", "--no-sync",
            ),
            timeout=120,
            cwd=self.dir.parent,
        )  # fmt: skip
        with open(self.dir / "pg_hba.conf", "a") as hba:
            hba.write(f"host all backlot {SUBNET}.0/24 trust\n")
        self.spawn(
            netns(
                self.namespace,
                *self.as_postgres(
                    str(self.bin / "postgres"), "-D", str(self.dir),
                    "-c", f"listen_addresses={SERVICES_ADDRESS}",
                    "-c", f"port={POSTGRES_PORT}",
                    "-c", "unix_socket_directories=",
                    "-c", "max_connections=200",
                    "-c", "fsync=off", "-c", "synchronous_commit=off", "-c", "full_page_writes=off",
                ),
            ),
            cwd=self.dir.parent,
        )  # fmt: skip
        wait_until(self.answers, timeout=60, interval=0.1, what="PostgreSQL to accept connections")
        run(
            netns(
                self.namespace,
                str(self.bin / "psql"), "-X", "-q", "-v", "ON_ERROR_STOP=1",
                "-h", SERVICES_ADDRESS, "-p", str(POSTGRES_PORT), "-U", "backlot", "-d", "postgres",
                "-c", "create database backlot owner backlot",
            )
        )  # fmt: skip

    def answers(self) -> bool:
        self.alive()
        done = subprocess.run(
            netns(
                self.namespace,
                str(self.bin / "pg_isready"), "-q", "-h", SERVICES_ADDRESS,
                "-p", str(POSTGRES_PORT), "-U", "backlot", "-d", "postgres", "-t", "2",
            ),
            capture_output=True,
            timeout=10,
            check=False,
        )  # fmt: skip
        return done.returncode == 0


class CeleryWorker(Service):
    """`celery -A config worker` in a host namespace with that host's own UTS hostname, so
    that `-n scale@%h` (and the hostname each job records) names the host it ran on.

    SIGTERM is Celery's soft shutdown (config/celery.py); CELERY_WORKER_SOFT_SHUTDOWN_TIMEOUT in
    `env` bounds it (the platform's 30 s is spent even by an idle worker).
    """

    stop_timeout = 40.0

    def __init__(
        self,
        namespace: str,
        env: dict[str, str],
        concurrency: int,
        *,
        imports: str = "tests.scale.jobs",
        queues: str = "emails,default",
    ) -> None:
        super().__init__(f"worker on {namespace}", LOG_DIR / f"scale-worker-{namespace}.log")
        self.namespace = namespace
        self.env = env
        self.concurrency = concurrency
        self.imports = imports
        self.queues = queues
        self.nodename = f"scale@{namespace}"

    def start(self) -> None:
        self.spawn(
            netns(
                self.namespace,
                "unshare", "--uts", "--",
                "sh", "-c", 'hostname "$1" && shift && exec "$@"', "sh", self.namespace,
                sys.executable, "-m", "celery", "-A", "config", "worker",
                # The kombu Redis transport reads its queues in this order (the platform's
                # queue_order_strategy is "priority"): the rate-limited queue first.
                "-Q", self.queues,
                "-c", str(self.concurrency),
                "-n", "scale@%h",
                "-I", self.imports,
                "-l", "INFO",
            ),
            env=self.env,
        )  # fmt: skip
