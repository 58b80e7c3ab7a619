"""How a member's finish moves its batch: the decorators on the ledger's finish writes
(run.succeed, run.give_up, cancel.*), which put the write and the batch's counter move in one
transaction, or for a member's success that does not end its batch (PostgreSQL) in one
statement (_FOLDED). jobs.ledger.batch has the counter moves and the batch's end."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable
from contextvars import ContextVar
from typing import Any, ParamSpec, TypeVar

from django.db import connection, transaction

from jobs.core.states import JobState, batch_sources
from jobs.ledger.batch import db_value, member_ended, members_cancelled, waiting_members
from jobs.models import Batch, Job

logger = logging.getLogger(__name__)

P = ParamSpec("P")
R = TypeVar("R")


# The job this process claimed last, and its batch (None: in no batch). batch_id is written
# with the row and never changes, so the finish of that job, known to be in no batch, is its
# one UPDATE as before: no transaction and no batch statement for the jobs of no batch (measured
# on the loaded 2-core machine: +1.4 ms per finish, 3.3 -> 4.6 ms median, with them).
_claimed: ContextVar[tuple[str, Any] | None] = ContextVar("backlot_claimed_batch", default=None)


def claimed(*, job_id: Any, batch_id: Any) -> None:
    """A claim of `job_id` read its batch (run.claim)."""
    _claimed.set((str(job_id), batch_id))


def _claimed_batch(job_id: Any) -> tuple[bool, Any]:
    """(known, batch id) of `job_id` as this process's last claim read it: known is False for
    a job this process did not claim last (a finish without its claim: worker_lost, run_job of
    another process); batch id None for a job in no batch."""
    last = _claimed.get()
    if last is None or last[0] != str(job_id):
        return False, None
    return True, last[1]


# A member's success folded into one statement with its batch's counter move (PostgreSQL).
# Locks are taken in the order every other writer takes them, the job's row, then its batch's:
# `moved`'s one-time filter locks the member's row if the finish's fence holds (it then holds
# until commit), then `moved` moves the counters only when this end neither empties the batch
# nor finds it ended (its UPDATE re-reads the row it waited for), and the finish's own UPDATE
# runs only with that move. One statement is one transaction: both writes or neither, as the
# issue requires, and no row lock is held across a client round trip (the transaction path
# holds the batch's from its UPDATE to its COMMIT, one round trip later: the two pool
# processes of a worker finishing members of one batch queued on it there). When nothing was
# written the finish takes the transaction path, which settles the batch.
_FOLDED = """WITH moved AS (
    UPDATE {batches} SET {pending} = {pending} - 1, {counter} = {counter} + 1
    WHERE {id} = %s AND {state} IN ({states}) AND ({pending} > 1 OR {children_pending} > 0)
    AND EXISTS (SELECT 1 FROM {jobs} WHERE {fence} FOR UPDATE)
    RETURNING 1
)
{update} AND EXISTS (SELECT 1 FROM moved)"""

# The counter a member's end moves (besides pending), for the outcomes that may be folded.
_FOLDABLE = {JobState.SUCCEEDED: "succeeded"}


class _NotFoldable(Exception):
    """The finish write's first statement is not the UPDATE of the member's row: it is not
    run, and the finish takes the transaction path."""


class _Folding:
    """An execute wrapper (connection.execute_wrapper) around a member's finish write: its
    first statement, the UPDATE of the member's row, runs as _FOLDED (whose row count is that
    UPDATE's); any other first statement is not run."""

    def __init__(self, *, batch_id: Any, outcome: str) -> None:
        self.batch_key = db_value(batch_id)
        self.counter = _FOLDABLE[JobState(outcome)]
        self.folded = False

    def __call__(self, execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        if self.folded:
            return execute(sql, params, many, context)
        quote = connection.ops.quote_name
        head = f"UPDATE {quote(Job._meta.db_table)} SET "
        assignments, where, fence = sql.partition(" WHERE ")
        if many or not sql.startswith(head) or not where or "%%" in sql:
            raise _NotFoldable(sql[:80])
        # Django's placeholders are %s (a literal % is %%, refused above); the SET's come first.
        setting = assignments.count("%s")
        states = batch_sources("member_ended")
        folded = _FOLDED.format(
            jobs=quote(Job._meta.db_table),
            batches=quote(Batch._meta.db_table),
            fence=fence,
            id=quote("id"),
            state=quote("state"),
            pending=quote("pending"),
            children_pending=quote("children_pending"),
            counter=quote(self.counter),
            states=", ".join(["%s"] * len(states)),
            # Django writes a WHERE of several terms in parentheses: one more AND binds to all.
            update=sql,
        )
        self.folded = True
        params = list(params)
        arguments = [self.batch_key, *states, *params[setting:], *params]
        return execute(folded, arguments, many, context)


def moves_batch(outcome: str) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """The decorated finish write (keyword `job_id`; a truthy return when it ended the job)
    moves its member's batch counters in the same transaction (member_ended).

    A job in no batch (as its claim in this process read) is its write alone. A member's
    success, on PostgreSQL, is one statement with the counter move (_FOLDED), unless it ends
    the batch; every other finish is a transaction of the write and member_ended."""

    def wrap(write: Callable[P, R]) -> Callable[P, R]:
        @functools.wraps(write)
        def finish(*args: P.args, **kwargs: P.kwargs) -> R:
            job_id = kwargs["job_id"]
            known, batch_id = _claimed_batch(job_id)
            if known and batch_id is None:
                return write(*args, **kwargs)
            if known and outcome in _FOLDABLE and connection.vendor == "postgresql":
                folding = _Folding(batch_id=batch_id, outcome=outcome)
                doomed = connection.needs_rollback
                try:
                    with connection.execute_wrapper(folding):
                        done = write(*args, **kwargs)
                except _NotFoldable as exc:
                    # nothing was sent: the caller's transaction is as it was (Django's
                    # update marked it for rollback when the wrapper raised)
                    if connection.in_atomic_block:
                        transaction.set_rollback(doomed)
                    logger.warning("%s of %s not folded: %s", write.__name__, job_id, exc)
                else:
                    if done:
                        return done
                # Not written: the batch's end is due (the transaction path settles it), the
                # batch had ended, or the run lost its claim (the write below says so again).
            with transaction.atomic():
                done = write(*args, **kwargs)
                if done:
                    member_ended(job_id=job_id, outcome=outcome, batch_id=batch_id)
            return done

        return finish

    return wrap


def cancels_members(write: Callable[[list[Any]], int]) -> Callable[[Iterable[Any]], int]:
    """The decorated cancel of waiting jobs runs in one transaction with their batches'
    counters: the members among them are locked first, then counted cancelled."""

    @functools.wraps(write)
    def cancel(job_ids: Iterable[Any]) -> int:
        ids = list(job_ids)
        with transaction.atomic():
            members = waiting_members(ids)
            cancelled = write(ids)
            members_cancelled(members)
        return cancelled

    return cancel
