"""Both sides of the waiting rooms (jobs.broker.concurrency) for jobs with a rate or concurrency
limit.

Enqueue parks such jobs at their gate instead of publishing them (``park``): a tenant's backlog
waits in its own list in Redis, never in the queue in front of other tenants' jobs, and the gate
publishes the ones it lets through. A delivery that still finds no slot (a retry's countdown
ended, a redelivery) is parked by the worker before its claim (``admit``: acknowledged, no pool
process held, no attempt spent). A job that ends frees its slot and the gate re-publishes the
waiters it lets go; the relay's sweep releases what no finishing job did (a slot whose worker
died lapses with its lease; rare rate tokens; a key whose waiters nobody woke).
"""

from __future__ import annotations

import json
import logging
import time
from collections import defaultdict
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Protocol

from celery import current_app
from django.utils import timezone
from redis.exceptions import RedisError

from jobs import ledger
from jobs.broker.broker import Publishable, publish
from jobs.broker.concurrency import Gate, Gates, Released, horizon_for
from jobs.broker.gate_counts import PARKED, RATE_LIMITED, RESENDS, count
from jobs.broker.ratelimit import parse_rate
from jobs.core import events, tracing
from jobs.core.conf import backlot_settings


class Gated(Publishable, Protocol):
    """What a gate needs of a limited task (PlatformTask has it): its limits, how it names a
    job's bucket and slot, its delivery and its defaults. Declared here, not taken from the
    worker's Runnable, so that the broker layer names nothing above it."""

    track: bool
    default_priority: int
    cluster_rate_limit: str | Mapping[str, str] | None
    concurrency_limit: int | Mapping[str, int] | None

    @property
    def request(self) -> Any: ...

    def rate_bucket(self, args: tuple, kwargs: dict) -> tuple[str, str | None]: ...

    def concurrency_slot(self, args: tuple, kwargs: dict) -> tuple[str, int | None]: ...


logger = logging.getLogger(__name__)

# A granted job whose turn is at most this far off waits for it in its pool process instead of
# being re-sent (a re-send costs a publish and a delivery, ~5-20 ms here, and lands late); a
# few times at most, then it is re-sent.
SHORT_WAIT = 0.1
SHORT_WAITS = 3
# The longest a claimed rate-limited run waits for its turn to begin (Slots.pace): a full
# second's window empties within 1 s.
PACE_BOUND = 1.5

# Message options a parked delivery does not keep: its id and retry count are kept apart, and
# headers are filtered (the platform's own are written afresh per message).
_NOT_KEPT = frozenset({"task_id", "retries", "headers"})
_OWN_HEADERS = ("backlot_", "traceparent", "tracestate", "baggage")


def limited(task: Any) -> bool:
    """Whether a task's jobs pass a gate (a rate limit or a concurrency limit)."""
    return bool(
        getattr(task, "cluster_rate_limit", None) or getattr(task, "concurrency_limit", None)
    )


def _request_queue(task: Any) -> str:
    return str((task.request.delivery_info or {}).get("routing_key") or task.queue_name)


def _request_priority(task: Any) -> int:
    # Backlot's 0-9 already: PlatformRequest maps the broker's level back (jobs.worker.request).
    priority = (task.request.delivery_info or {}).get("priority")
    if isinstance(priority, int):
        return max(0, min(9, priority))
    return int(task.default_priority)


def job_gate(
    task: Any, args: Sequence[Any], kwargs: Mapping[str, Any], queue: str = ""
) -> Gate | None:
    """The gate this call waits at (its rate bucket and/or concurrency key), or None; `queue`
    defaults to the one the delivery came from."""
    args, kwargs = tuple(args), dict(kwargs)
    bucket, rate = task.rate_bucket(args, kwargs) if task.cluster_rate_limit else ("", None)
    holders, limit = task.concurrency_slot(args, kwargs) if task.concurrency_limit else ("", None)
    if rate is None and not limit:
        return None
    if limit and rate is not None and holders != bucket:
        name = f"{holders}|{bucket}"
    else:
        name = holders if limit else bucket
    return Gate(
        name=name,
        queue=queue or _request_queue(task),
        holders=holders if limit else "",
        limit=int(limit or 0),
        bucket=bucket if rate is not None else "",
        interval=parse_rate(rate) if rate is not None else 0.0,
        lease=backlot_settings().LEASE_SECONDS,
    )


