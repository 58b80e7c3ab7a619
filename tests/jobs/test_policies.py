"""Backoff arithmetic and RetryPolicy decisions: pure functions, exact values."""

from __future__ import annotations

import random

import pytest

from jobs.policies import (
    Permanent,
    Retryable,
    RetryPolicy,
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
