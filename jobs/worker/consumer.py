"""The worker's consumer on RabbitMQ: Celery's, without its native delayed delivery.

With quorum queues Celery adds a bootstep that declares 28 TTL queues and exchanges
(``celery_delayed_*``) to hold countdowns broker-side. Backlot keeps every delay in the
ledger and publishes a job when it is due (jobs.broker.amqp), so that topology would stay
empty: it is not declared, and its warning about direct exchanges is not logged.
"""

from __future__ import annotations

from celery.worker.consumer import Consumer as CeleryConsumer

DELAYED_DELIVERY = "celery.worker.consumer.delayed_delivery:DelayedDelivery"


class Consumer(CeleryConsumer):
    class Blueprint(CeleryConsumer.Blueprint):  # type: ignore[misc,valid-type]  # a variable to celery-types
        default_steps = [
            step for step in CeleryConsumer.Blueprint.default_steps if step != DELAYED_DELIVERY
        ]
