"""Backoff arithmetic, RetryPolicy decisions and the default transient errors: exact values."""

from __future__ import annotations

import http.client
import importlib.util
import random
import smtplib
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from jobs.core.policies import (
    DEFAULT_POLICY,
    DEFAULT_RETRY_ON,
    Permanent,
    Retryable,
    RetryDecision,
    RetryPolicy,
    RetryRequested,
    TimeLimitHit,
    exponential_backoff,
)


def backoff(attempt: int, **overrides: object) -> float:
    options = {"base": 1.0, "factor": 2.0, "cap": 600.0, "jitter": False, **overrides}
    return exponential_backoff(attempt, **options)  # type: ignore[arg-type]


# --- exponential_backoff -------------------------------------------------------------------


@pytest.mark.parametrize(("attempt", "expected"), [(1, 1.0), (2, 2.0), (3, 4.0), (4, 8.0)])
def test_backoff_doubles_from_the_base_without_jitter(attempt, expected):
    assert backoff(attempt) == expected


@pytest.mark.parametrize(("attempt", "expected"), [(4, 8.0), (5, 10.0), (6, 10.0), (40, 10.0)])
def test_backoff_is_capped_at_max_delay(attempt, expected):
    assert backoff(attempt, cap=10.0) == expected


def test_backoff_uses_base_and_factor():
    assert [backoff(n, base=0.5, factor=3.0) for n in (1, 2, 3)] == [0.5, 1.5, 4.5]
    assert [backoff(n, base=2.0, factor=1.0) for n in (1, 2, 9)] == [2.0, 2.0, 2.0]


@pytest.mark.parametrize("attempt", [1, 3, 5, 12])
def test_full_jitter_stays_within_zero_and_the_ceiling(attempt):
    rng = random.Random(1234)
    ceiling = backoff(attempt, cap=20.0)

    draws = [backoff(attempt, cap=20.0, jitter=True, rng=rng) for _ in range(2000)]

    assert all(0.0 <= d <= ceiling for d in draws)
    assert len(set(draws)) > 1900  # not a constant, and not a handful of values
    # spread over the whole window, not clustered at one end
    assert min(draws) < ceiling * 0.05 and max(draws) > ceiling * 0.95


def test_jitter_is_reproducible_with_the_same_seed():
    first = [backoff(3, jitter=True, rng=random.Random(7)) for _ in range(3)]
    second = [backoff(3, jitter=True, rng=random.Random(7)) for _ in range(3)]
    assert first == second


@pytest.mark.parametrize("attempt", [0, -1])
def test_backoff_rejects_attempts_below_one(attempt):
    with pytest.raises(ValueError, match=f"attempt must be >= 1, got {attempt}"):
        backoff(attempt)


# --- RetryPolicy: delays -------------------------------------------------------------------


def test_policy_delay_follows_backoff_without_jitter():
    policy = RetryPolicy(max_attempts=8, base_delay=1.0, factor=2.0, max_delay=5.0, jitter=False)
    assert [policy.delay_for(n) for n in range(1, 6)] == [1.0, 2.0, 4.0, 5.0, 5.0]


def test_policy_delay_with_jitter_stays_under_the_ceiling():
    policy = RetryPolicy(base_delay=1.0, factor=2.0, max_delay=600.0)  # jitter is the default
    rng = random.Random(99)
    draws = [policy.delay_for(4, rng=rng) for _ in range(500)]
    assert all(0.0 <= d <= 8.0 for d in draws)
    assert len(set(draws)) > 1


def test_explicit_delays_are_followed_and_the_last_repeats():
    policy = RetryPolicy.explicit(1, 5, 30, 300, 1800)

    assert policy.max_attempts == 6
    assert policy.delays == (1.0, 5.0, 30.0, 300.0, 1800.0)
    assert [policy.delay_for(n) for n in range(1, 6)] == [1.0, 5.0, 30.0, 300.0, 1800.0]
    assert policy.delay_for(6) == 1800.0
    assert policy.delay_for(50) == 1800.0


def test_explicit_accepts_other_options():
    policy = RetryPolicy.explicit(2, 4, max_attempts=10, give_up_on=(KeyError,))
    assert policy.max_attempts == 10
    assert policy.give_up_on == (KeyError,)
    assert [policy.delay_for(n) for n in (1, 2, 9)] == [2.0, 4.0, 4.0]


