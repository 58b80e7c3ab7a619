"""Waiting rooms in Redis for jobs that need a slot: a concurrency slot of their key (at most N
running at once, cluster-wide) and/or a rate-limit token (the GCRA bucket of jobs.broker.ratelimit).

One mechanism for both. A job that finds no slot is *parked*: its message is kept in its gate's
waiting list (a sorted set, oldest first) and the worker acknowledges the delivery, so it holds
no pool process and spends no attempt. Parked jobs leave only when the granting side lets them:
a finishing job's release, a park, a start, or the relay's sweep call ``dispatch``, which hands
the oldest waiters the slots that are free (a concurrency slot, held for them) and the rate
tokens of the next ``horizon`` seconds (each granted its own slot time), and returns their
messages for re-publishing. So at most `limit` jobs per second reach the workers, however many
wait: re-sent jobs never stampede, and a tenant's backlog waits in its own list, not in the
queue in front of other tenants' jobs.

A concurrency slot is a member of ``backlot:conc:<name>`` (job id -> lease expiry, Redis'
clock), renewed with the job's lease (jobs.worker.lease), released when the job ends, lapsed
with the lease when the worker died (every script drops lapsed members before it counts). All
decisions are Lua scripts reading Redis' own clock, atomic across hosts."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis
from redis.commands.core import Script
from redis.exceptions import NoScriptError

from jobs.broker import gate_scripts
from jobs.broker.gate_counts import RATE_LIMITED
from jobs.broker.redis import redis_client, redis_text

logger = logging.getLogger(__name__)

PREFIX = "backlot:gate:"
CONC_PREFIX = "backlot:conc:"
RATE_PREFIX = (
    "backlot:rate:"  # jobs.broker.ratelimit.RateLimiter's buckets: one token stream per name
)
GATES = PREFIX + "waiting"  # gates that have parked jobs (the relay's sweep visits them)
QUEUES = PREFIX + "queues"  # queue -> parked jobs of that queue (the relay's lost-message check)
OWNER = PREFIX + "of"  # job id -> its gate, while it is parked or holds a slot
SEQUENCE = PREFIX + "seq"  # arrival order of parked jobs

# A granted rate token is its job's even when the job arrives late (a busy pool, a backlog in
# its queue): it is never forfeited, so the average holds. Bunching is what the bucket's last
# second of starts prevents: no start, on time or late, while it holds `limit` starts. A granted
# job may start this much before its token's time (its countdown is the worker's clock, the
# token Redis').
EARLY = 0.01
# Most waiters one dispatch call releases (bounds the script's run time in Redis).
DISPATCH_MAX = 200
# Parks per pipelined round at enqueue (as the broker's BULK_BATCH for messages).
WAIT_BATCH = 1000


@dataclass(frozen=True)
class Gate:
    """What a job waits for: a concurrency slot of `holders` (at most `limit` at once) and/or a
    token of the rate bucket `bucket` (one per `interval` seconds)."""

    name: str
    queue: str
    holders: str = ""  # concurrency key's slot set name ("" with no concurrency limit)
    limit: int = 0
    bucket: str = ""  # rate bucket name ("" with no rate limit)
    interval: float = 0.0
    lease: float = 30.0  # seconds a slot is held without renewal (the job's lease)

    def keys(self) -> list[str]:
        base = PREFIX + self.name
        return [
            base + ":wait",
            base + ":messages",
            base + ":grants",
            base + ":conf",
            CONC_PREFIX + (self.holders or "-"),
            RATE_PREFIX + (self.bucket or "-"),
        ]

    def starts_key(self) -> str:
        """The rate bucket's starts of the last second (job id -> when)."""
        return RATE_PREFIX + (self.bucket or "-") + ":starts"

    def waiters_key(self) -> str:
        """The set of gates whose parked jobs wait for a slot of this gate's holders."""
        return CONC_PREFIX + (self.holders or "-") + ":gates"