@dataclass
class Slots:
    """What one delivery holds at its gate; `release()` frees it once the run has ended."""

    task_name: str = ""
    job_id: str = ""
    gate: Gate | None = None
    fresh: bool = False  # this delivery took the slot (a redelivery of a holder did not)
    started: bool = False  # the claim succeeded: the slot is this run's
    released: bool = field(default=False, repr=False)

    def pace(self) -> None:
        """Right before a rate-limited job's code runs (after its claim): wait, briefly, while
        the last second's runs of its bucket already number `limit` (a stall that let several
        claims finish together); bounded, then it runs anyway."""
        if self.gate is None or not self.gate.interval:
            return
        gates = Gates()
        deadline = time.monotonic() + PACE_BOUND
        try:
            while (wait := gates.pace(self.gate, self.job_id)) > 0:
                if time.monotonic() + wait > deadline:
                    logger.info("Job %s starts unpaced after %.1f s", self.job_id, PACE_BOUND)
                    return
                time.sleep(wait)
        except RedisError as exc:  # the gate let it in: pacing is the finish, not the limit
            logger.warning("Could not pace job %s: %s", self.job_id, exc)

    def renew(self) -> None:
        """Extend the slot with the job's lease (called by the lease renewer)."""
        if self.gate is not None and self.gate.limit:
            Gates().renew(self.gate, self.job_id)

    def release(self) -> None:
        """Free the slot (if this delivery's to free) and let the next waiters go; never
        raises over the job's own outcome."""
        if self.gate is None or self.released or not (self.fresh or self.started):
            return
        self.released = True
        try:
            free(self.task_name, self.gate, self.job_id)
        except Exception:
            logger.exception("Could not release the slot of job %s", self.job_id)


def admit(task: Gated, args: tuple, kwargs: dict, held: Slots) -> bool:
    """Pass this delivery through its gate: True when it may run now (`held` records the
    slot), False when it waits (parked, or granted a slot a moment ahead and re-sent for it):
    drop the delivery then."""
    gate = job_gate(task, args, kwargs)
    request = task.request
    job_id = str(request.id)
    if gate is None:
        return True
    conf = backlot_settings()
    horizon = horizon_for(gate.interval, conf.RATE_LIMIT_MAX_RESERVE)
    gates = Gates()
    message = _parked_message(task, args, kwargs)
    decision = gates.admit(gate, job_id, message, horizon=horizon)
    for _ in range(SHORT_WAITS):
        if decision.verdict != "early" or decision.wait > SHORT_WAIT:
            break
        time.sleep(decision.wait)  # its turn is a moment away: cheaper than a re-send
        decision = gates.admit(gate, job_id, message, horizon=horizon)
    if decision.runs:
        if decision.waiting and gate.interval:
            _publish(task.name, gates.dispatch(gate, horizon=horizon))  # the next tokens' turn
        held.task_name, held.job_id, held.gate = task.name, job_id, gate
        held.fresh = decision.verdict == "go"
        return True
    if decision.verdict == "early":
        _publish(task.name, [Released(job_id, message, decision.wait)])
    elif decision.verdict == "parked":
        count(PARKED, RATE_LIMITED, task=task.name)
        turn = decision.waiting * gate.interval
        events.send(events.job_rate_limited, task=task.name, job_id=job_id, wait=turn)
        logger.debug("Job %s waits at %s (%d waiting)", job_id, gate.name, decision.waiting)
        _publish(task.name, gates.dispatch(gate, horizon=horizon))
    return False


def free(task_name: str, gate: Gate, job_id: str) -> None:
    """The job ended or will not run: free its slot or its place, and let waiters go."""
    gates = Gates()
    gates.release(gate, job_id)
    horizon = horizon_for(gate.interval, backlot_settings().RATE_LIMIT_MAX_RESERVE)
    for waiting in gates.sharing(gate):
        _publish(task_name, gates.dispatch(waiting, horizon=horizon))


def free_job(job_id: str) -> bool:
    """Free whatever a job holds or waits for, knowing only its id (a cancel, a dead pool
    process); True when it held or waited for something."""
    gates = Gates()
    gate = gates.gate_of(job_id)
    if gate is None:
        return False
    free("", gate, job_id)
    return True


def sweep() -> int:
    """Release what the gates can let go now (slots whose holder's lease lapsed, rate tokens
    now due, waiters of a key nobody finished a job of); returns how many were re-published.
    Run by the relay."""
    gates = Gates()
    sent = 0
    max_reserve = backlot_settings().RATE_LIMIT_MAX_RESERVE
    for name in gates.waiting_gates():
        gate = gates.stored(name)
        if gate is not None:
            sent += _publish(
                "", gates.dispatch(gate, horizon=horizon_for(gate.interval, max_reserve))
            )
    return sent


def forget(job_ids: Iterable[Any]) -> int:
    """Take cancelled jobs out of the gates they wait at (and free a slot granted to them)."""
    return sum(free_job(str(job_id)) for job_id in job_ids)


def _parked_message(task: Gated, args: tuple, kwargs: dict) -> str:
    """Everything needed to publish this delivery again, as JSON (what resend() would send)."""
    request = task.request
    options = {
        key: value
        for key, value in request.as_execution_options().items()
        if value is not None and key not in _NOT_KEPT
    }
    headers = {
        key: value
        for key, value in (getattr(request, "headers", None) or {}).items()
        if not str(key).startswith(_OWN_HEADERS)
    }
    return _message(
        task=task.name,
        args=args,
        kwargs=kwargs,
        queue=_request_queue(task),
        priority=_request_priority(task),
        retries=request.retries or 0,
        trace=tracing.message_context(request),
        track=task.track,
        options=options,
        headers=headers,
        sent=True,
    )