def test_longest_delay_of_explicit_delays_is_the_largest_entry():
    assert RetryPolicy.explicit(1, 5, 30, 300, 1800).longest_delay() == 1800.0
    assert RetryPolicy.explicit(60, 5).longest_delay() == 60.0


@pytest.mark.parametrize(
    ("max_attempts", "max_delay", "expected"),
    [
        (5, 600.0, 8.0),  # the 4th (last) retry waits 2**3
        (2, 600.0, 1.0),  # one retry, after the base delay
        (1, 600.0, 1.0),
        (30, 600.0, 600.0),  # capped
    ],
)
def test_longest_delay_of_backoff_is_the_last_retry_capped(max_attempts, max_delay, expected):
    policy = RetryPolicy(max_attempts=max_attempts, base_delay=1.0, factor=2.0, max_delay=max_delay)
    assert policy.longest_delay() == expected
    if max_attempts > 1:
        nojitter = RetryPolicy(max_attempts=max_attempts, max_delay=max_delay, jitter=False)
        assert nojitter.longest_delay() == nojitter.delay_for(max_attempts - 1)


# --- RetryPolicy: should_retry -------------------------------------------------------------


@pytest.mark.parametrize(
    "exc",
    [
        Retryable("busy"),
        ConnectionRefusedError(),
        ConnectionError(),
        TimeoutError(),
        TimeLimitHit(),
    ],
)
def test_default_policy_retries_transient_errors(exc):
    assert RetryPolicy(max_attempts=3).should_retry(exc, 1) is True


def test_permanent_is_never_retried_even_when_listed_in_retry_on():
    policy = RetryPolicy(max_attempts=5, retry_on=(Exception,))
    assert policy.should_retry(Permanent("550 refused"), 1) is False


def test_give_up_on_wins_over_retry_on():
    policy = RetryPolicy(
        max_attempts=5, retry_on=(ConnectionError,), give_up_on=(ConnectionRefusedError,)
    )
    assert policy.should_retry(ConnectionResetError(), 1) is True
    assert policy.should_retry(ConnectionRefusedError(), 1) is False


def test_unknown_exception_is_not_retried():
    policy = RetryPolicy(max_attempts=5)
    assert policy.should_retry(KeyError("missing"), 1) is False
    assert policy.should_retry(ValueError("bad"), 1) is False


def test_custom_retry_on_replaces_the_defaults():
    policy = RetryPolicy(max_attempts=5, retry_on=(KeyError,))
    assert policy.should_retry(KeyError("x"), 1) is True
    assert policy.should_retry(ConnectionError(), 1) is False


def test_no_retry_once_max_attempts_is_reached():
    policy = RetryPolicy(max_attempts=3)
    assert [policy.should_retry(ConnectionError(), n) for n in (1, 2, 3, 4)] == [
        True,
        True,
        False,
        False,
    ]
    assert RetryPolicy(max_attempts=1).should_retry(ConnectionError(), 1) is False


def test_explicit_policy_stops_after_its_delays_run_out():
    policy = RetryPolicy.explicit(1, 5, 30, 300, 1800)
    assert policy.should_retry(TimeoutError(), 5) is True
    assert policy.should_retry(TimeoutError(), 6) is False


# --- RetryPolicy: validation ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"max_attempts": 0}, "max_attempts must be >= 1, got 0"),
        ({"max_attempts": -3}, "max_attempts must be >= 1"),
        ({"delays": []}, "delays must be a non-empty list"),
        ({"delays": [1, -5]}, "non-negative"),
        ({"base_delay": -1.0}, "base_delay and max_delay must be >= 0"),
        ({"max_delay": -0.5}, "base_delay and max_delay must be >= 0"),
        ({"factor": 0.5}, "factor >= 1"),
    ],
)
def test_invalid_policies_are_rejected(options, message):
    with pytest.raises(ValueError, match=message):
        RetryPolicy(**options)


def test_explicit_without_delays_is_rejected():
    with pytest.raises(ValueError, match="non-empty"):
        RetryPolicy.explicit()


def test_zero_delays_and_factor_one_are_valid():
    policy = RetryPolicy(base_delay=0.0, factor=1.0, jitter=False, max_attempts=3)
    assert policy.delay_for(2) == 0.0
    assert RetryPolicy.explicit(0).delay_for(1) == 0.0


# --- the default retry set: the network errors of the stdlib and of installed clients -------


