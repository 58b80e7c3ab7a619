"""Jobs behind concurrency and rate limits, for tests/jobs/broker/test_concurrency_limits.py; its
worker processes import this module (-I)."""

from __future__ import annotations

import time
from typing import Any

from jobs.worker.decorators import job
from tests.support.tasks import mark, wait_for_flag

# Per-second rate case: the limit under test.
RATE = "20/s"


@job(name="tests.limited.pair", concurrency=2, concurrency_key="tenant")
def pair(key: str, tenant: str, seconds: float) -> None:
    """At most 2 per tenant at once, cluster-wide; runs `seconds`."""
    mark(key, tenant)
    time.sleep(seconds)
    mark(f"{key}:end", tenant)


@job(name="tests.limited.five", concurrency={"vip": 1, "*": 5}, concurrency_key="tenant")
def five(key: str, tenant: str, seconds: float) -> None:
    """At most 5 per tenant at once (1 for the tenant "vip")."""
    mark(key, tenant)
    time.sleep(seconds)


@job(name="tests.limited.rate", rate_limit=RATE, queue="emails")
def rated(key: str, item: int) -> None:
    """Behind a cluster-wide RATE."""
    mark(key, str(item))


@job(name="tests.limited.blocking", bind=True, concurrency=1, concurrency_key="tenant")
def blocking(self: Any, key: str, tenant: str, flag: str) -> None:
    """One per tenant at once; runs until `flag` is set or it is cancelled."""
    mark(key, f"start:{self.request.id}")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not wait_for_flag(flag, timeout=0.1):
        self.progress(0, 1, "waiting for the flag")  # raises JobCancelled once cancelled
    mark(key, f"end:{self.request.id}")


@job(
    name="tests.limited.terminated",
    concurrency=1,
    concurrency_key="tenant",
    cancel="terminate",
    bind=True,
)
def terminated(self: Any, key: str, tenant: str) -> None:
    """One per tenant at once; never reports progress (a cancel kills its process)."""
    mark(key, f"start:{self.request.id}")
    time.sleep(60)


@job(name="tests.limited.unlimited")
def add_unlimited() -> None:
    """No limit: no gate."""
