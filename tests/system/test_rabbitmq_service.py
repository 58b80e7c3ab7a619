"""scripts/services.sh rabbitmq-up/-down/-status: a private RabbitMQ node that serves AMQP and
leaves no process behind (node, epmd, helpers) once stopped; each command idempotent.

The node gets ports of its own (AMQP, epmd at AMQP - 1300, distribution at AMQP + 20000) and a
data dir under tmp_path, so it runs beside the test run's RabbitMQ (:5682) and any other.
"""

from __future__ import annotations

import random
import socket
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from kombu import Connection

from tests.conftest import ROOT, wait_until

SERVICES = ROOT / "scripts" / "services.sh"
# Measured here: up takes about 7 s on a fresh data dir, down about 1 s.
COMMAND_TIMEOUT = 120


def services(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SERVICES), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT,
        check=False,
    )


def port_free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def node_ports() -> tuple[int, int, int]:
    """(AMQP, epmd, distribution) ports, all free; below the ephemeral range, where
    free_port()'s picks of other tests land."""
    for _ in range(100):
        amqp = random.randrange(7000, 12000)
        ports = (amqp, amqp - 1300, amqp + 20000)
        if all(port_free(p) for p in ports):
            return ports
    raise AssertionError("no free AMQP/epmd/distribution port triple found")


def listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


def alive(pid: int) -> bool:
    """The process exists and is not a zombie (an exited child its parent has not reaped)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return "\nState:\tZ" not in status


def node_processes(datadir: Path) -> set[int]:
    """Every live process of the node (rabbitmq-server's shell, beam.smp, erl_child_setup,
    inet_gethost...): services.sh marks their environment with the data dir."""
    mark = f"BACKLOT_RABBITMQ_DATA={datadir}".encode()
    found = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            environ = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if mark in environ and alive(int(proc.name)):
            found.add(int(proc.name))
    return found


@pytest.fixture
def node(tmp_path: Path) -> Iterator[tuple[str, Path, tuple[int, int, int]]]:
    ports = node_ports()
    datadir = tmp_path / "rabbitmq"
    yield f"amqp://guest:guest@127.0.0.1:{ports[0]}//", datadir, ports
    services("rabbitmq-down", str(datadir))  # whatever the test left running


def test_rabbitmq_up_serves_amqp_and_down_leaves_nothing(
    node: tuple[str, Path, tuple[int, int, int]],
) -> None:
    url, datadir, (amqp_port, epmd_port, dist_port) = node

    # given a node started twice: the second up finds it and changes nothing
    first = services("rabbitmq-up", url, str(datadir))
    assert first.returncode == 0, first.stderr[-3000:]
    beam = int((datadir / "rabbitmq.pid").read_text())
    epmd = int((datadir / "epmd.pid").read_text())
    again = services("rabbitmq-up", url, str(datadir))
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"started by us, pid {beam}" in again.stderr
    assert int((datadir / "epmd.pid").read_text()) == epmd

    status = services("rabbitmq-status", str(datadir))
    assert status.returncode == 0, status.stdout + status.stderr
    assert f"pid {beam}" in status.stdout
    assert (datadir / "node").read_text().split() == [
        f"backlot_amqp{amqp_port}@localhost",
        str(amqp_port),
        str(dist_port),
        str(epmd_port),
    ]
    assert all(listening(p) for p in (amqp_port, epmd_port, dist_port))

    # when a message goes through it
    queue_name = f"services-test-{uuid.uuid4().hex}"
    with Connection(url, connect_timeout=5) as conn:
        queue = conn.SimpleQueue(queue_name, queue_opts={"auto_delete": True})
        try:
            queue.put({"hello": "rabbit"})
            message = queue.get(block=True, timeout=10)
            message.ack()
        finally:
            queue.close()
    assert message.payload == {"hello": "rabbit"}

    processes = node_processes(datadir)
    assert beam in processes

    # then down stops the node, every process it started and its epmd, and closes the ports
    down = services("rabbitmq-down", str(datadir))
    assert down.returncode == 0, down.stderr[-3000:]
    assert not alive(beam)
    assert not alive(epmd)
    assert not {pid for pid in processes if alive(pid)}
    assert not node_processes(datadir)
    wait_until(
        lambda: not any(listening(p) for p in (amqp_port, epmd_port, dist_port)),
        timeout=5,
        what="the node's ports to close",
    )
    assert not (datadir / "rabbitmq.pid").exists()
    assert not (datadir / "epmd.pid").exists()

    status = services("rabbitmq-status", str(datadir))
    assert status.returncode == 1
    down_again = services("rabbitmq-down", str(datadir))
    assert down_again.returncode == 0, down_again.stderr[-3000:]
    assert "nothing to stop" in down_again.stderr


def test_rabbitmq_status_and_down_remove_stale_pid_files(tmp_path: Path) -> None:
    # given pid files naming processes that are gone (a node killed with the machine)
    datadir = tmp_path / "rabbitmq"
    datadir.mkdir()
    dead = subprocess.Popen(["true"])
    dead.wait()
    (datadir / "rabbitmq.pid").write_text(f"{dead.pid}\n")
    (datadir / "epmd.pid").write_text(f"{dead.pid}\n")

    # when status and down look at them
    status = services("rabbitmq-status", str(datadir))
    down = services("rabbitmq-down", str(datadir))

    # then nothing is reported running, nothing is signalled, and the stale files are gone
    assert status.returncode == 1
    assert "not running" in status.stdout
    assert down.returncode == 0, down.stderr[-3000:]
    assert not (datadir / "rabbitmq.pid").exists()
    assert not (datadir / "epmd.pid").exists()
