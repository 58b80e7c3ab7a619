"""Durable steps: a job's work in named steps, each run once per job, and durable sleeps.

    @job(name="reports.monthly")
    def monthly(self, report_id: int) -> None:
        rows = self.step("query", report_query, report_id)     # runs once per job
        pdf_id = self.step("render", report_render, rows)      # a retry starts here
        self.sleep(timedelta(hours=1))                         # no worker held meanwhile
        self.step("email", report_email, pdf_id)

A step's JSON result is stored in the ledger (jobs.models.JobStep) when it succeeds, in a write
fenced by the run's claim (jobs.ledger.steps). Every later run of the job — a retry, a
redelivery after a crash, a dead letter's replay (which copies the finished steps) — gets the
stored result back without running the step. A step that raises is recorded as failed and the
job follows its retry policy; the next run starts that step again.

Steps are matched by position and name: a run that asks for another step than the history
holds at that place (the code changed, a name is not deterministic) raises StepOrderChanged
naming both, and the job gives up rather than hand a step another step's result.

A sleep is a step too: its first run ends the job's run (Parked, which jobs.worker.execution
turns into a scheduled row; no attempt is spent), and the run that resumes finds the sleep
over and goes on with the next step.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.core.serializers.json import DjangoJSONEncoder
from django.utils import timezone

from jobs import ledger
from jobs.core import events
from jobs.core.conf import backlot_settings
from jobs.core.exceptions import (
    BacklotError,
    LeaseLost,
    StepOrderChanged,
    StepResultTooLarge,
    StepTimeout,
)
from jobs.core.payload import json_problem
from jobs.models import JobSignal, JobStep, StepState
from jobs.worker.lease import Hold, current, refused, renewer


class Parked(BacklotError):
    """Raised by self.sleep()/sleep_until() to end the run until `wake_at` (the worker's run
    catches it: the job is scheduled, not failed). A job must not catch it."""

    def __init__(
        self,
        job_id: str,
        name: str,
        position: int,
        wake_at: datetime,
        kind: str = "sleep",
        event: str | None = None,
    ) -> None:
        super().__init__(f"Job {job_id} sleeps until {wake_at.isoformat()} (step {name!r})")
        self.job_id = job_id
        self.name = name
        self.position = position
        self.wake_at = wake_at
        self.kind = kind  # "sleep", or "wait" for a wait_for(event) whose timeout is wake_at
        self.event = event


@dataclass
class StepBook:
    """The steps of one run: the stored history, read once, and where the job's code is."""

    job_id: str
    hold: Hold
    by_position: dict[int, JobStep]
    by_name: dict[str, JobStep] = field(default_factory=dict)
    next: int = 0
    inside: str = ""  # the step whose function runs now (steps do not nest)

    def take(self, name: str, kind: str) -> tuple[int, JobStep | None]:
        """The next position and the stored step there; StepOrderChanged when the history
        holds another step there, or this step at another place."""
        if self.inside:
            # A later run skips the outer step, and with it the inner one: the positions after
            # it would not match the history.
            raise StepOrderChanged(
                f"Job {self.job_id}: {kind} {name!r} was asked for inside step "
                f"{self.inside!r}; steps, sleeps and waits do not nest"
            )
        position = self.next
        self.next += 1
        stored = self.by_position.get(position)
        if stored is not None and (stored.name != name or stored.kind != kind):
            raise StepOrderChanged(
                f"Job {self.job_id}: step {name!r} is step {position + 1} of this run, but the "
                f"job's history has {stored.kind} {stored.name!r} there; step names must be "
                "deterministic and the code must ask for its steps in the same order on every run"
            )
        if stored is None and name in self.by_name:
            earlier = self.by_name[name]
            raise StepOrderChanged(
                f"Job {self.job_id}: step {name!r} is step {position + 1} of this run, but the "
                f"job's history has it as step {earlier.position + 1}; step names must be "
                "unique in a job and asked for in the same order on every run"
            )
        return position, stored

    def record(self, step: JobStep) -> None:
        self.by_position[step.position] = step
        self.by_name[step.name] = step