@dataclass(frozen=True)
class Admission:
    """The gate's answer to a delivery: "go" / "held" (run now), "early" (run after `wait`),
    "parked" (it waits in the gate), "waiting" (a duplicate of a parked job: drop it)."""

    verdict: str
    wait: float = 0.0
    waiting: int = 0  # jobs parked in the gate after this call

    @property
    def runs(self) -> bool:
        return self.verdict in ("go", "held")


@dataclass(frozen=True)
class Released:
    """A parked job the gate let go: re-publish `message` to run after `wait` seconds."""

    job_id: str
    message: str
    wait: float


def _admit_keys(gate: Gate) -> list[str]:
    """The keys of the ADMIT script (jobs.broker.gate_scripts), in its order."""
    return [
        *gate.keys(),
        GATES,
        QUEUES,
        OWNER,
        SEQUENCE,
        gate.waiters_key(),
        gate.starts_key(),
    ]


def _admit_args(
    gate: Gate, job_id: str, message: str, *, horizon: str, park_only: str
) -> list[Any]:
    """The arguments of the ADMIT script, in its order; `park_only` "1" parks the job whatever
    the slots (a job just accepted)."""
    return [
        job_id,
        gate.name,
        gate.limit,
        repr(gate.interval),
        repr(gate.lease),
        repr(EARLY),
        horizon,
        message,
        gate.queue,
        gate.holders,
        gate.bucket,
        park_only,
    ]


def _dispatch_keys(gate: Gate) -> list[str]:
    """The keys of the DISPATCH script, in its order."""
    return [*gate.keys(), GATES, QUEUES, OWNER, gate.waiters_key()]


def _dispatch_args(gate: Gate, horizon: float, most: int) -> list[Any]:
    """The arguments of the DISPATCH script, in its order."""
    return [
        gate.name,
        gate.limit,
        repr(gate.interval),
        repr(gate.lease),
        repr(horizon),
        most,
        gate.queue,
    ]


def _released(flat: list[Any]) -> list[Released]:
    """DISPATCH's answer: job, message, wait for each job it let go."""
    return [
        Released(redis_text(flat[i]), redis_text(flat[i + 1]), float(flat[i + 2]))
        for i in range(0, len(flat), 3)
    ]


def catch_up_cap(interval: float) -> int:
    """Most starts of a bucket in any second, as the scripts compute it: its rate, and up to
    10 % more, less two starts' room for timing jitter (one when that leaves no catching up), so
    time lost to a busy pool is caught up on: 42 at 40/s, 21 at 20/s, 10 at 10/s. (With 43 at
    40/s the scale test's busiest second held 45 starts: tens of ms between a run's pacing and
    its first line, on a loaded machine.)"""
    rate, over = int(1 / interval + 1e-9), int(1.1 / interval + 1e-9)
    return max(1, rate, min(over - 1, max(rate + 1, over - 2)))


def horizon_for(interval: float, max_reserve: float) -> float:
    """How far ahead dispatch grants rate tokens: a second's worth (or one token of a slower
    rate), capped by RATE_LIMIT_MAX_RESERVE; rarer tokens are granted by the relay's sweep."""
    return min(max_reserve, max(1.0, interval))


