"""A fresh vhost (a first deploy, or a new RabbitMQ): what a worker meets before the relay has
ever swept there."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from amqp.exceptions import NotFound

from jobs.testing import wait_until
from tests.amqp.rabbitmq import RabbitMQ
from tests.amqp.site import DELIVERY_LIMIT, Site

FINISHED = {"succeeded", "dead", "cancelled"}
UNDELIVERABLE = "backlot.undeliverable"


@pytest.fixture(scope="module")
def fresh(rabbitmq: RabbitMQ, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    """A vhost of quorum queues with one worker (-c 1) and no relay yet."""
    site = Site(rabbitmq, tmp_path_factory.mktemp("amqp"), "fresh", {})
    try:
        site.migrate()
        site.start_driver()
        site.start_worker("fresh", queues="default", concurrency=1)
        yield site
    finally:
        site.close()


def undeliverable(site: Site) -> int:
    """Messages waiting in backlot.undeliverable; 0 while it is not declared."""
    try:
        return site.depth(UNDELIVERABLE)[0]
    except NotFound:  # the queue is not there
        return 0


def test_a_message_given_up_on_before_the_relay_ran_is_kept_for_it(fresh: Site, unique):
    # given: a job that kills its pool process every run, on a vhost the relay never swept
    job_id = fresh.driver.enqueue("tests.crashes", unique, 100)

    # when RabbitMQ gives up on its message (past x-delivery-limit)
    wait_until(
        lambda: len(fresh.marks(unique)) == DELIVERY_LIMIT + 1,
        timeout=60,
        what="the poison job's runs",
    )

    # then the message waits in backlot.undeliverable (a quorum queue dead-letters to a queue
    # that is not there by dropping the message)
    wait_until(lambda: undeliverable(fresh) == 1, timeout=30, what="the message kept")
    # and the relay, once started, makes it a dead letter
    fresh.start_relay()
    (row,) = fresh.driver.wait_states([job_id], FINISHED, timeout=60, what="the poison job")
    assert row["state"] == "dead"
    (letter,) = fresh.driver("dead_letters", ids=[job_id])["dead_letters"]
    assert "x-delivery-limit" in letter["message"]
