"""BACKLOT_AMQP_QUEUE_TYPE=classic: one-node classic queues with x-max-priority, on which
RabbitMQ hands out higher priorities first, as Backlot's 0-9 order asks."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

from tests.amqp.rabbitmq import RabbitMQ
from tests.amqp.site import Site

FINISHED = {"succeeded", "dead", "cancelled"}


@pytest.fixture(scope="module")
def classic(rabbitmq: RabbitMQ, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    """A vhost of classic queues with its database, Redis and driver; no worker yet."""
    site = Site(
        rabbitmq, tmp_path_factory.mktemp("amqp"), "classic", {"BACKLOT_AMQP_QUEUE_TYPE": "classic"}
    )
    try:
        site.migrate()
        site.start_driver()
        yield site
    finally:
        site.close()


def test_a_classic_queue_runs_higher_priorities_first(classic: Site, unique):
    # given: ten jobs of priorities 0-9 enqueued in a shuffled order while no worker runs
    order = list(range(10))
    random.shuffle(order)
    ids = [classic.driver.enqueue("tests.prioritized", unique, f"p{p}", priority=p) for p in order]

    # when one worker with one process and one message in hand at a time takes them
    classic.start_worker("classic", queues="reports", concurrency=1, prefetch=1)
    rows = classic.driver.wait_states(ids, FINISHED, timeout=60, what="the prioritized jobs")

    # then they ran highest first
    assert {r["state"] for r in rows} == {"succeeded"}
    assert classic.marks(unique) == [f"p{p}" for p in range(9, -1, -1)]
    queue = classic.queues()["reports"]
    assert (queue["type"], queue["durable"]) == ("classic", True)
    assert {key: value for key, _, value in queue["arguments"]} == {"x-max-priority": 9}
