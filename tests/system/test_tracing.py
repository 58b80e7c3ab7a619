"""Traces: a request that enqueues a job and the job's attempts are one trace, seen the way a
tracing backend sees it. A real web process (config.wsgi, Django's instrumentation) and a real
worker, both configured from OTEL_* only, export over OTLP/HTTP to a receiver this test runs."""

from __future__ import annotations

import gzip
import json
import socket
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from django.utils import timezone

pytest.importorskip("opentelemetry.sdk", reason="the otel extra is not installed")
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from jobs.core.states import JobState
from jobs.flow.relay import job_relay
from jobs.models import Job
from tests.conftest import LOG_DIR, ROOT, wait_until
from tests.support import tasks  # noqa: F401  (the relay here publishes tests.record)


@dataclass
class Span:
    service: str
    trace_id: str
    span_id: str
    parent_id: str
    name: str
    kind: int
    attributes: dict[str, Any]
    events: list[tuple[str, dict[str, Any]]]
    status_code: int
    links: list[str] = field(default_factory=list)  # trace ids linked to


def _value(any_value: Any) -> Any:
    return (
        getattr(any_value, any_value.WhichOneof("value")) if any_value.WhichOneof("value") else None
    )


def _attributes(items: Any) -> dict[str, Any]:
    return {item.key: _value(item.value) for item in items}


