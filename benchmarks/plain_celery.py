"""Bare Celery as a team runs it before adopting Backlot: a Celery app with no Django and no
Backlot (kombu's own Redis transport, Celery's defaults: the ack as a message is taken,
prefetch multiplier 4, JSON), draining a no-op like `bench.bare_noop` (`bench.plain_noop`).

The layout case runs `celery -A benchmarks.plain_celery worker -c 2` beside the project's
workers: the "default bare worker -c 2" of issue 26's headline, where the project's own bare
worker (`-A config`) already runs on Backlot's transport. Its backlog goes to a queue of its
own (QUEUE), published by this app's own producer.
"""

from __future__ import annotations

import os
from typing import Any

from celery import Celery

QUEUE = "plain"

# fixups=[]: no Django fixup, even with DJANGO_SETTINGS_MODULE in the environment
app = Celery("plain", broker=os.environ["REDIS_URL"], fixups=[], set_as_current=False)
app.conf.update(task_default_queue=QUEUE, task_ignore_result=True)


@app.task(name="bench.plain_noop")
def plain_noop(*args: Any, **kwargs: Any) -> None:
    """Bare Celery's no-op."""


def queue_backlog(count: int) -> None:
    with app.producer_or_acquire() as producer:
        for i in range(count):
            plain_noop.apply_async((i,), producer=producer)