def book_of(task: Any) -> StepBook | None:
    """The run's step book (kept on Celery's request), or None outside a tracked run (called
    directly, eager, untracked: steps then just run)."""
    request = task.request
    if not getattr(task, "track", False) or request.called_directly or request.is_eager:
        return None
    job_id = str(request.id)
    hold = current() or renewer.held(job_id)
    if hold is None:
        return None
    book: StepBook | None = getattr(request, "_backlot_steps", None)
    if book is None or book.job_id != job_id or book.hold is not hold:
        stored = list(JobStep.objects.of_job(job_id))
        book = StepBook(
            job_id,
            hold,
            {step.position: step for step in stored},
            {step.name: step for step in stored},
        )
        request._backlot_steps = book  # Celery's per-request Context declares no such attribute
    return book


def _write(hold: Hold, write: Callable[..., bool], what: str, **values: Any) -> None:
    """A fenced step write of this run; LeaseLost when the run no longer holds the job."""
    try:
        hold.check()
        hold.claim_now()  # a deferred claim is written before the run's first step write
    except LeaseLost:
        refused(what, hold.job_id, hold.attempt)
        raise
    if not write(
        job_id=hold.job_id,
        attempt=hold.attempt,
        lease_owner=hold.lease_owner,
        lease_seconds=hold.lease_seconds,
        **values,
    ):
        hold.lose("taken over")
        refused(what, hold.job_id, hold.attempt)
        hold.told = True
        raise LeaseLost(hold.job_id, hold.lost or "taken over")


def stored_result(name: str, result: Any) -> Any:
    """The result as the ledger keeps it (JSON: a tuple comes back a list), size-checked."""
    problem = json_problem(result, f"step {name!r}'s result")
    if problem:
        raise StepResultTooLarge(f"{problem}; a step returns ids and plain values.")
    text = json.dumps(result, cls=DjangoJSONEncoder, separators=(",", ":"))
    limit = backlot_settings().MAX_PAYLOAD_BYTES
    if len(text.encode()) > limit:
        raise StepResultTooLarge(
            f"Step {name!r} returned {len(text.encode())} bytes as JSON, over the {limit}-byte "
            "limit (BACKLOT['MAX_PAYLOAD_BYTES']); store the data and return its id."
        )
    return json.loads(text)


