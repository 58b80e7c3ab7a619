"""Rate strings, and the contract of the cluster-wide token bucket against the real Redis."""

from __future__ import annotations

import re
import threading
import time
import uuid

import pytest

from jobs.broker.ratelimit import Decision, RateLimiter, parse_rate, redis_client
from tests.conftest import wait_until

# --- parse_rate ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("rate", "interval"),
    [
        ("50/s", 0.02),
        ("100/m", 0.6),
        ("1000/h", 3.6),
        ("3/10s", 10 / 3),
        ("1/2m", 120.0),
        ("2.5/s", 0.4),
        (" 5 / 2 m ", 24.0),
    ],
)
def test_parse_rate_gives_seconds_between_tokens(rate, interval):
    assert parse_rate(rate) == pytest.approx(interval)


@pytest.mark.parametrize(
    "rate",
    ["fast", "", None, "10", "10/", "/s", "10/d", "10 per s", "-1/s", "1/-5s", "0/s", "5/0s"],
)
def test_parse_rate_rejects_bad_strings_naming_them(rate):
    with pytest.raises(ValueError, match=re.escape(f"Invalid rate limit {rate!r}")):
        parse_rate(rate)


# --- RateLimiter contract (real Redis) -----------------------------------------------------


def next_free_slot(key: str) -> float:
    """The bucket the limiter keeps in Redis at `key`: the time of the next free slot."""
    value = redis_client().get(key)
    assert value is not None, f"no bucket at {key}"
    return float(value)


@pytest.fixture
def limiter(clean_redis: None) -> RateLimiter:
    return RateLimiter(prefix=f"test:rate:{uuid.uuid4().hex[:8]}:")


def test_first_acquire_runs_now(limiter):
    decision = limiter.acquire("api", "10/s")

    assert decision == Decision("go", 0.0)
    assert decision.allowed and not decision.reserved


def test_immediate_second_acquire_reserves_the_next_slot(limiter):
    limiter.acquire("api", "10/s")

    decision = limiter.acquire("api", "10/s")

    assert decision.verdict == "reserved" and decision.reserved and not decision.allowed
    assert decision.wait == pytest.approx(0.1, abs=0.03)


def test_no_slot_within_max_reserve_is_full_and_does_not_advance_the_bucket(limiter):
    assert limiter.acquire("api", "10/s", max_reserve=0.15).verdict == "go"
    second = limiter.acquire("api", "10/s", max_reserve=0.15)
    assert second.verdict == "reserved" and second.wait == pytest.approx(0.1, abs=0.03)

    third = limiter.acquire("api", "10/s", max_reserve=0.15)
    fourth = limiter.acquire("api", "10/s", max_reserve=0.15)

    # the third would need a slot 0.2 s ahead, beyond 0.15 s: told when to ask again
    assert third.verdict == "full" and not third.allowed and not third.reserved
    assert third.wait == pytest.approx(0.2, abs=0.03)
    # had "full" taken a slot, the fourth would be told about 0.3 s
    assert fourth.verdict == "full"
    assert fourth.wait == pytest.approx(third.wait, abs=0.02)


def test_default_max_reserve_comes_from_settings(limiter, settings):
    limiter.acquire("api", "1/m")
    assert limiter.acquire("api", "1/m").verdict == "full"  # 60 s ahead > 30 s default

    settings.BACKLOT = {**settings.BACKLOT, "RATE_LIMIT_MAX_RESERVE": 120.0}
    reserved = limiter.acquire("api", "1/m")
    assert reserved.verdict == "reserved" and reserved.wait == pytest.approx(60, abs=0.1)


def test_burst_allows_that_many_at_once_then_reserves(limiter):
    verdicts = [limiter.acquire("api", "10/s", burst=3).verdict for _ in range(3)]
    fourth = limiter.acquire("api", "10/s", burst=3)

    assert verdicts == ["go", "go", "go"]
    assert fourth.verdict == "reserved" and fourth.wait == pytest.approx(0.1, abs=0.03)


def test_keys_are_independent_buckets(limiter):
    assert limiter.acquire("tenant-a", "10/s").verdict == "go"
    assert limiter.acquire("tenant-b", "10/s").verdict == "go"
    assert limiter.acquire("tenant-a", "10/s").verdict == "reserved"
    other = RateLimiter(prefix=limiter.prefix + "other:")
    assert other.acquire("tenant-a", "10/s").verdict == "go"


