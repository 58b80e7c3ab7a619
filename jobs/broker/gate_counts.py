"""The gates' per-task metric counts in Redis hashes (task -> count), read by /metrics and the
benchmark: jobs parked at a gate, messages re-published for a slot, and rate-limit waits."""

from __future__ import annotations

import logging
from collections.abc import Iterable

from redis.exceptions import RedisError

from jobs.broker.redis import redis_client, redis_text

logger = logging.getLogger(__name__)

# Messages re-published to wait for a slot (a release, a grant's countdown), per task; read by
# the benchmark and /metrics: re-sends per job stay near 1 (a parked job is sent once more).
RESENDS = "backlot:metrics:gate_resends"
PARKED = "backlot:metrics:gate_parked"  # jobs parked, per task
# Jobs that waited for a rate-limit token (parked at enqueue behind a later token, or delivered
# before theirs), per task: the backlot_rate_limit_waits metric (jobs.worker.telemetry).
RATE_LIMITED = "backlot:metrics:rate_limited"


def count(*counters: str, task: str, amount: int = 1) -> None:
    """Add to per-task counters (RESENDS, PARKED, RATE_LIMITED), in one round trip; never
    raises."""
    try:
        pipe = redis_client().pipeline(transaction=False)
        for counter in counters:
            pipe.hincrby(counter, task, amount)
        pipe.execute()
    except RedisError as exc:
        logger.debug("Could not count %s for %s: %s", counters, task, exc)


def counted(counter: str, tasks: Iterable[str] | None = None) -> dict[str, int]:
    """The per-task counts of RESENDS, PARKED or RATE_LIMITED."""
    stored: dict[bytes, bytes] = redis_client().hgetall(counter)  # type: ignore[assignment]
    raw = {redis_text(k): int(v) for k, v in stored.items()}
    return raw if tasks is None else {task: raw.get(task, 0) for task in tasks}
