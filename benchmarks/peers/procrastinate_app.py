"""Procrastinate on PostgreSQL (peers venv only):
`procrastinate --app=benchmarks.peers.procrastinate_app.app worker`."""

from __future__ import annotations

import os

import procrastinate

from benchmarks.peers import _stamp

app = procrastinate.App(
    connector=procrastinate.PsycopgConnector(conninfo=os.environ["PEERS_PROCRASTINATE_URL"])
)


@app.task(queue="default", name="noop")
def noop(i: int) -> None:
    """Nothing: what the drain measures is the queue."""


@app.task(queue="default", name="stamp")
def stamp(key: str) -> None:
    _stamp.stamp(key)