def run_step(task: Any, name: str, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """Run `fn(*args, **kwargs)` as the job's step `name`, or return its stored result."""
    if not name or len(name) > 200:
        raise ValueError("a step's name must be 1-200 characters")
    book = book_of(task)
    if book is None:
        return fn(*args, **kwargs)
    position, stored = book.take(name, "step")
    hold = book.hold
    step = {"task": task.name, "job_id": book.job_id, "name": name, "position": position,
            "attempt": hold.attempt}  # fmt: skip
    if stored is not None and stored.state == StepState.SUCCEEDED:
        events.send(events.step_finished, **step, outcome="skipped", seconds=0.0, exception=None)
        return stored.result
    _write(hold, ledger.step_started, "step", name=name, position=position)
    events.send(events.step_started, **step)
    book.inside = name
    started = time.monotonic()
    try:
        result = stored_result(name, fn(*args, **kwargs))
    except LeaseLost:
        raise
    except Exception as exc:
        seconds = time.monotonic() - started
        _write(hold, ledger.step_failed, "step", name=name, exc=exc)
        events.send(events.step_finished, **step, outcome="failed", seconds=seconds, exception=exc)
        raise
    finally:
        book.inside = ""
    seconds = time.monotonic() - started
    _write(hold, ledger.step_succeeded, "step", name=name, result=result)
    events.send(events.step_finished, **step, outcome="succeeded", seconds=seconds, exception=None)
    book.record(
        JobStep(
            job_id=book.job_id,
            name=name,
            position=position,
            state=StepState.SUCCEEDED,
            result=result,
        )
    )
    return result


def sleep_until(task: Any, when: datetime, name: str | None = None) -> None:
    """End the run until `when` (a durable sleep), or go on if that time has come."""
    if timezone.is_naive(when):
        raise ValueError("sleep_until() needs an aware datetime")
    book = book_of(task)
    if book is None:
        if getattr(task, "track", False) or task.request.called_directly:
            time.sleep(max(0.0, (when - timezone.now()).total_seconds()))  # no ledger: a nap
            return
        raise ValueError(f"{task.name}: a durable sleep needs a tracked job (track=True)")
    name = name or f"sleep-{book.next + 1}"
    position, stored = book.take(name, "sleep")
    if stored is not None and stored.state == StepState.SUCCEEDED:
        return
    wake_at = stored.wake_at if stored is not None and stored.wake_at is not None else when
    # A run claimed before the wake-up (within the claim's early tolerance, jobs.ledger.claim)
    # sleeps again for what is left: a sleep never ends early.
    if wake_at <= timezone.now():
        if stored is None:
            _write(
                book.hold, ledger.step_started, "step", name=name, position=position, kind="sleep"
            )
        _write(book.hold, ledger.sleep_ended, "step", name=name)
        book.record(
            JobStep(job_id=book.job_id, name=name, position=position, kind="sleep",
                    state=StepState.SUCCEEDED)
        )  # fmt: skip
        return
    raise Parked(book.job_id, name, position, wake_at)


def sleep_for(task: Any, duration: timedelta | float, name: str | None = None) -> None:
    seconds = duration.total_seconds() if isinstance(duration, timedelta) else float(duration)
    if seconds < 0:
        raise ValueError("a sleep's duration must not be negative")
    book = book_of(task)
    if book is not None:
        # The wake-up time is the first run's: a resumed run finds it stored.
        position = book.next
        stored = book.by_position.get(position)
        if stored is not None and stored.wake_at is not None:
            sleep_until(task, stored.wake_at, name)
            return
    sleep_until(task, timezone.now() + timedelta(seconds=seconds), name)


# A wait_for() without a timeout waits this long (the row is scheduled that far ahead).
FOREVER = timedelta(days=365 * 100)


def wait_step(event: str) -> str:
    """The step name of a wait for `event` (jobs.signal finds the parked job by it)."""
    return f"wait:{event}"


def wait_for(task: Any, event: str, timeout: timedelta | float | None = None) -> Any:
    """The payload of the job's signal `event` (jobs.signal), parking the job (no worker held)
    until it comes; StepTimeout once `timeout` passed without it."""
    if not event or len(event) > 190:
        raise ValueError("an event's name must be 1-190 characters")
    book = book_of(task)
    if book is None:
        raise ValueError(f"{task.name}: wait_for() needs a tracked job run by a worker")
    name = wait_step(event)
    position, stored = book.take(name, "wait")
    if stored is not None and stored.state == StepState.SUCCEEDED:
        return _waited(book.job_id, event, stored.result)
    signal = JobSignal.objects.filter(job_id=book.job_id, name=event).first()
    now = timezone.now()
    if stored is not None and stored.wake_at is not None:
        deadline = stored.wake_at
    elif timeout is None:
        deadline = now + FOREVER
    else:
        seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
        deadline = now + timedelta(seconds=seconds)
    if signal is None and deadline > now:
        raise Parked(book.job_id, name, position, deadline, kind="wait", event=event)
    outcome = {"payload": signal.payload} if signal is not None else {"timed_out": True}
    if stored is None:
        _write(book.hold, ledger.step_started, "step", name=name, position=position, kind="wait")
    _write(book.hold, ledger.step_succeeded, "step", name=name, result=outcome)
    book.record(
        JobStep(job_id=book.job_id, name=name, position=position, kind="wait",
                state=StepState.SUCCEEDED, result=outcome)
    )  # fmt: skip
    return _waited(book.job_id, event, outcome)


def _waited(job_id: str, event: str, outcome: Any) -> Any:
    if isinstance(outcome, dict) and outcome.get("timed_out"):
        raise StepTimeout(f"Job {job_id}: no signal {event!r} came before the wait's timeout")
    return outcome.get("payload") if isinstance(outcome, dict) else None
