"""jobs.core.http.raise_for_status on real responses from a local HTTP server, and a real worker
retrying a flaky API: 503, then 429 with Retry-After, then 200."""

from __future__ import annotations

import email.utils
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from itertools import pairwise

import pytest
import requests

from jobs.core.http import BODY_EXCERPT_CHARS, raise_for_status, retry_after_seconds
from jobs.core.policies import Permanent, Retryable, RetryPolicy
from jobs.models import DeadLetter, Job, JobState
from tests.conftest import wait_until
from tests.support import tasks


@dataclass
class Answer:
    status: int
    body: str = ""
    headers: dict[str, str] = field(default_factory=dict)


class ScriptedServer:
    """An HTTP server on 127.0.0.1 answering each path from its script, in order (the last
    answer repeats), and noting when each request arrived."""

    def __init__(self) -> None:
        self.scripts: dict[str, list[Answer]] = {}
        self.arrivals: dict[str, list[float]] = {}
        self.lock = threading.Lock()
        scripted = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                with scripted.lock:
                    seen = scripted.arrivals.setdefault(path, [])
                    seen.append(time.monotonic())
                    script = scripted.scripts.get(path) or [Answer(404, "no such path")]
                    answer = script[min(len(seen), len(script)) - 1]
                body = answer.body.encode()
                self.send_response(answer.status)
                for name, value in answer.headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Type", "text/plain; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                pass  # keep the test output quiet

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def answer(self, path: str, *answers: Answer) -> str:
        """Script `path` and return its URL."""
        with self.lock:
            self.scripts[path] = list(answers)
            self.arrivals[path] = []
        return f"http://127.0.0.1:{self.httpd.server_port}{path}"

    def hits(self, path: str) -> list[float]:
        with self.lock:
            return list(self.arrivals.get(path, []))

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)


@pytest.fixture(scope="module")
def server() -> Iterator[ScriptedServer]:
    scripted = ScriptedServer()
    yield scripted
    scripted.close()