class Receiver:
    """An OTLP/HTTP trace receiver: POST /v1/traces, protobuf bodies, spans kept in order."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.lock = threading.Lock()

    def add(self, body: bytes) -> None:
        request = ExportTraceServiceRequest.FromString(body)
        for resource_spans in request.resource_spans:
            service = _attributes(resource_spans.resource.attributes).get("service.name", "")
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    with self.lock:
                        self.spans.append(
                            Span(
                                service=service,
                                trace_id=span.trace_id.hex(),
                                span_id=span.span_id.hex(),
                                parent_id=span.parent_span_id.hex(),
                                name=span.name,
                                kind=span.kind,
                                attributes=_attributes(span.attributes),
                                events=[(e.name, _attributes(e.attributes)) for e in span.events],
                                status_code=span.status.code,
                                links=[link.trace_id.hex() for link in span.links],
                            )
                        )

    def find(self, **attributes: Any) -> list[Span]:
        with self.lock:
            return [
                s
                for s in self.spans
                if all(s.attributes.get(k) == v for k, v in attributes.items())
            ]


@contextmanager
def otlp_receiver() -> Iterator[tuple[Receiver, int]]:
    receiver = Receiver()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if self.headers.get("Content-Encoding") == "gzip":
                body = gzip.decompress(body)
            if self.path == "/v1/traces":
                receiver.add(body)
            reply = ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield receiver, server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextmanager
def web_process(env: dict[str, str]) -> Iterator[str]:
    port = free_port()
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    log_path = LOG_DIR / f"tracing-web-{port}.log"
    # Its output goes to a file: an unread pipe fills up and blocks the process's writes.
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "tests.system.tracing_app", str(port)],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:

        def up() -> bool:
            if process.poll() is not None:
                raise AssertionError(f"web process exited: {log_path.read_text()[-3000:]}")
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                    return True
            except OSError:
                return False

        wait_until(up, timeout=30, interval=0.1, what="the web process")
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()  # it did not stop on SIGTERM: its spans were exported already
            process.wait(timeout=10)


def post(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(urllib.request.Request(url, method="POST"), timeout=10) as answer:
        assert answer.status == 202
        return dict(json.loads(answer.read()))


def trace_id_of(job: Job) -> str:
    return job.trace_context["traceparent"].split("-")[1]


def test_a_request_its_job_and_the_jobs_retry_are_one_trace(
    start_worker, worker_env, clean_redis, transactional_db, unique
):
    with otlp_receiver() as (receiver, port):
        otel = {
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
            "OTEL_BSP_SCHEDULE_DELAY": "200",
        }
        worker = start_worker(
            "tracing",
            queues="reports",
            concurrency=1,
            OTEL_SERVICE_NAME="backlot-worker",
            LOG_FORMAT="json",
            **otel,
        )
        try:
            with web_process({**worker_env, **otel, "OTEL_SERVICE_NAME": "backlot-web"}) as web:
                # given a job enqueued by a request, which fails once and then succeeds
                flaky_id = post(f"{web}/flaky/?key={unique}")["job_id"]
                # and one due in an hour, which waits in the ledger for the relay
                later_id = post(f"{web}/later/?key={unique}-later")["job_id"]

            # when the worker has run the first twice and the relay sent the second once due
            wait_until(
                lambda: Job.objects.get(id=flaky_id).state == JobState.SUCCEEDED,
                timeout=30,
                what="the flaky job's second attempt",
            )
            later = Job.objects.get(id=later_id)
            assert later.published_at is None and later.state == JobState.SCHEDULED
            Job.objects.filter(id=later_id).update(scheduled_for=timezone.now() - timedelta(1))
            assert job_relay() >= 1
            wait_until(
                lambda: Job.objects.get(id=later_id).state == JobState.SUCCEEDED,
                timeout=30,
                what="the relayed job",
            )
            consumers = wait_until(
                lambda: (
                    found
                    if len(found := receiver.find(**{"messaging.message.id": flaky_id})) == 3
                    and receiver.find(**{"messaging.message.id": later_id, "backlot.attempt": 1})
                    else None
                ),
                timeout=30,
                what="the producer span and both attempts' spans of the flaky job",
            )
        except AssertionError as exc:
            summary = [(s.service, s.name, s.attributes) for s in receiver.spans]
            raise AssertionError(f"{exc}; received {summary}\n{worker.output()[-3000:]}") from exc
        finally:
            worker.stop()

    # then the request, the producer span and both attempts are one trace, in a parent chain
    job = Job.objects.get(id=flaky_id)
    trace_id = trace_id_of(job)
    producer = next(s for s in consumers if s.name == "publish reports")
    attempts = sorted(
        (s for s in consumers if s.name == "process reports"),
        key=lambda s: s.attributes["backlot.attempt"],
    )
    requests = [s for s in receiver.spans if s.trace_id == trace_id and s.service == "backlot-web"]
    request = next(s for s in requests if s.span_id == producer.parent_id)
    assert request.kind == 2  # SERVER: Django's instrumentation
    assert {s.trace_id for s in [request, producer, *attempts]} == {trace_id}
    assert producer.kind == 4 and producer.service == "backlot-web"  # PRODUCER
    assert producer.attributes["messaging.destination.name"] == "reports"
    assert producer.attributes["backlot.task"] == "tests.flaky"
    assert [s.parent_id for s in attempts] == [producer.span_id, producer.span_id]
    assert [s.attributes["backlot.attempt"] for s in attempts] == [1, 2]
    assert [s.attributes["backlot.outcome"] for s in attempts] == ["retrying", "succeeded"]
    for span in attempts:
        assert span.kind == 5 and span.service == "backlot-worker"  # CONSUMER
        assert span.attributes["messaging.system"] == "celery"
        assert span.attributes["messaging.destination.name"] == "reports"
        assert span.attributes["backlot.task"] == "tests.flaky"
    # the failed attempt names its exception, by class only (its message may quote arguments)
    assert attempts[0].events == [("exception", {"exception.type": "ConnectionError"})]
    assert attempts[1].events == [] and attempts[1].status_code == 0

    # and the relay-published job is a child of the request that enqueued it, an hour later
    later = Job.objects.get(id=later_id)
    (later_producer,) = receiver.find(
        **{
            "messaging.message.id": later_id,
            "backlot.task": "tests.record",
            "messaging.operation.type": "send",
        }
    )
    (later_run,) = receiver.find(**{"messaging.message.id": later_id, "backlot.attempt": 1})
    assert later_run.trace_id == later_producer.trace_id == trace_id_of(later)
    assert later_run.parent_id == later_producer.span_id
    assert any(s.span_id == later_producer.parent_id for s in receiver.spans if s.kind == 2)

    # and the worker's structured log lines carry the trace id
    lines = [json.loads(line) for line in worker.output().splitlines() if line.startswith("{")]
    job_lines = [line for line in lines if line.get("job_id") == flaky_id]
    assert {line["event"] for line in job_lines} >= {"started", "retrying", "succeeded"}
    assert {line["trace_id"] for line in job_lines} == {trace_id}
