"""jobs.worker.telemetry's per-minute buckets of finished attempts: written with the job's other
counts (one pipeline), kept a bounded time, read back a minute a bucket in one pipeline."""

from __future__ import annotations

from datetime import UTC, datetime

from jobs.broker.redis import redis_client, redis_text
from jobs.worker import telemetry

# A fixed minute of the past, so the test reads the same whatever the clock says.
MINUTE = int(datetime(2026, 1, 1, 12, 0, tzinfo=UTC).timestamp()) // 60


def at(minute: int, second: float) -> datetime:
    return datetime.fromtimestamp(minute * 60 + second, tz=UTC)


def test_buckets_are_read_a_minute_each_and_move_on_at_the_minute_boundary(clean_redis):
    # given: finishes counted in two minutes in a row
    client = redis_client()
    client.hincrby(telemetry.finished_minute_key(MINUTE * 60 - 1), "reports\tsucceeded", 3)
    client.hincrby(telemetry.finished_minute_key(MINUTE * 60), "reports\tsucceeded", 2)
    client.hincrby(telemetry.finished_minute_key(MINUTE * 60 + 59.9), "emails\tdead", 1)
    earlier = {("reports", "succeeded"): 3}
    later = {("reports", "succeeded"): 2, ("emails", "dead"): 1}

    # when / then: the last second of MINUTE reads it as the current minute
    assert telemetry.finished_by_minute(3, now=at(MINUTE, 59.999)) == [{}, earlier, later]
    # and the first instant of the next minute reads it one bucket further back
    assert telemetry.finished_by_minute(3, now=at(MINUTE + 1, 0)) == [earlier, later, {}]
    assert telemetry.finished_by_minute(1, now=at(MINUTE + 1, 0.001)) == [{}]
    assert telemetry.finished_by_minute(1, now=at(MINUTE - 1, 0)) == [earlier]


def test_an_outcome_with_a_queue_is_counted_in_its_minute_with_an_expiry(clean_redis, unique):
    telemetry.record_outcome("tests.add", "succeeded", 0.01, f"q-{unique}")
    telemetry.record_outcome("tests.add", "dead", None, f"q-{unique}")
    telemetry.record_outcome("tests.add", "succeeded", 0.01)  # no queue known: no bucket

    keys = list(redis_client().scan_iter(match=telemetry.FINISHED_MINUTE + "*"))
    assert keys  # one, or two if the minute turned between the outcomes
    for key in keys:
        assert 0 < redis_client().ttl(key) <= telemetry.FINISHED_MINUTE_SECONDS
        assert {redis_text(f).partition("\t")[0] for f in redis_client().hkeys(key)} == {
            f"q-{unique}"
        }
    counted: dict[tuple[str, str], int] = {}
    for bucket in telemetry.finished_by_minute(2):  # this minute and the one before
        for item, n in bucket.items():
            counted[item] = counted.get(item, 0) + n
    assert counted == {(f"q-{unique}", "succeeded"): 1, (f"q-{unique}", "dead"): 1}