def _message(**message: Any) -> str:
    try:
        return json.dumps(message)
    except (TypeError, ValueError):
        logger.warning("A job's message options are not JSON; it waits without them")
        return json.dumps({**message, "options": {}, "headers": {}})


@dataclass(frozen=True)
class Parking:
    """One job to park at enqueue: its id, arguments and what its message carries."""

    job_id: str
    args: Sequence[Any]
    kwargs: Mapping[str, Any]
    queue: str
    priority: int
    options: Mapping[str, Any] | None = None
    trace: Mapping[str, str] | None = None


def park(task: Any, jobs: Sequence[Parking]) -> list[str]:
    """Accepted jobs of a limited task wait at their gates instead of entering the queue (the
    gates publish those they let through at once); returns the ids parked or published, []
    when Redis is unavailable (the caller publishes them itself then)."""
    gates = Gates()
    conf = backlot_settings()
    # Their callers mark these jobs' rows published (inserted marked, or marked after the
    # park), so those let through at once cost no UPDATE here.
    parked = {item.job_id for item in jobs}
    touched: dict[str, Gate] = {}
    waiting: list[tuple[Gate, str, str]] = []
    done: list[str] = []
    try:
        for item in jobs:
            gate = job_gate(task, item.args, item.kwargs, queue=item.queue)
            if gate is None:
                continue
            options = dict(item.options or {})
            message = _message(
                task=task.name,
                args=list(item.args),
                kwargs=dict(item.kwargs),
                queue=item.queue,
                priority=item.priority,
                retries=int(options.pop("retries", 0) or 0),
                trace=dict(item.trace or {}),
                track=task.track,
                headers=dict(options.pop("headers", None) or {}),
                options=options,
                sent=False,
            )
            waiting.append((gate, item.job_id, message))
            touched[gate.name] = gate
            done.append(item.job_id)
        # the parks, their count and each gate's dispatch: one round trip (Gates.park)
        dispatch = [
            (gate, horizon_for(gate.interval, conf.RATE_LIMIT_MAX_RESERVE))
            for gate in touched.values()
        ]
        releases = gates.park(
            waiting, dispatch=dispatch, counter=(PARKED, task.name), rate_waits=task.name
        )
        for (gate, _), released in zip(dispatch, releases, strict=True):
            _publish(task.name, released, marked=parked)
            if gate.interval:
                _waits(task.name, gate, [j for g, j, _ in waiting if g is gate], released)
    except RedisError as exc:
        logger.warning("Could not park %d jobs of %s at their gates: %s", len(jobs), task.name, exc)
        return []
    return done


def _waits(task_name: str, gate: Gate, parked: list[str], released: list[Released]) -> None:
    """job_rate_limited for each job parked at enqueue that waits for a later token, with its
    turn estimated from its place in the line (the park counted them in RATE_LIMITED)."""
    gone = {item.job_id for item in released}
    place = len(released)
    for job_id in parked:
        if job_id in gone:
            continue
        place += 1
        events.send(
            events.job_rate_limited, task=task_name, job_id=job_id, wait=place * gate.interval
        )


def _publish(task_name: str, released: list[Released], marked: Collection[str] = ()) -> int:
    """Publish released waiters (at their priority; a granted token as a countdown); each
    counts as a re-send unless it was parked at enqueue, before any message of it was sent.
    Their rows are marked published (a waiter's mark is as old as its park) but for those in
    `marked`, whose publisher marks them."""
    sent, tracked = 0, defaultdict(list)  # marked per the runs each had when sent
    for item in released:
        message = json.loads(item.message)
        # A registered @job is a PlatformTask, which is Publishable (celery-types types the
        # registry as plain Task).
        task: Any = current_app.tasks.get(message["task"])
        if task is None:
            logger.error("Job %s names unknown task %s; left to the relay", item.job_id, message)
            continue
        headers = dict(message.get("headers") or {})
        eta = timezone.now() + timedelta(seconds=item.wait) if item.wait > 0.002 else None
        ok = publish(
            task=task,
            job_id=item.job_id,
            args=message["args"],
            kwargs=message["kwargs"],
            queue=message["queue"],
            priority=message["priority"],
            eta=eta,
            options={
                **message.get("options", {}),
                "retries": message.get("retries", 0),
                **({"headers": headers} if headers else {}),
            },
            trace_context=message.get("trace") or None,
        )
        if not ok:
            # The broker is away: the ledger row still waits (queued) and the relay re-sends
            # it once its message is found lost; its slot lapses with its lease.
            continue
        sent += 1
        if message.get("sent", True):
            count(RESENDS, task=message["task"] or task_name)
        if message.get("track", True) and item.job_id not in marked:
            tracked[int(message.get("retries", 0))].append(item.job_id)
    for attempts, ids in tracked.items():
        ledger.mark_published(ids, attempts=attempts)
    return sent
