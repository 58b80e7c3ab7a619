"""The RabbitMQ suite's fixtures: a RabbitMQ vhost of its own, a PostgreSQL database of its own
(made by `manage.py migrate`), a private Redis, real workers (2 workers, -c 2, prefetch 4 as the
Procfile's: four pool processes), the relay (`manage.py jobs relay`) and a driver process
through which the tests enqueue, replay, cancel, pause and read the ledger (tests/amqp/site.py).

The pytest process is bound to the shared test database and Redis (and to no RabbitMQ), so
everything RabbitMQ-side runs in processes of its own whose BROKER_URL, DATABASE_URL and
REDIS_URL point at this suite's.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from tests.amqp.rabbitmq import RabbitMQ
from tests.amqp.site import WORKERS, Site


@pytest.fixture(scope="package")
def rabbitmq(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RabbitMQ]:
    """`make test`'s RabbitMQ, or a private node (its files in a temporary folder)."""
    node = RabbitMQ(tmp_path_factory.mktemp("rabbitmq"))
    try:
        yield node
    finally:
        node.stop()


@pytest.fixture(scope="package")
def amqp_site(rabbitmq: RabbitMQ, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    """Quorum queues (the default), 2 workers x 2 processes, the relay and a driver."""
    site = Site(rabbitmq, tmp_path_factory.mktemp("amqp"), "quorum", {})
    try:
        site.migrate()
        site.start_driver()
        site.start_workers(WORKERS)
        site.start_relay()
        yield site
    finally:
        site.close()


@pytest.fixture
def site(amqp_site: Site) -> Site:
    """The quorum site. Tests keep apart by their unique keys; the queues are not purged
    between them."""
    return amqp_site


@pytest.fixture
def unique() -> str:
    return uuid.uuid4().hex[:12]
