"""Dead jobs as errors: an ERROR log line with ids and the exception class, and one Sentry
event per dead job (none for its retries) with its arguments masked, sent by a real worker
whose SDK posts to a local HTTP server standing in for the DSN's ingest URL."""

from __future__ import annotations

import gzip
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from jobs.core.masking import mask_email
from jobs.models import DeadLetter
from tests.conftest import marks, wait_until
from tests.support import tasks

ADDRESS = "ann.lee@example.com"


class Ingest:
    """What the SDK posted to /api/1/envelope/, in arrival order, as decoded envelopes."""

    def __init__(self) -> None:
        self.envelopes: list[tuple[str, bytes]] = []  # (path, decompressed body)
        self.lock = threading.Lock()

    def events(self) -> list[dict[str, Any]]:
        with self.lock:
            bodies = [body for path, body in self.envelopes if path == "/api/1/envelope/"]
        return [item for body in bodies for kind, item in parse_envelope(body) if kind == "event"]


def parse_envelope(body: bytes) -> Iterator[tuple[str, dict[str, Any]]]:
    """(type, payload) of each item: a header line, then items of a header line and a payload
    (`length` bytes when given, else up to the next newline)."""
    _, _, rest = body.partition(b"\n")
    while rest.strip():
        line, _, rest = rest.partition(b"\n")
        header = json.loads(line)
        if "length" in header:
            payload, rest = rest[: header["length"]], rest[header["length"] :].lstrip(b"\n")
        else:
            payload, _, rest = rest.partition(b"\n")
        yield header.get("type", ""), json.loads(payload) if payload.strip() else {}


def decompress(body: bytes, encoding: str) -> bytes:
    if encoding == "gzip":
        return gzip.decompress(body)
    if encoding == "br":  # the SDK prefers brotli when the module is installed
        import brotli

        return bytes(brotli.decompress(body))
    return body


@contextmanager
def ingest_server() -> Iterator[tuple[Ingest, int]]:
    ingest = Ingest()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            body = decompress(raw, self.headers.get("Content-Encoding", ""))
            with ingest.lock:
                ingest.envelopes.append((self.path, body))
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, format: str, *args: Any) -> None:
            pass  # quiet test output

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield ingest, server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def test_a_dead_job_is_one_sentry_event_and_an_error_line_without_its_arguments(
    start_worker, clean_redis, transactional_db, unique
):
    with ingest_server() as (ingest, port):
        # given a worker whose SDK reports to the local ingest
        worker = start_worker(
            "sentry",
            queues="reports",
            concurrency=1,
            SENTRY_DSN=f"http://public@127.0.0.1:{port}/1",
        )
        try:
            # when a job fails three times (two retries, then it gives up)
            handle = tasks.unreachable.enqueue(unique, to=ADDRESS)
            dead = wait_until(
                lambda: DeadLetter.objects.filter(job_id_value=handle.id).first(),
                timeout=30,
                what="the job's dead letter",
            )
            # and then another job dies in the same pool process: the SDK sends one envelope at
            # a time, in order, so once this one's event is in, a repeat of the first would be
            sentinel = tasks.refused.using(queue="reports").enqueue(f"{unique}-s", to="x@y.org")
            events = wait_until(
                lambda: (
                    found
                    if (found := ingest.events())
                    and any(e.get("tags", {}).get("job_id") == sentinel.id for e in found)
                    else None
                ),
                timeout=30,
                what="the second dead job's Sentry event",
            )
        finally:
            worker.stop()
        output = worker.output()
    assert dead is not None and events is not None

    # then the first job is exactly one event, and nothing else arrived before the second's
    assert dead.attempts == 3 and len(marks(unique)) == 3
    first_sentinel = next(
        n for n, e in enumerate(events) if e.get("tags", {}).get("job_id") == sentinel.id
    )
    assert len(events[:first_sentinel]) == 1, events[:first_sentinel]
    about_it = [
        e
        for e in events
        if handle.id in json.dumps({k: v for k, v in e.items() if k != "breadcrumbs"})
    ]
    assert about_it == events[:1]
    event = events[0]
    assert event["level"] == "error"
    assert {k: event["tags"][k] for k in ("job_id", "task", "queue", "attempt")} == {
        "job_id": handle.id,
        "task": "tests.unreachable",
        "queue": "reports",
        "attempt": "3",
    }
    exception = event["exception"]["values"][-1]
    assert exception["type"] == "ConnectionError"
    masked = mask_email(ADDRESS)
    assert exception["value"] == f"could not reach the mailbox of {masked}"
    job = event["contexts"]["job"]
    assert job["args"] == [unique] and job["kwargs"] == {"to": masked}
    assert job["dead_letter_id"] == dead.pk
    # nowhere in any envelope (frames' local variables included) is the address in clear
    assert not [body for _, body in ingest.envelopes if ADDRESS.encode() in body]

    # and the worker logged the death at ERROR: ids and the exception class, no arguments
    line = next(line for line in output.splitlines() if f"job dead id={handle.id}" in line)
    assert " ERROR backlot.jobs " in line
    assert "task=tests.unreachable queue=reports attempt=3" in line
    assert line.endswith("exception=ConnectionError")
    assert unique not in line and masked not in line
    retries = [line for line in output.splitlines() if f"job retrying id={handle.id}" in line]
    assert len(retries) == 2 and all(" INFO " in line for line in retries)
    assert ADDRESS not in output