def refused_port() -> socket.socket:
    """A socket bound to a port but not listening: connecting to it is refused at once."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    return sock


@pytest.mark.parametrize(
    "exc",
    [
        ConnectionRefusedError(111, "Connection refused"),
        ConnectionResetError(104, "Connection reset by peer"),
        ConnectionAbortedError(),
        BrokenPipeError(),
        TimeoutError("timed out"),
        socket.gaierror(socket.EAI_NONAME, "Name or service not known"),
        socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution"),
        smtplib.SMTPServerDisconnected("Connection unexpectedly closed"),
        http.client.RemoteDisconnected("Remote end closed connection without response"),
        http.client.IncompleteRead(b"partial", 100),
    ],
    ids=lambda exc: type(exc).__name__,
)
def test_default_policy_retries_the_stdlibs_network_errors(exc):
    assert DEFAULT_POLICY.should_retry(exc, 1) is True


def test_a_real_refused_connection_is_retried():
    sock = refused_port()
    try:
        with pytest.raises(OSError) as caught:
            socket.create_connection(sock.getsockname(), timeout=5)
    finally:
        sock.close()
    assert DEFAULT_POLICY.should_retry(caught.value, 1) is True


def test_default_policy_retries_requests_transient_errors():
    requests = pytest.importorskip("requests")
    errors = requests.exceptions
    built = [
        errors.ConnectionError("refused"),
        errors.ConnectTimeout("connect timed out"),
        errors.ReadTimeout("read timed out"),
        errors.Timeout("timed out"),
        errors.ChunkedEncodingError("connection broken mid-body"),
    ]
    sock = refused_port()
    try:
        with pytest.raises(errors.ConnectionError) as caught:
            requests.get(f"http://127.0.0.1:{sock.getsockname()[1]}/", timeout=5)
    finally:
        sock.close()

    for exc in [*built, caught.value]:
        assert DEFAULT_POLICY.should_retry(exc, 1) is True, exc
    # requests' own mistakes of the caller are not transient
    assert DEFAULT_POLICY.should_retry(errors.InvalidURL("no host"), 1) is False
    assert DEFAULT_POLICY.should_retry(errors.MissingSchema("no scheme"), 1) is False


def test_default_policy_retries_urllib3s_transient_errors():
    urllib3 = pytest.importorskip("urllib3")
    errors = urllib3.exceptions
    sock = refused_port()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}/"
    pool = urllib3.PoolManager()
    try:
        with pytest.raises(errors.NewConnectionError) as bare:
            pool.request("GET", url, retries=False, timeout=5)
        with pytest.raises(errors.MaxRetryError) as retried:
            pool.request("GET", url, retries=1, timeout=5)
    finally:
        sock.close()
        pool.clear()

    for exc in [
        bare.value,
        retried.value,
        errors.ReadTimeoutError(None, url, "read timed out"),
        errors.ProtocolError("Connection aborted."),
        errors.NameResolutionError("example.invalid", None, socket.gaierror()),
    ]:
        assert DEFAULT_POLICY.should_retry(exc, 1) is True, exc
    assert DEFAULT_POLICY.should_retry(errors.LocationParseError("::"), 1) is False


def test_default_policy_retries_httpxs_transient_errors():
    httpx = pytest.importorskip("httpx")
    sock = refused_port()
    try:
        with pytest.raises(httpx.ConnectError) as caught:
            httpx.get(f"http://127.0.0.1:{sock.getsockname()[1]}/", timeout=5)
    finally:
        sock.close()

    for exc in [
        caught.value,
        httpx.ConnectTimeout("connect timed out"),
        httpx.ReadTimeout("read timed out"),
        httpx.PoolTimeout("no free connection"),
        httpx.ReadError("connection reset"),
        httpx.RemoteProtocolError("peer closed connection without sending complete message"),
    ]:
        assert DEFAULT_POLICY.should_retry(exc, 1) is True, exc
    assert DEFAULT_POLICY.should_retry(httpx.UnsupportedProtocol("ftp://"), 1) is False


CLIENTS = {"requests", "httpx", "urllib3"}


def retry_set_without(*blocked: str) -> list[str]:
    """The classes of DEFAULT_RETRY_ON, imported in a fresh interpreter where `blocked`
    modules cannot be imported (as if not installed)."""
    program = (
        "import sys\n"
        f"for name in {list(blocked)!r}: sys.modules[name] = None\n"
        "from jobs.core.policies import DEFAULT_RETRY_ON\n"
        "for cls in DEFAULT_RETRY_ON: print(cls.__module__ + '.' + cls.__qualname__)\n"
    )
    ran = subprocess.run(
        [sys.executable, "-c", program],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        cwd=Path(__file__).resolve().parents[3],
    )
    return ran.stdout.split()


def test_a_client_library_that_is_not_installed_is_simply_absent():
    none_installed = retry_set_without("requests", "httpx", "urllib3")
    no_httpx = retry_set_without("httpx")

    assert not [name for name in none_installed if name.split(".")[0] in CLIENTS]
    assert {
        "builtins.ConnectionError",
        "builtins.TimeoutError",
        "socket.gaierror",
        "smtplib.SMTPServerDisconnected",
        "jobs.core.policies.Retryable",
        "jobs.core.policies.TimeLimitHit",
    } <= set(none_installed)
    assert "httpx" not in {name.split(".")[0] for name in no_httpx}
    if importlib.util.find_spec("requests") is not None:
        assert "requests.exceptions.ConnectionError" in no_httpx


def test_the_default_set_holds_exactly_the_installed_clients():
    installed = {name for name in CLIENTS if importlib.util.find_spec(name) is not None}
    present = {cls.__module__.split(".")[0] for cls in DEFAULT_RETRY_ON} & CLIENTS
    assert present == installed


# --- jitter on explicit delays --------------------------------------------------------------


def test_explicit_delays_take_no_jitter_unless_asked():
    assert RetryPolicy.explicit(1, 5, 30).delay_for(2) == 5.0
    assert RetryPolicy(delays=(1, 5, 30)).delay_for(3) == 30.0
    assert RetryPolicy.explicit(1, 5, 30, jitter=False).delay_for(1) == 1.0


@pytest.mark.parametrize(("attempt", "listed"), [(1, 1.0), (2, 5.0), (3, 30.0), (9, 30.0)])
def test_jittered_explicit_delays_stay_within_half_and_the_whole(attempt, listed):
    policy = RetryPolicy.explicit(1, 5, 30, jitter=True)
    rng = random.Random(2024)

    draws = [policy.delay_for(attempt, rng=rng) for _ in range(2000)]

    assert all(listed / 2 <= d <= listed for d in draws)
    assert len(set(draws)) > 1900
    assert min(draws) < listed * 0.52 and max(draws) > listed * 0.98  # the whole window
    assert policy.longest_delay() == 30.0  # jitter never waits longer than the list says


def test_decide_draws_jittered_delays_from_the_given_rng():
    policy = RetryPolicy.explicit(10, jitter=True)
    first = policy.decide(TimeoutError(), 1, rng=random.Random(3))
    again = policy.decide(TimeoutError(), 1, rng=random.Random(3))
    assert first == again and 5.0 <= first.delay <= 10.0


def test_backoff_keeps_full_jitter_by_default():
    draws = [RetryPolicy(max_delay=8.0).delay_for(4, rng=random.Random(n)) for n in range(200)]
    assert min(draws) < 1.0 and max(draws) <= 8.0


# --- caps on the delays a failure asks for --------------------------------------------------


@pytest.mark.parametrize(
    ("retry_after", "expected"),
    [(3600.0, 120.0), (120.0, 120.0), (30.0, 30.0), (0.0, 0.0), (-5.0, 0.0)],
)
def test_retry_after_is_capped_by_max_delay(retry_after, expected):
    policy = RetryPolicy(max_attempts=3, max_delay=120.0)
    decision = policy.decide(Retryable("busy", retry_after=retry_after), 1)
    assert decision == RetryDecision(retry=True, delay=expected)


def test_retry_after_on_an_explicit_policy_is_capped_by_max_delay_too():
    policy = RetryPolicy.explicit(1, 2, max_delay=10.0)
    assert policy.decide(Retryable("busy", retry_after=99), 1).delay == 10.0
    assert policy.decide(Retryable("busy"), 2).delay == 2.0


def test_a_tasks_retry_countdown_is_capped_by_its_policy():
    from tests.support import tasks

    # what self.retry(countdown=86_400) raises in a worker run (PlatformTask.retry)
    asked = RetryRequested(None, retry_after=86_400)

    decision = tasks.flaky.policy.decide(asked, 1)
    assert decision.retry is True and decision.delay == tasks.flaky.policy.max_delay == 600.0
    # Celery's max_retries was checked by retry() itself: the policy's attempts do not stop it
    assert tasks.flaky.policy.decide(asked, tasks.flaky.policy.max_attempts).retry is True