@pytest.fixture
def refused_url() -> Iterator[str]:
    """A URL whose port is bound but not listening: connecting is refused, and no other
    process can take the port while the test runs."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    yield f"http://127.0.0.1:{sock.getsockname()[1]}/anything"
    sock.close()


def fetched(server: ScriptedServer, path: str, *answers: Answer) -> requests.Response:
    return requests.get(server.answer(path, *answers), timeout=5)


# --- raise_for_status on requests responses -------------------------------------------------


@pytest.mark.parametrize("status", [200, 201, 204, 302])
def test_a_response_below_400_is_returned_as_it_is(server, status):
    response = requests.get(
        server.answer(f"/ok/{status}", Answer(status, "" if status == 204 else "fine")),
        timeout=5,
        allow_redirects=False,
    )
    assert raise_for_status(response) is response


def test_404_is_permanent_naming_the_status_url_and_a_masked_body(server):
    url = server.answer("/users/7", Answer(404, '{"error": "no user jane.doe@example.com"}'))
    response = requests.get(url + "?api_key=s3cret&email=jane.doe@example.com", timeout=5)

    with pytest.raises(Permanent) as caught:
        raise_for_status(response)

    message = str(caught.value)
    assert message == (f'HTTP 404 Not Found from {url}: {{"error": "no user j***@example.com"}}')
    assert "s3cret" not in message and "jane.doe" not in message


@pytest.mark.parametrize("status", [400, 401, 403, 409, 410, 422])
def test_other_client_errors_are_permanent(server, status):
    response = fetched(server, f"/client/{status}", Answer(status, "nope"))
    with pytest.raises(Permanent, match=f"^HTTP {status} "):
        raise_for_status(response)


@pytest.mark.parametrize("status", [408, 500, 502, 504, 599])
def test_408_and_server_errors_retry_with_the_policys_backoff(server, status):
    response = fetched(server, f"/server/{status}", Answer(status, "try later"))
    with pytest.raises(Retryable, match=f"^HTTP {status} ") as caught:
        raise_for_status(response)
    assert caught.value.retry_after is None


@pytest.mark.parametrize("status", [429, 503])
def test_429_and_503_honour_retry_after_in_seconds(server, status):
    response = fetched(server, f"/busy/{status}", Answer(status, "slow down", {"Retry-After": "7"}))
    with pytest.raises(Retryable, match=f"^HTTP {status} ") as caught:
        raise_for_status(response)
    assert caught.value.retry_after == 7.0


def test_retry_after_as_an_http_date(server):
    when = email.utils.formatdate(time.time() + 30, usegmt=True)
    response = fetched(server, "/busy/date", Answer(429, "", {"Retry-After": when}))

    with pytest.raises(Retryable) as caught:
        raise_for_status(response)

    assert caught.value.retry_after is not None
    assert 27.0 <= caught.value.retry_after <= 30.0  # whole seconds, and the request took a bit
    assert str(caught.value) == f"HTTP 429 Too Many Requests from {response.url}"


@pytest.mark.parametrize("header", [{}, {"Retry-After": "soon"}, {"Retry-After": ""}])
def test_503_without_a_usable_retry_after_falls_back_to_backoff(server, header):
    response = fetched(server, "/busy/none", Answer(503, "down", header))
    with pytest.raises(Retryable) as caught:
        raise_for_status(response)
    assert caught.value.retry_after is None


@pytest.mark.parametrize(
    "body",
    [
        "x" * 5000,  # one long word (minified JSON, base64)
        "jane.doe@example.com " + "word " * 2000,
    ],
)
def test_a_long_body_is_cut_short(server, body):
    response = fetched(server, "/long", Answer(500, body))
    with pytest.raises(Retryable) as caught:
        raise_for_status(response)
    excerpt = str(caught.value).split(": ", 1)[1]
    assert len(excerpt) == BODY_EXCERPT_CHARS and excerpt.endswith("…")
    assert "jane.doe" not in excerpt


@pytest.mark.parametrize("run", ["", "x" * 100])
def test_an_address_the_bound_cuts_through_is_masked_or_dropped(server, run):
    # the address straddles the first cut (10 x the excerpt); before it, spaces that the
    # excerpt collapses, so what survives of it lands inside the excerpt
    start = BODY_EXCERPT_CHARS * 10 - 10
    body = " " * (start - len(run)) + run + "jane.doe@example.com tail"
    response = fetched(server, "/straddle", Answer(500, body))
    with pytest.raises(Retryable) as caught:
        raise_for_status(response)
    assert "jane" not in str(caught.value) and "@exa" not in str(caught.value)


def test_the_policy_caps_a_long_retry_after(server):
    response = fetched(server, "/busy/day", Answer(503, "", {"Retry-After": "86400"}))
    with pytest.raises(Retryable) as caught:
        raise_for_status(response)

    decision = RetryPolicy(max_attempts=3, max_delay=60.0).decide(caught.value, 1)

    assert decision.retry is True and decision.delay == 60.0


# --- raise_for_status on httpx responses, where httpx is installed --------------------------


def test_httpx_responses_are_read_the_same_way(server):
    httpx = pytest.importorskip("httpx")
    url = server.answer("/httpx", Answer(503, "busy", {"Retry-After": "3"}), Answer(404, "gone"))

    with pytest.raises(Retryable) as busy:
        raise_for_status(httpx.get(url))
    with pytest.raises(Permanent) as gone:
        raise_for_status(httpx.get(url + "?token=s3cret"))

    assert busy.value.retry_after == 3.0
    assert str(gone.value) == f"HTTP 404 Not Found from {url}: gone"
    assert raise_for_status(httpx.Response(200)).status_code == 200  # no request, no URL
    with pytest.raises(Permanent, match=r"^HTTP 401 Unauthorized: denied$"):
        raise_for_status(httpx.Response(401, text="denied"))


# --- retry_after_seconds --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("120", 120.0),
        (" 5 ", 5.0),
        ("0", 0.0),
        ("-3", 0.0),
        ("1.5", 1.5),
        ("inf", None),
        ("nan", None),
        ("Thu, 01 Jan 1970 00:01:40 GMT", 60.0),  # 100 s after the epoch, "now" is 40
        ("Thu, 01 Jan 1970 00:01:40 -0000", 60.0),
        ("Thu, 01 Jan 1970 00:00:10 GMT", 0.0),  # already past
        ("next tuesday", None),
    ],
)
def test_retry_after_reads_seconds_or_an_http_date(value, expected):
    assert retry_after_seconds({"Retry-After": value}, now=40.0) == expected


def test_no_retry_after_header_is_none():
    assert retry_after_seconds({}) is None


# --- a real worker calling a flaky API ------------------------------------------------------


def finished(job_id: str, timeout: float = 30) -> Job:
    job = wait_until(
        lambda: Job.objects.filter(
            id=job_id, state__in=[JobState.SUCCEEDED, JobState.DEAD]
        ).first(),
        timeout=timeout,
        what=f"job {job_id} to finish",
    )
    assert job is not None  # wait_until returns the first truthy answer
    return job


def test_job_retries_503_then_waits_out_429s_retry_after_then_succeeds(worker, server, unique):
    path = f"/flaky/{unique}"
    url = server.answer(
        path,
        Answer(503, "overloaded"),
        Answer(429, "slow down", {"Retry-After": "2"}),
        Answer(200, "ok"),
    )

    handle = tasks.http_call.enqueue(url)
    job = finished(handle.id)

    assert job.state == JobState.SUCCEEDED and job.attempts == 3
    assert job.result == 200
    hits = server.hits(path)
    assert len(hits) == 3
    first_gap, second_gap = (b - a for a, b in pairwise(hits))
    # the 503 had no Retry-After: the policy's 0.2 s backoff (measured 0.21 s); the 429 asked
    # for 2 s and got them (measured 2.01 s)
    assert first_gap < 2.0 <= second_gap, (first_gap, second_gap)
    assert [(f["exception"], f["message"]) for f in job.failures] == [
        ("jobs.core.policies.Retryable", f"HTTP 503 Service Unavailable from {url}: overloaded"),
        ("jobs.core.policies.Retryable", f"HTTP 429 Too Many Requests from {url}: slow down"),
    ]


def test_job_dead_letters_a_404_after_one_attempt(worker, server, unique):
    path = f"/missing/{unique}"
    url = server.answer(path, Answer(404, "no such order"))

    handle = tasks.http_call.enqueue(url)
    job = finished(handle.id)

    assert job.state == JobState.DEAD and job.attempts == 1
    assert len(server.hits(path)) == 1
    dead = DeadLetter.objects.get(job_id_value=handle.id)
    assert dead.exception_class == "jobs.core.policies.Permanent"
    assert dead.exception_message == f"HTTP 404 Not Found from {url}: no such order"


def test_job_retries_a_refused_connection(worker, refused_url):
    handle = tasks.http_call.enqueue(refused_url)
    job = finished(handle.id)

    # every attempt refused: retried until the policy's 4 attempts ran out
    assert job.state == JobState.DEAD and job.attempts == 4
    dead = DeadLetter.objects.get(job_id_value=handle.id)
    assert dead.exception_class == "requests.exceptions.ConnectionError"
    assert [f["exception"] for f in job.failures] == ["requests.exceptions.ConnectionError"] * 4
