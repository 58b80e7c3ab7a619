"""The cockpit never waits on a broadcast: the admin dashboard and /metrics read worker presence
from the records the workers keep with their heartbeats (jobs.broker.heartbeat), so with 5
real workers a dashboard whose old worker cache would be stale (just after a pause and a
resume) answers in less than one broadcast's reply timeout, and no message goes to Celery's
pidbox (the channel every inspect/ping broadcast is published on) while it does."""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis
from celery import current_app
from django.urls import reverse

from jobs.broker.heartbeat import HEARTBEAT_TTL, workers_present
from jobs.broker.pausing import pause, resume
from jobs.testing import Worker
from tests.conftest import wait_until

pytestmark = pytest.mark.django_db(transaction=True)

WORKERS = 5
# A dashboard that waited on the inspect broadcasts took 2.05-2.33 s (each waits its 1 s reply
# timeout); one that reads the heartbeat records answers in tens of ms (issue 25's 200 ms target).
# The bound sits below one broadcast's timeout: a test process sharing 2 loaded cores read 352 ms
# once, which is load, not a broadcast (the pidbox listener above would hear one).
COLD_BOUND_SECONDS = 0.9


@pytest.fixture
def five_workers(start_worker: Callable[..., Worker], clean_redis: None) -> Any:
    started = [start_worker(f"cockpit{n}", queues="default", concurrency=1) for n in range(WORKERS)]
    yield started
    for worker in started:
        worker.stop()


@pytest.fixture
def pidbox(settings: Any) -> Any:
    """Every message published on a pidbox channel (Celery's broadcasts) while the test runs."""
    client = redis.Redis.from_url(settings.CELERY_BROKER_URL)
    listener = client.pubsub(ignore_subscribe_messages=True)
    listener.psubscribe("*pidbox*")
    wait_until(lambda: listener.get_message(timeout=0.1) is None, what="the subscription")
    yield listener
    listener.close()
    client.close()


def broadcasts(listener: Any) -> list[Any]:
    seen = []
    while (message := listener.get_message(timeout=0.2)) is not None:
        seen.append(message)
    return seen


def to_all_or_to(names: set[str], messages: list[Any]) -> list[Any]:
    """The broadcasts sent to every worker or to one of `names`: a ping another test (in
    another xdist process, on the same Redis) sends its own worker by name is not this one's."""
    kept = []
    for message in messages:
        try:
            envelope = json.loads(message["data"])
            destination = json.loads(base64.b64decode(envelope["body"])).get("destination")
        except (ValueError, KeyError, TypeError, AttributeError):
            destination = None  # not a control message read here: counted
        if not destination or names & set(destination):
            kept.append(message)
    return kept


def timed(client: Any, url: str, **headers: Any) -> tuple[Any, float]:
    started = time.perf_counter()
    response = client.get(url, **headers)
    return response, time.perf_counter() - started


def test_dashboard_and_metrics_read_five_workers_without_a_broadcast(
    five_workers, pidbox, admin_client, settings
):
    names = {worker.name for worker in five_workers}
    wait_until(lambda: names <= set(workers_present()), what="the 5 workers' presence")
    # the listener hears a broadcast when there is one (a positive control)
    current_app.control.broadcast("ping", reply=False)
    assert to_all_or_to(names, broadcasts(pidbox)), "a broadcast was not heard on the pidbox"
    settings.BACKLOT = {**settings.BACKLOT, "METRICS_TOKEN": "scrape-me"}
    dashboard = reverse("admin:jobs_dashboard")
    dashboard_json = reverse("admin:jobs_dashboard_json")
    admin_client.get(dashboard_json)  # Django's own first-request work, not the cockpit's

    # when a pause and a resume have made the old worker cache stale
    pause("default")
    resume("default")
    # (each sends the workers a sync command: a broadcast of the write, heard here)
    wait_until(lambda: len(broadcasts(pidbox)) >= 1, what="the pause's sync broadcast")
    broadcasts(pidbox)
    page, page_seconds = timed(admin_client, dashboard)
    data, json_seconds = timed(admin_client, dashboard_json)
    metrics, metrics_seconds = timed(
        admin_client, "/metrics", HTTP_AUTHORIZATION="Bearer scrape-me"
    )

    # then nothing was broadcast, every answer came under the bound, and the 5 workers show
    assert to_all_or_to(names, broadcasts(pidbox)) == []
    assert page.status_code == 200 and data.status_code == 200 and metrics.status_code == 200
    timings = {
        "dashboard": page_seconds,
        "dashboard.json": json_seconds,
        "metrics": metrics_seconds,
    }
    print(
        "\ncockpit with 5 workers, after pause/resume: "
        + ", ".join(f"{name} {seconds * 1000:.0f} ms" for name, seconds in timings.items())
    )
    assert max(timings.values()) < COLD_BOUND_SECONDS, timings
    workers = data.json()["workers"]
    for name in names:
        assert workers[name]["queues"] == ["default"]
        assert workers[name]["concurrency"] == 1
    line = next(
        line
        for line in metrics.content.decode().splitlines()
        if line.startswith('backlot_workers{queue="default"}')
    )
    assert float(line.split()[-1]) >= WORKERS
    for name in names:
        assert name in page.content.decode()


def test_a_stopped_worker_leaves_the_cockpit_within_a_heartbeat_ttl(start_worker, clean_redis):
    worker = start_worker("cockpit-leaving", queues="default", concurrency=1)
    wait_until(lambda: worker.name in workers_present(), what="its presence")
    worker.stop()
    wait_until(
        lambda: worker.name not in workers_present(),
        timeout=HEARTBEAT_TTL + 5,
        what="the stopped worker's presence to go",
    )


def test_a_paused_queue_is_left_out_of_a_workers_queues(start_worker, clean_redis):
    from jobs.web.monitoring import workers_detail

    worker = start_worker("cockpit-paused", queues="default,emails", concurrency=1)
    try:
        wait_until(lambda: worker.name in workers_present(), what="its presence")
        pause("emails")
        assert workers_detail()[worker.name]["queues"] == ["default"]
        resume("emails")
        assert workers_detail()[worker.name]["queues"] == ["default", "emails"]
    finally:
        worker.stop()