class Gates:
    """The waiting rooms and slot sets in one Redis."""

    def __init__(self, client: redis.Redis | None = None) -> None:
        self.client = client or redis_client()
        self._admit = self.client.register_script(gate_scripts.ADMIT)
        self._dispatch = self.client.register_script(gate_scripts.DISPATCH)
        self._forget = self.client.register_script(gate_scripts.FORGET)
        self._pace = self.client.register_script(gate_scripts.PACE)
        self._waiting = self.client.register_script(gate_scripts.WAITING)

    def admit(self, gate: Gate, job_id: str, message: str, *, horizon: float) -> Admission:
        """Let a delivered job through its gate, or park it (its `message` kept for later)."""
        verdict, wait, waiting = self._admit(
            keys=_admit_keys(gate),
            args=_admit_args(gate, job_id, message, horizon=repr(horizon), park_only="0"),
        )
        return Admission(redis_text(verdict), float(wait), int(waiting))

    def wait(self, jobs: list[tuple[Gate, str, str]]) -> None:
        """Park (gate, job id, message) triples in arrival order, whatever the slots (jobs
        just accepted: dispatch then lets the oldest through), pipelined."""
        self.park(jobs)

    def park(
        self,
        jobs: list[tuple[Gate, str, str]],
        *,
        dispatch: Sequence[tuple[Gate, float]] = (),
        counter: tuple[str, str] | None = None,
        rate_waits: str | None = None,
    ) -> list[list[Released]]:
        """wait(jobs), then add their number to `counter` (a per-task counter: name, task) and
        dispatch each (gate, horizon) of `dispatch`, in that order, each script atomic as
        alone: the counter and the dispatches ride in the round trip of the last batch of
        parks. With `rate_waits` (a task), the jobs parked at rate gates that still wait after
        the dispatches are counted under it in RATE_LIMITED, in that round trip too. What each
        dispatch released, in the order of `dispatch`.

        One enqueue of a limited job paid five round trips here (SCRIPT EXISTS, which
        redis-py's pipeline sends before every EVALSHA it carries, the park, the counter, the
        dispatch): now one. The scripts go as EVALSHA and are loaded only when Redis answers
        NOSCRIPT (it restarted or flushed them), then those calls are sent again, in order."""
        batches = [jobs[start : start + WAIT_BATCH] for start in range(0, len(jobs), WAIT_BATCH)]
        answers: list[Any] = []
        first_dispatch = 0
        for index, batch in enumerate(batches or [[]]):
            calls: list[tuple[Script, list[str], list[Any]]] = [
                (
                    self._admit,
                    _admit_keys(gate),
                    _admit_args(gate, job_id, message, horizon="0", park_only="1"),
                )
                for gate, job_id, message in batch
            ]
            last = index == max(0, len(batches) - 1)
            first_dispatch = len(calls)
            if last:
                calls += [
                    (
                        self._dispatch,
                        _dispatch_keys(gate),
                        _dispatch_args(gate, horizon, DISPATCH_MAX),
                    )
                    for gate, horizon in dispatch
                ]
                if rate_waits is not None:
                    calls += self._waiting_call(jobs, rate_waits)
            tally = (counter[0], counter[1], len(jobs)) if last and counter and jobs else None
            answers = self._evalsha_pipeline(calls, tally)
        released = answers[first_dispatch : first_dispatch + len(dispatch)]
        return [_released(flat) for flat in released]

    def _waiting_call(
        self, jobs: list[tuple[Gate, str, str]], task: str
    ) -> list[tuple[Script, list[str], list[Any]]]:
        """The WAITING script's call for the jobs parked at rate gates (none without any)."""
        by_gate: dict[str, list[str]] = {}
        for gate, job_id, _ in jobs:
            if gate.interval:
                by_gate.setdefault(gate.keys()[0], []).append(job_id)
        if not by_gate:
            return []
        args: list[Any] = [task]
        for ids in by_gate.values():
            args += [len(ids), *ids]
        return [(self._waiting, [RATE_LIMITED, *by_gate], args)]

    def _evalsha_pipeline(
        self, calls: list[tuple[Script, list[str], list[Any]]], tally: tuple[str, str, int] | None
    ) -> list[Any]:
        """Run `calls` (script, keys, args) in one pipeline, then HINCRBY `tally`; the scripts'
        answers. Raises the first error other than a script Redis no longer has."""
        if not calls and tally is None:
            return []
        pipe = self.client.pipeline(transaction=False)
        for script, keys, args in calls:
            pipe.evalsha(script.sha, len(keys), *keys, *args)
        if tally is not None:
            pipe.hincrby(tally[0], tally[1], tally[2])
        replies = pipe.execute(raise_on_error=False)[: len(calls)]
        lost = [i for i, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
        if lost:
            again = self.client.pipeline(transaction=False)
            for script in {id(calls[i][0]): calls[i][0] for i in lost}.values():
                again.script_load(script.script)
            for i in lost:
                script, keys, args = calls[i]
                again.evalsha(script.sha, len(keys), *keys, *args)
            for i, reply in zip(
                lost, again.execute(raise_on_error=False)[-len(lost) :], strict=True
            ):
                replies[i] = reply
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        return replies

    def dispatch(self, gate: Gate, *, horizon: float, most: int = DISPATCH_MAX) -> list[Released]:
        """Release the oldest waiters into the slots free now (and rate tokens within
        `horizon` s); the caller re-publishes what is returned."""
        return _released(
            self._dispatch(keys=_dispatch_keys(gate), args=_dispatch_args(gate, horizon, most))
        )

    def release(self, gate: Gate, job_id: str) -> bool:
        """The job ended (or will not run): free its slot, or take it out of the line."""
        keys = gate.keys()
        return bool(
            self._forget(
                keys=[keys[0], keys[1], keys[2], keys[4], QUEUES, OWNER], args=[job_id, gate.queue]
            )
        )

    def pace(self, gate: Gate, job_id: str) -> float:
        """0 once a rate-limited run may begin (recorded), else the seconds until it may: at
        most catch_up_cap(interval) runs begin in any second."""
        if not gate.interval:
            return 0.0
        most = catch_up_cap(gate.interval)
        wait = self._pace(
            keys=[RATE_PREFIX + gate.bucket + ":runs"],
            # no spacing here (the admission spaces late ones): a pool process waits only
            # while the last second is full
            args=[job_id, most, "0"],
        )
        return float(wait)

    def renew(self, gate: Gate, job_id: str) -> None:
        """Extend the slot of a running job by its lease (only while it still holds it)."""
        if not gate.limit:
            return
        seconds, micros = self.client.time()
        self.client.zadd(
            CONC_PREFIX + gate.holders,
            {job_id: seconds + micros / 1e6 + gate.lease},
            xx=True,
        )

    def sharing(self, gate: Gate) -> list[Gate]:
        """The gates with jobs waiting for a slot of `gate`'s holders (itself included)."""
        if not gate.limit:
            return [gate]
        names = {redis_text(name) for name in self.client.smembers(gate.waiters_key())}
        others = [self.stored(name) for name in sorted(names - {gate.name})]
        return [gate, *(other for other in others if other is not None)]

    def gate_of(self, job_id: str) -> Gate | None:
        """The gate a job is parked in or holds a slot of, as its last park recorded it."""
        name = self.client.hget(OWNER, job_id)
        return None if name is None else self.stored(redis_text(name))

    def stored(self, name: str) -> Gate | None:
        """A gate as its parks recorded it (limits, queue), for the sweep and for cancels."""
        conf = {
            redis_text(k): redis_text(v)
            for k, v in self.client.hgetall(PREFIX + name + ":conf").items()
        }
        if not conf:
            return None
        return Gate(
            name=name,
            queue=conf["queue"],
            holders=conf.get("holders", ""),
            limit=int(conf.get("limit", 0)),
            bucket=conf.get("bucket", ""),
            interval=float(conf.get("interval", 0)),
            lease=float(conf.get("lease", 30)),
        )

    def waiting_gates(self) -> list[str]:
        return sorted(redis_text(name) for name in self.client.smembers(GATES))

    def waiting_queues(self) -> set[str]:
        """Queues that have parked jobs: their jobs wait here, not in the broker's lists."""
        return {
            redis_text(queue)
            for queue, count in self.client.hgetall(QUEUES).items()
            if int(count) > 0
        }

    def waiting(self, gate: Gate) -> int:
        return int(self.client.zcard(gate.keys()[0]))

    def holding(self, gate: Gate) -> list[str]:
        """Jobs holding a slot of the gate's concurrency key now (lapsed ones left out)."""
        seconds, micros = self.client.time()
        members: list[bytes] = self.client.zrangebyscore(  # type: ignore[assignment]
            CONC_PREFIX + gate.holders, seconds + micros / 1e6, "+inf"
        )
        return [redis_text(member) for member in members]
