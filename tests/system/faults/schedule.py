"""The randomized fault schedule and its checker (tests/system/faults/test_fault_schedule.py).

Everything here is pure: one seed gives one plan, the faults and the API calls at their offsets
(two random streams drawn from the seed, so a change to the load never moves a fault), and
`check` turns what the ledger says after the settle into a list of violations. The test that
drives the processes and the checker that judges them stay apart, as in Jepsen: the plan says
what happens when, the history (the API's answers, the ledger, the effects) says what it did.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

# Fault kinds, with their weight in the draw. A process killed or stopped is started again by
# the test's supervisor; a frozen Redis is thawed after `seconds`.
FAULT_WEIGHTS: dict[str, int] = {
    "kill_worker": 3,  # kill -9 of a worker's main process and its pool (a lost host)
    "kill_pool": 3,  # kill -9 of one pool process (an OOM kill, a segfault in a C call)
    "term_worker": 2,  # SIGTERM of a worker (a deploy): soft shutdown, then a new one
    "kill_relay": 2,  # kill -9 of `manage.py jobs relay`
    "kill_beat": 1,  # kill -9 of celery beat
    "redis_restart": 2,  # SIGTERM of redis-server (AOF everysec), started again at once
    "redis_freeze": 2,  # SIGSTOP of redis-server for a few seconds, then SIGCONT
    "redis_flush": 1,  # FLUSHALL: every message, reservation, lock and counter Redis held
    "redis_drop": 2,  # CLIENT KILL TYPE normal: every client connection dropped
    "pg_restart": 1,  # pg_ctl stop -m fast, start: every database session ends
    "pg_drop": 2,  # pg_terminate_backend of every session of the platform's database
    "redis_outage": 1,  # redis-server stopped for `seconds`, then started (the AOF reloaded)
    "pg_outage": 1,  # PostgreSQL stopped for `seconds`: longer than 80 % of a lease, at times
}
OUTAGE_SECONDS = {"redis_freeze": (2.0, 8.0), "redis_outage": (4.0, 15.0), "pg_outage": (4.0, 20.0)}
# The load's kinds (the test-only API of schedule_app.py), with their weight in the draw.
LOAD_WEIGHTS: dict[str, int] = {
    "effect": 10,  # a short job with an effect
    "flaky": 5,  # fails transiently (some after their effect, some every attempt: dead letters)
    "delayed": 3,  # a short job with a countdown (the ledger holds it until due)
    "long": 1,  # a 6 s job reporting progress
    "batch": 1,  # a batch of short and flaky members with an on_complete callback
}
FIRST_FAULT_AT = 6.0  # seconds: the load is flowing before anything breaks
QUIET_TAIL = 6.0  # no fault in the schedule's last seconds (the heal comes right after)
FAULT_GAP = (3.0, 10.0)  # seconds between two faults
CALL_GAP = (0.15, 0.6)  # seconds between two API calls


@dataclass(frozen=True)
class Fault:
    at: float  # seconds from the schedule's start
    kind: str
    target: int  # which worker (0 or 1); unused by the kinds that have one target
    seconds: float = 0.0  # how long a freeze or an outage lasts

    def __str__(self) -> str:
        extra = f" for {self.seconds:.1f} s" if self.seconds else ""
        return f"{self.at:6.1f} s  {self.kind}[{self.target}]{extra}"


@dataclass(frozen=True)
class Call:
    at: float
    kind: str
    item: int  # the call's first effect item; a batch's members use the next ones, then its
    # callback the one after them
    members: int = 0
    delay: float = 0.0


@dataclass(frozen=True)
class Plan:
    seed: int
    seconds: float
    faults: tuple[Fault, ...]
    calls: tuple[Call, ...]


def plan(seed: int, seconds: float, workers: int = 2) -> Plan:
    """The faults and API calls of one run: the same seed and budget give the same plan."""
    fault_rng = random.Random(f"faults:{seed}")
    load_rng = random.Random(f"load:{seed}")
    faults: list[Fault] = []
    at = FIRST_FAULT_AT
    kinds, weights = list(FAULT_WEIGHTS), list(FAULT_WEIGHTS.values())
    while at < seconds - QUIET_TAIL:
        kind = fault_rng.choices(kinds, weights)[0]
        target = fault_rng.randrange(workers)
        lasts = (
            round(fault_rng.uniform(*OUTAGE_SECONDS[kind]), 1) if kind in OUTAGE_SECONDS else 0.0
        )
        faults.append(Fault(round(at, 2), kind, target, lasts))
        at += fault_rng.uniform(*FAULT_GAP) + lasts
    calls: list[Call] = []
    at, item = 0.5, 0
    kinds, weights = list(LOAD_WEIGHTS), list(LOAD_WEIGHTS.values())
    while at < seconds:
        kind = load_rng.choices(kinds, weights)[0]
        members = load_rng.randint(4, 10) if kind == "batch" else 0
        delay = round(load_rng.uniform(1.0, 15.0), 1) if kind == "delayed" else 0.0
        calls.append(Call(round(at, 2), kind, item, members, delay))
        item += members + 1 if kind == "batch" else 1
        at += load_rng.uniform(*CALL_GAP)
    return Plan(seed, seconds, tuple(faults), tuple(calls))


# --- the checker ------------------------------------------------------------------------------

ENDED = {"succeeded", "dead"}
WAITING = {"queued", "scheduled", "retrying", "running"}


@dataclass
class History:
    """What the run produced, read back after the settle."""

    accepted: dict[str, str]  # job id -> kind, for every API call answered 2xx
    batches: dict[str, list[str]]  # batch id -> its members' job ids, as the API answered
    states: dict[str, str]  # job id -> state, of every job in the ledger
    items: dict[str, int]  # job id -> its effect item
    effects: Counter  # item -> how many times its effect was applied
    batch_rows: dict[str, dict[str, Any]]  # batch id -> counters and state of its row
    callbacks: Counter  # batch id -> how many times its on_complete callback applied its effect
    dead_letters: Counter  # job id -> dead letters written for it
    progress: dict[str, tuple[int, int]] = field(default_factory=dict)  # long jobs: done, total
    api_states: dict[str, str] = field(default_factory=dict)  # job id -> state the API shows


@dataclass
class Verdict:
    violations: list[str] = field(default_factory=list)
    outcomes: Counter = field(default_factory=Counter)

    def fail(self, what: str, examples: list[Any]) -> None:
        if examples:
            self.violations.append(f"{what}: {len(examples)} (e.g. {examples[:5]})")


def check(history: History) -> Verdict:
    """Every accepted job ended succeeded or dead; each succeeded job's effect applied exactly
    once, and no effect twice; nothing waits or runs any more; a dead job has its dead letter,
    one; each batch's counters match its members' states in the ledger, and its on_complete
    callback applied its effect once."""
    verdict = Verdict()
    found = [job_id for job_id in history.accepted if job_id in history.states]
    missing = sorted(set(history.accepted) - set(found))
    verdict.fail("accepted jobs missing from the ledger", missing)
    for job_id in found:
        verdict.outcomes[history.states[job_id]] += 1
    verdict.fail(
        "accepted jobs that did not end succeeded or dead",
        [(j, history.states[j]) for j in found if history.states[j] not in ENDED],
    )
    verdict.fail(
        "jobs still waiting or running after the settle (any job in the ledger)",
        [(j, s) for j, s in history.states.items() if s in WAITING],
    )
    verdict.fail(
        "effects applied more than once",
        [(item, n) for item, n in history.effects.items() if n > 1],
    )
    verdict.fail(
        "succeeded jobs whose effect is missing",
        [
            j
            for j in found
            if history.states[j] == "succeeded" and not history.effects[history.items[j]]
        ],
    )
    verdict.fail(
        "dead jobs without exactly one dead letter",
        [
            (j, history.dead_letters[j])
            for j in found
            if history.states[j] == "dead" and history.dead_letters[j] != 1
        ],
    )
    verdict.fail(
        "succeeded long jobs whose progress is not complete (done, total)",
        [
            (j, p)
            for j, p in history.progress.items()
            if history.states.get(j) == "succeeded" and (p[0] != p[1] or not p[1])
        ],
    )
    verdict.fail(
        "jobs whose state in the API differs from the ledger (API, ledger)",
        [
            (j, shown, history.states.get(j))
            for j, shown in history.api_states.items()
            if shown != history.states.get(j)
        ],
    )
    for batch_id, members in history.batches.items():
        row = history.batch_rows.get(batch_id)
        if row is None:
            verdict.fail("accepted batches missing from the ledger", [batch_id])
            continue
        ledger = Counter(history.states.get(j, "missing") for j in members)
        expected = {
            "total": len(members),
            "pending": sum(ledger[s] for s in WAITING | {"missing"}),
            "succeeded": ledger["succeeded"],
            "dead": ledger["dead"],
            "cancelled": ledger["cancelled"],
        }
        drift = {k: (row[k], v) for k, v in expected.items() if row[k] != v}
        verdict.fail(f"batch {batch_id} counters (row, ledger) disagree", list(drift.items()))
        if row["state"] not in {"complete", "succeeded"}:
            verdict.fail("batches not complete after the settle", [(batch_id, row["state"])])
        if history.callbacks[batch_id] != 1:
            verdict.fail(
                "batch on_complete callbacks not applied exactly once",
                [(batch_id, history.callbacks[batch_id])],
            )
        verdict.outcomes[f"batch {row['state']}"] += 1
    return verdict
