"""Job counters and run-time histograms kept in Redis, so /metrics is right across every
prefork process and host (prometheus-client's in-process metrics would only see one), and
one structured log line per job event. Both are receivers of jobs.core.events, connected by
JobsConfig.ready(). The dashboard's "last hour" figures read per-minute buckets of the finished
attempts (finished_by_minute), not the ledger: jobs_job keeps no index on finished_at, so that
its updates stay HOT (issue 26)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from datetime import datetime
from typing import Any

import redis
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

from jobs.broker import counters
from jobs.broker.gate_counts import RATE_LIMITED
from jobs.broker.redis import redis_client, redis_text
from jobs.core import events, tracing
from jobs.ledger import describe_exception

logger = logging.getLogger(__name__)
job_logger = logging.getLogger("backlot.jobs")

FINISHED = "backlot:metrics:finished"  # field "task\tstate" -> count
RUNTIME = "backlot:metrics:runtime:"  # + task: fields bucket bounds, "sum", "count"
# The same by queue, for dashboards and alerts that look at a queue rather than a task.
QUEUE_FINISHED = "backlot:metrics:queue_finished"  # field "queue\tstate" -> count
QUEUE_RUNTIME = "backlot:metrics:queue_runtime:"  # + queue: like RUNTIME
# The same by UTC minute (+ the minute since the epoch): field "queue\tstate" -> count. The
# dashboard reads the last hour of them; kept 2 hours after a minute's last count (an hour
# to spare for a late flush and hosts' clocks apart), so ~120 small hashes at most.
FINISHED_MINUTE = "backlot:metrics:finished_minute:"
FINISHED_MINUTE_SECONDS = 2 * 3600
# Durable steps ended (jobs.core.events.step_finished), added up in the process and written with
# the run's outcome or its park (jobs.broker.counters): no Redis round trip of their own.
STEPS = "backlot:metrics:steps"  # field "task\toutcome" -> count
# Run-time buckets (seconds): from a no-op to a one-hour transcode.
BUCKETS = (0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300, 900, 3600)


def record_outcome(
    task: str, state: str, run_seconds: float | None, queue: str | None = None
) -> None:
    """Count a finished attempt (succeeded, retrying, dead, cancelled) and its run time, by task
    and by queue (and by queue in this minute's bucket), with this process's other counts
    (jobs.broker.counters) in one Redis call; never raises."""
    counters.add(FINISHED, f"{task}\t{state}")
    if queue is not None:
        counters.add(QUEUE_FINISHED, f"{queue}\t{state}")
        bucket = finished_minute_key(time.time())
        counters.add(bucket, f"{queue}\t{state}")
        counters.expire(bucket, FINISHED_MINUTE_SECONDS)
    if run_seconds is not None:
        bound = str(next((b for b in BUCKETS if run_seconds <= b), "+Inf"))
        keys = [RUNTIME + task] + ([QUEUE_RUNTIME + queue] if queue is not None else [])
        for key in keys:
            counters.add(key, bound)
            counters.add_float(key, "sum", run_seconds)
            counters.add(key, "count")
    counters.flush_unless_carried()


def finished_minute_key(at: float) -> str:
    """The bucket of the UTC minute holding `at` (seconds since the epoch)."""
    return f"{FINISHED_MINUTE}{int(at // 60)}"


def finished_by_minute(
    minutes: int, *, now: datetime | None = None, client: redis.Redis | None = None
) -> list[dict[tuple[str, str], int]]:
    """Attempts finished in each of the last `minutes` UTC minutes, by (queue, state), oldest
    first; the last is the minute holding `now`, so far. One Redis pipeline, by `client` (the
    platform's by default); Redis errors are raised. A minute older than
    FINISHED_MINUTE_SECONDS, or lost to a Redis flush, reads as empty."""
    at = now.timestamp() if now is not None else time.time()
    current = int(at // 60)
    pipe = (client or redis_client()).pipeline(transaction=False)
    for minute in range(current - minutes + 1, current + 1):
        pipe.hgetall(finished_minute_key(minute * 60))
    buckets = []
    for fields in pipe.execute():
        bucket = {}
        for field, count in fields.items():
            queue, _, state = redis_text(field).partition("\t")
            bucket[(queue, state)] = int(count)
        buckets.append(bucket)
    return buckets


def collect() -> Iterator[CounterMetricFamily | HistogramMetricFamily]:
    client = redis_client()
    finished = CounterMetricFamily(
        "backlot_jobs_finished",
        "Job attempts finished, by task and outcome.",
        labels=["task", "state"],
    )
    for field, count in client.hgetall(FINISHED).items():
        task, _, state = redis_text(field).partition("\t")
        finished.add_metric([task, state], int(count))
    yield finished
    by_queue = CounterMetricFamily(
        "backlot_queue_jobs_finished",
        "Job attempts finished, by queue and outcome.",
        labels=["queue", "state"],
    )
    for field, count in client.hgetall(QUEUE_FINISHED).items():
        queue, _, state = redis_text(field).partition("\t")
        by_queue.add_metric([queue, state], int(count))
    yield by_queue
    waits = CounterMetricFamily(
        "backlot_rate_limit_waits", "Times a job waited for a rate-limit token.", labels=["task"]
    )
    for field, count in client.hgetall(RATE_LIMITED).items():
        waits.add_metric([redis_text(field)], int(count))
    yield waits
    steps = CounterMetricFamily(
        "backlot_steps",
        "Durable steps (self.step) ended, by task and outcome: succeeded, failed, or skipped "
        "(a later run got the stored result back without running it).",
        labels=["task", "outcome"],
    )
    for field, count in client.hgetall(STEPS).items():
        task, _, outcome = redis_text(field).partition("\t")
        steps.add_metric([task, outcome], int(count))
    yield steps
    yield _histogram(client, "backlot_job_run_seconds", "task", RUNTIME)
    yield _histogram(client, "backlot_queue_job_run_seconds", "queue", QUEUE_RUNTIME)


def _histogram(client: Any, name: str, label: str, prefix: str) -> HistogramMetricFamily:
    """The run-time histogram kept under `prefix` + each `label` value."""
    runtime = HistogramMetricFamily(name, f"Run time of job attempts, by {label}.", labels=[label])
    for key in client.scan_iter(match=prefix + "*", count=500):
        values = {redis_text(k): v for k, v in client.hgetall(key).items()}
        cumulative, buckets = 0, []
        for bound in [*map(str, BUCKETS), "+Inf"]:
            cumulative += int(values.get(bound, 0))
            buckets.append((bound, cumulative))
        runtime.add_metric(
            [key.decode()[len(prefix) :]], buckets=buckets, sum_value=float(values.get("sum", 0))
        )
    return runtime


def job_event(
    event: str,
    *,
    job_id: str,
    task: str,
    queue: str,
    attempt: int,
    duration: float | None = None,
    outcome: str | None = None,
    exception: BaseException | None = None,
) -> None:
    """One structured log line per job start, retry, success, failure and dead letter;
    finished attempts also count in the metrics. Ids, names and the exception's class only:
    no arguments, and no exception message (it may quote them).

    A dead job is logged at ERROR, so error-level alerting and error trackers see it."""
    level = {"dead": logging.ERROR, "failed": logging.WARNING}.get(event, logging.INFO)
    exception_class = describe_exception(exception)[0] if exception is not None else None
    job_logger.log(
        level,
        "job %s id=%s task=%s queue=%s attempt=%s%s%s",
        event,
        job_id,
        task,
        queue,
        attempt,
        f" duration={duration:.3f}s" if duration is not None else "",
        f" exception={exception_class}" if exception_class else "",
        extra={
            "event": event,
            "job_id": job_id,
            "task": task,
            "queue": queue,
            "attempt": attempt,
            "duration": duration,
            "outcome": outcome or event,
            "exception_class": exception_class,
            "trace_id": tracing.current_trace_id(),  # None unless the run is traced
        },
    )
    if event in ("succeeded", "retrying", "dead", "cancelled"):
        record_outcome(task, event, duration, queue)


def _receiver(event: str) -> Any:
    def receive(sender: str, *, job_id: str, queue: str, attempt: int, **kwargs: Any) -> None:
        job_event(
            event,
            job_id=job_id,
            task=sender,
            queue=queue,
            attempt=attempt,
            duration=kwargs.get("duration"),
            exception=kwargs.get("exception"),
        )

    receive.__name__ = f"log_job_{event}"
    return receive


_RECEIVERS = {
    name: _receiver(name) for name in ("started", "retrying", "succeeded", "dead", "cancelled")
}


def _count_step(sender: str, *, outcome: str, **kwargs: Any) -> None:
    counters.add(STEPS, f"{sender}\t{outcome}")


def connect() -> None:
    """Subscribe the log lines and metrics to the job events (idempotent)."""
    for name, receive in _RECEIVERS.items():
        events.ALL[name].connect(receive, dispatch_uid=f"backlot-telemetry-{name}")
    events.step_finished.connect(_count_step, dispatch_uid="backlot-telemetry-steps")