def test_token_is_available_again_after_the_interval(limiter):
    limiter.acquire("api", "10/s")
    started = time.monotonic()
    full = limiter.acquire("api", "10/s", max_reserve=0)
    assert full.verdict == "full" and full.wait == pytest.approx(0.1, abs=0.03)

    # polling with max_reserve=0 never takes a slot, so the first "go" is the refilled token
    wait_until(
        lambda: limiter.acquire("api", "10/s", max_reserve=0).allowed,
        timeout=2,
        interval=0.01,
        what="a token to come back",
    )

    assert time.monotonic() - started >= full.wait - 0.02


def test_reset_empties_the_bucket(limiter):
    limiter.acquire("api", "1/m")
    limiter.reset("api")
    assert limiter.acquire("api", "1/m").verdict == "go"


def test_idle_bucket_key_expires(limiter):
    limiter.acquire("api", "10/s")
    ttl_ms = redis_client().pttl(limiter.prefix + "api")
    assert 0 < ttl_ms <= 1100 + 50


@pytest.mark.parametrize("rate", ["4/s", "1000/s", "3/s", "7/m"])
def test_each_reservation_moves_the_bucket_exactly_one_interval(limiter, rate):
    # given: the first caller runs now; `start` is the next free slot
    interval = parse_rate(rate)
    for _ in range(max(1, int(0.2 / interval))):  # keep the bucket >= 0.2 s ahead of the clock,
        limiter.acquire("api", rate, max_reserve=3600)  # so a slow machine cannot let it idle
    start = next_free_slot(limiter.prefix + "api")

    # when: ten more callers reserve
    decisions = [limiter.acquire("api", rate, max_reserve=3600) for _ in range(10)]

    # then: the bucket is exactly ten intervals further on; any drift per token adds up to
    # more (or fewer) jobs than the rate allows, on every host
    assert {decision.verdict for decision in decisions} == {"reserved"}
    end = next_free_slot(limiter.prefix + "api")
    assert end - start == pytest.approx(10 * interval, abs=2e-5)


def redis_clock_offset() -> float:
    """Redis's clock minus ours, from the quickest of a few TIME round trips."""
    samples = []
    for _ in range(5):
        before = time.time()
        seconds, micros = redis_client().time()
        after = time.time()
        samples.append((after - before, seconds + micros / 1e6 - (before + after) / 2))
    return min(samples)[1]


def test_concurrent_callers_each_hold_their_own_slot(limiter):
    key, interval = limiter.prefix + "api", 0.001
    # given: a backlog of 100 ms of reserved slots, so the racing callers below all have to
    # reserve (none finds the bucket idle); the next free slot is `start`
    for _ in range(100):
        limiter.acquire("api", "1000/s", max_reserve=60)
    start = next_free_slot(key)
    offset = redis_clock_offset()
    calls: list[tuple[float, float, Decision]] = []
    lock = threading.Lock()

    def caller() -> None:
        for _ in range(50):
            asked = time.time()
            decision = limiter.acquire("api", "1000/s", max_reserve=60)
            answered = time.time()
            with lock:
                calls.append((asked, answered, decision))

    # when: 200 more acquires race from 4 threads
    threads = [threading.Thread(target=caller) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)

    # then: every caller reserved a slot and the bucket moved exactly one interval per caller;
    # two callers sharing a slot would leave it short
    assert len(calls) == 200
    assert {decision.verdict for _, _, decision in calls} == {"reserved"}
    assert next_free_slot(key) == pytest.approx(start + 200 * interval, abs=2e-4)

    # and each caller's slot (its Redis time + its wait) is on the 1 ms grid from `start`;
    # where the call was quick enough to pin its slot down, no two callers got the same one
    slots = []
    for asked, answered, decision in calls:
        if answered - asked < 0.0005:
            position = ((asked + answered) / 2 + offset + decision.wait - start) / interval
            assert abs(position - round(position)) < 0.45, position
            slots.append(round(position))
    assert len(slots) >= 20, "too few quick calls to check slot spacing"
    assert len(set(slots)) == len(slots)
    assert all(0 <= slot < 200 for slot in slots)
