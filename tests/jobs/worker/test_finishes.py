"""jobs.worker.finishes in process, its ledger write replaced (our own collaborator): a solo
worker's successes wait until the batch is full or its time is up, are written in one call,
and only then let their messages' acknowledgements go (jobs.broker.reservations.HeldAcks); a
database away keeps them waiting and held; a row the write refused is counted refused. A
prefork pool process hands its success back with its run's end, and the main process batches
it; a run that fails after its success writes it where it ran; a solo worker hands nothing
back."""

from __future__ import annotations

import logging
import pickle
import uuid
from datetime import UTC, datetime
from typing import Any

import pytest
from django.db import OperationalError

from jobs import ledger
from jobs.broker.reservations import held_acks
from jobs.testing import wait_until
from jobs.worker import finishes
from jobs.worker.deferred import DeferredClaim
from jobs.worker.finishes import Finishes


class Writes:
    """Stands in for ledger.succeed_unclaimed_many: records each call's job ids, writes them
    all unless told to refuse some or to fail."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []
        self.refuse: set[str] = set()
        self.fail: Exception | None = None

    def __call__(self, successes: list[ledger.Success]) -> set[str]:
        if self.fail is not None:
            raise self.fail
        ids = [s.job_id for s in successes]
        self.calls.append(ids)
        return set(ids) - self.refuse


@pytest.fixture
def writes(monkeypatch) -> Writes:
    fake = Writes()
    monkeypatch.setattr(ledger, "succeed_unclaimed_many", fake)
    held_acks.take_released()  # another test's leftovers
    return fake


def run_ended(finishes: Finishes, acked: bool = True) -> tuple[str, str]:
    """A short run's success handed to `finishes`; its message acknowledged after (as Celery
    acknowledges once the task returned), unless `acked` is False. Its job id and tag."""
    job_id, tag = str(uuid.uuid4()), str(uuid.uuid4())
    deferred = DeferredClaim(job_id, 0, str(uuid.uuid4()), datetime.now(UTC), 30.0)
    now = datetime.now(UTC)
    success = ledger.Success(job_id, 0, deferred.lease_owner, now, now, 0.001)
    assert finishes.add(deferred, success, 1, tag)
    if acked:
        held_acks.park(tag)  # held (True) unless its success was written already
    return job_id, tag


def test_successes_wait_for_a_full_batch_then_go_in_one_write_and_their_acks_with_it(writes):
    # given a batch of three, with no time limit that this test could reach
    finishes = Finishes(3, 600)

    # when two runs end and their messages are acknowledged
    (first, first_tag), (second, second_tag) = run_ended(finishes), run_ended(finishes)

    # then nothing is written and both acknowledgements are held
    assert writes.calls == [] and held_acks.take_released() == []

    # when a third ends: one write of the three, and the two held acknowledgements go
    third, third_tag = run_ended(finishes, acked=False)
    assert writes.calls == [[first, second, third]]
    assert sorted(held_acks.take_released()) == sorted([first_tag, second_tag])
    # the third's own ack, which comes after its write, is an ordinary one
    assert held_acks.park(third_tag) is False


def test_a_database_away_keeps_them_waiting_and_held_until_a_write_takes_them(writes, caplog):
    finishes = Finishes(2, 600)
    writes.fail = OperationalError("connection refused")

    # when the batch fills while the database is away
    (one, one_tag) = run_ended(finishes)
    with caplog.at_level(logging.WARNING, logger="jobs.worker.finishes"):
        (two, two_tag) = run_ended(finishes, acked=False)

    # then they wait, said so in the log, the held acknowledgement still held
    assert "2 job success(es) not written (connection refused)" in caplog.text
    assert [w.success.job_id for w in finishes.waiting] == [one, two]
    assert held_acks.take_released() == []

    # when the database is back: the next write takes both, and the acknowledgement goes
    writes.fail = None
    finishes.write()
    assert writes.calls == [[one, two]] and finishes.waiting == []
    assert held_acks.take_released() == [one_tag]
    assert held_acks.park(two_tag) is False


def test_the_thread_writes_them_when_no_run_fills_the_batch(writes):
    # given a batch of 32 that waits 50 ms at most
    finishes = Finishes(32, 0.05)

    # when one run ends and nothing follows
    job_id, tag = run_ended(finishes)

    # then the thread writes it and its acknowledgement goes
    released: list[str] = []

    def written() -> bool:
        released.extend(held_acks.take_released())
        return released == [tag]

    wait_until(written, timeout=5, interval=0.01, what="the thread's write")
    assert writes.calls == [[job_id]]


def test_a_row_the_write_refused_is_counted_refused_and_its_message_acknowledged(
    writes, caplog: Any
):
    finishes = Finishes(2, 600)
    kept, kept_tag = run_ended(finishes)
    writes.refuse = {kept}
    with caplog.at_level(logging.WARNING, logger="jobs.worker.lease"):
        run_ended(finishes, acked=False)
    assert f"Job {kept}: run of attempt 1 lost its claim; its succeed was refused" in caplog.text
    assert held_acks.take_released() == [kept_tag]


class Traced:
    """A tracked task as a prefork pool process holds it: its tracer (Celery's build_tracer
    stands in for) runs the job, whose success (outcomes.succeeded) goes to finishes.succeed;
    it ends as told: succeeded (Celery's repr of the return value) or failed after it."""

    track = True

    def __init__(self, deferred: DeferredClaim, tag: str, failure: Any = None) -> None:
        self.deferred, self.tag, self.failure = deferred, tag, failure
        self.__trace__ = self._trace

    def _trace(self, *args: Any) -> tuple[Any, Any, Any, Any]:
        assert finishes.succeed(self.deferred, 0.002, {"sent": 1}, 1, self.tag)
        return {"sent": 1}, self.failure, 0.002, "{'sent': 1}"


@pytest.fixture
def pool_process(monkeypatch) -> None:
    """This process as a prefork pool process: the main process's batch inherited, not its."""
    monkeypatch.setattr(finishes, "_finishes", {})
    monkeypatch.setattr(finishes, "_hand", {"on": False})
    monkeypatch.setattr(finishes, "_handing", [])
    monkeypatch.setattr(held_acks, "before_restore", [])


def test_a_pool_processs_success_goes_back_with_its_end_and_waits_in_the_main_process(
    writes, pool_process
):
    # given a prefork pool process handing its successes back, and a tracked task's run
    job_id, tag = str(uuid.uuid4()), str(uuid.uuid4())
    deferred = DeferredClaim(job_id, 0, str(uuid.uuid4()), datetime.now(UTC), 30.0)
    task = Traced(deferred, tag)
    finishes.hand_back({"job": task})

    # when it succeeds: nothing is written there, and its end carries the success
    _, failure, _, text = task.__trace__("id", (), {}, {})
    assert failure is None and writes.calls == []
    sent = pickle.loads(pickle.dumps(text))  # as billiard sends it to the main process
    assert sent == "{'sent': 1}" and isinstance(sent, finishes.HandedBack)

    # when the main process (which writes its successes together) receives it
    finishes._finishes["on"] = Finishes(2, 600, inline=False)
    shown = finishes.handed(sent, tag)

    # then Celery sees its repr, the success waits for the batch and holds its message's ack
    assert type(shown) is str and shown == "{'sent': 1}"
    assert [w.success.job_id for w in finishes._finishes["on"].waiting] == [job_id]
    assert finishes._finishes["on"].waiting[0].success.result == {"sent": 1}
    assert held_acks.park(tag) is True
    assert writes.calls == []


def test_a_run_that_fails_after_its_success_writes_the_success_in_the_pool_process(
    writes, pool_process, monkeypatch
):
    written: list[tuple[str, Any]] = []
    monkeypatch.setattr(
        DeferredClaim,
        "succeed",
        lambda self, seconds, result: written.append((self.job_id, result)),
    )
    job_id = str(uuid.uuid4())
    deferred = DeferredClaim(job_id, 0, str(uuid.uuid4()), datetime.now(UTC), 30.0)
    task = Traced(deferred, str(uuid.uuid4()), failure=RuntimeError("a task_success receiver"))
    finishes.hand_back({"job": task})

    _, failure, _, text = task.__trace__("id", (), {}, {})

    assert failure is not None and not isinstance(text, finishes.HandedBack)
    assert written == [(job_id, {"sent": 1})]


def test_a_solo_worker_hands_nothing_back(writes, pool_process):
    # given a -P solo worker's own batch (Celery's solo pool sends worker_process_init too)
    finishes.install(size=4, wait=600)
    job_id, tag = str(uuid.uuid4()), str(uuid.uuid4())
    deferred = DeferredClaim(job_id, 0, str(uuid.uuid4()), datetime.now(UTC), 30.0)
    task = Traced(deferred, tag)
    finishes.hand_back({"job": task})

    # when a job succeeds: its success waits in this process's batch, handed to nobody
    _, _, _, text = task.__trace__("id", (), {}, {})
    assert not isinstance(text, finishes.HandedBack)
    assert [w.success.job_id for w in finishes._finishes["on"].waiting] == [job_id]
