"""The randomized fault schedule (issue 17, item 7): a mixed load through the real API while
faults drawn at random hit the platform; then everything is healed, the platform settles, and
the checker (tests/system/faults/schedule.py) judges what the ledger and the effects say.

The platform: a private PostgreSQL cluster (the ledger, the effects) and a private Redis (the
broker), both restarted by the faults; a web process (runserver, bearer-token auth) taking the
load; two workers on the default queue, a prefork one (-c 2, prefetch 4) and one as the Procfile
ships it (-P solo: its jobs run in its own process and, with DEFER_CLAIM on by default, a short
job writes its row once); the relay; beat. A process that dies
is started again by the test, as a supervisor would (the same node name, after a second).
Run counters sit in a third Redis of their own that no fault touches.

`FAULTS_SEED` replays a run: the same faults at the same offsets, the same API calls;
`FAULTS_SCHEDULE_SECONDS` sets the schedule's length (default 100 s; the whole test then takes
about 3-4 minutes on 2 loaded cores).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import pytest
import redis
import requests

from jobs.broker.reservations import DROPPED, RESTORED
from jobs.flow.relay import LEASE_LAPSES, MISSING_RESENT
from tests.conftest import ROOT, wait_until
from tests.system.faults.conftest import PrivatePostgres, PrivateRedis, figures, free_port
from tests.system.faults.lost import Process, procfile_command
from tests.system.faults.schedule import ENDED, WAITING, Call, Fault, History, Plan, check, plan

SCHEDULE_SECONDS = float(os.environ.get("FAULTS_SCHEDULE_SECONDS") or 100)
SETTLE_SECONDS = 90.0  # the bound on the settle; measured settles are reported
RESTART_AFTER = 1.0  # seconds a dead process stays down before the supervisor starts it again
WORKERS = 2
MODULES = "tests.support.tasks,tests.system.faults.jobs,tests.system.faults.schedule_app"
LEASE_SECONDS = 15  # a third of the shipped 30 s: the lapses of killed workers, not their length
COUNTERS = (MISSING_RESENT, LEASE_LAPSES, RESTORED, DROPPED)
BATCH_COLUMNS = ("total", "pending", "succeeded", "dead", "cancelled", "state")


class Supervised:
    """A platform process the test keeps running: started again after it dies."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        self.name, self.argv, self.env = name, argv, env
        self.restarts = 0
        self.down_since: float | None = None
        self.proc = Process(name, argv, env)

    @property
    def pid(self) -> int:
        return self.proc.process.pid

    def alive(self) -> bool:
        return self.proc.process.poll() is None

    def supervise(self, now: float) -> None:
        if self.alive():
            return
        if self.down_since is None:
            self.down_since = now
        elif now - self.down_since >= RESTART_AFTER:
            self.proc.process.wait()
            self.proc = Process(self.name, self.argv, self.env)
            self.restarts += 1
            self.down_since = None

    def pool(self) -> list[int]:
        """The pids of the worker's pool processes (the main process's children)."""
        try:
            raw = Path(f"/proc/{self.pid}/task/{self.pid}/children").read_text()
        except OSError:
            return []
        return sorted(int(pid) for pid in raw.split())

    def stop(self) -> None:
        self.proc.stop()


class Platform:
    """The processes and servers of one run, and the faults that hit them."""

    def __init__(self, env: dict[str, str], redis_server: PrivateRedis, pg: PrivatePostgres):
        self.env, self.redis, self.pg = env, redis_server, pg
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.processes: list[Supervised] = []
        self.workers: list[Supervised] = []
        self.thaw_at: float | None = None
        self.redis_back_at: float | None = None
        self.pg_back_at: float | None = None
        self.counted: Counter = Counter()  # platform counters read before a flush wiped them
        self.applied: list[tuple[float, str]] = []

    def start(self) -> None:
        web_env = {**self.env, "DJANGO_SETTINGS_MODULE": "tests.system.faults.schedule_settings"}
        web = [sys.executable, "manage.py", "runserver", "--noreload", f"127.0.0.1:{self.port}"]
        self.processes.append(Supervised("sched-web", web, web_env))
        relay_argv = [sys.executable, "-m", "tests.system.faults.schedule_app", "relay", "{}"]
        self.processes.append(Supervised("sched-relay", relay_argv, self.env))
        beat = procfile_command("beat", self.env)
        self.processes.append(Supervised("sched-beat", beat, self.env))
        tag = uuid.uuid4().hex[:6]
        for n in range(WORKERS):
            pool = ["-c", "2"] if n == 0 else ["-P", "solo"]  # the mixed fleet of a deploy
            argv = [
                sys.executable, "-m", "celery", "-A", "config", "worker", "-Q", "default",
                *pool, "--prefetch-multiplier", "4", "-n", f"sched{n}-{tag}@localhost",
                "-I", MODULES, "--without-gossip", "--without-mingle", "--without-heartbeat",
                "-l", "INFO",
            ]  # fmt: skip
            self.workers.append(Supervised(f"sched-worker{n}", argv, self.env))
        self.processes += self.workers

        def web_up() -> bool:
            assert self.processes[0].alive(), self.processes[0].proc.log_path.read_text()[-3000:]
            try:
                return requests.get(f"{self.base}/api/openapi.json", timeout=2).ok
            except requests.RequestException:
                return False

        wait_until(web_up, timeout=90, interval=0.25, what="the web process")

    def supervise(self) -> None:
        now = time.monotonic()
        if self.thaw_at is not None and now >= self.thaw_at:
            self.redis.thaw()
            self.thaw_at = None
        if self.redis_back_at is not None and now >= self.redis_back_at:
            self.redis.start()
            self.redis_back_at = None
        if self.pg_back_at is not None and now >= self.pg_back_at:
            self.pg.start()
            self.pg_back_at = None
        for process in self.processes:
            process.supervise(now)

    def read_counters(self) -> Counter:
        try:
            values = self.redis.client.mget(COUNTERS)
        except redis.RedisError:
            return Counter()
        return Counter({k: int(v or 0) for k, v in zip(COUNTERS, values, strict=True)})

    def apply(self, fault: Fault) -> str:
        """Inflict one fault; returns what was done (a kill of nothing is said so)."""
        kind, worker = fault.kind, self.workers[fault.target]
        if kind == "kill_worker":
            worker.proc.kill()
        elif kind == "kill_pool":
            if "solo" in worker.argv:  # the job's process is the worker's own
                worker.proc.kill()
                return "kill -9 of the solo worker (its jobs run in its own process)"
            pool = worker.pool()
            if not pool:
                return "no pool process (the worker is starting)"
            os.kill(pool[0], signal.SIGKILL)
        elif kind == "term_worker":
            if not worker.alive():
                return "worker already down"
            os.kill(worker.pid, signal.SIGTERM)
        elif kind == "kill_relay":
            self.processes[1].proc.kill()
        elif kind == "kill_beat":
            self.processes[2].proc.kill()
        elif kind == "redis_restart":
            self.redis.restart()  # SIGTERM: the AOF keeps what Redis held
        elif kind == "redis_freeze":
            self.redis.freeze()
            self.thaw_at = time.monotonic() + fault.seconds
        elif kind == "redis_flush":
            self.counted += self.read_counters()
            self.redis.client.flushall()
        elif kind == "redis_drop":
            killed = self.redis.client.client_kill_filter(_type="normal", skipme=True)
            return f"{killed} connections dropped"
        elif kind == "redis_outage":
            self.redis.stop()  # SIGTERM: the AOF keeps what Redis held, counters too
            self.redis_back_at = time.monotonic() + fault.seconds
        elif kind == "pg_outage":
            self.pg.stop()
            self.pg_back_at = time.monotonic() + fault.seconds
        elif kind == "pg_restart":
            return f"down {self.pg.restart():.1f} s"
        elif kind == "pg_drop":
            [(killed,)] = self.pg.query(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
                " WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
            return f"{killed} sessions terminated"
        else:
            raise ValueError(kind)
        return "done"

    def heal(self) -> None:
        """Thaw Redis, start whatever is down, and wait until every process runs again."""
        if self.thaw_at is not None:
            self.redis.thaw()
            self.thaw_at = None
        if self.redis.process is None or self.redis.process.poll() is not None:
            self.redis.start()
        self.redis_back_at = None
        if self.pg_back_at is not None:
            self.pg.start()
            self.pg_back_at = None
        wait_until(self.redis.answers, timeout=30, interval=0.2, what="Redis after the heal")
        wait_until(lambda: bool(self.pg.query("SELECT 1")), timeout=60, what="PostgreSQL")

        def all_up() -> bool:
            self.supervise()
            return all(process.alive() for process in self.processes)

        wait_until(all_up, timeout=30, interval=0.2, what="every process running again")

    def stop(self) -> None:
        """SIGTERM to every process group at once, kill -9 of what is left after 15 s."""
        if self.thaw_at is not None:
            self.redis.thaw()
        running = [p.proc.process for p in self.processes if p.alive()]
        for process in running:
            os.killpg(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + 15
        for process in running:
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=10)


class Load(threading.Thread):
    """The plan's API calls at their offsets, one at a time, through the web process."""

    def __init__(self, platform: Platform, the_plan: Plan, run: str, token: str) -> None:
        super().__init__(name="fault-schedule-load", daemon=True)
        self.platform, self.plan, self.run_id = platform, the_plan, run
        self.auth = {"Authorization": f"Bearer {token}"}
        self.accepted: dict[str, str] = {}  # job id -> kind
        self.batches: dict[str, list[str]] = {}
        self.callback_items: dict[str, int] = {}
        self.refused: Counter = Counter()  # status (or exception class) -> calls
        self.began = 0.0
        self.halt = threading.Event()  # set when the test ends early: no call after it

    def post(self, call: Call) -> None:
        try:
            answer = requests.post(
                f"{self.platform.base}/faults-schedule/enqueue/",
                json={"run": self.run_id, "seed": self.plan.seed, "call": asdict(call)},
                headers=self.auth,
                timeout=30,
            )
        except requests.RequestException as exc:
            self.refused[type(exc).__name__] += 1  # no answer: not accepted, not checked
            return
        if not 200 <= answer.status_code < 300:
            self.refused[str(answer.status_code)] += 1
            return
        body = answer.json()
        for job_id in body["job_ids"]:
            self.accepted[job_id] = call.kind
        if "batch_id" in body:
            self.batches[body["batch_id"]] = list(body["job_ids"])
            self.callback_items[body["batch_id"]] = body["callback_item"]

    def run(self) -> None:
        for call in self.plan.calls:
            if self.halt.wait(max(0.0, self.began + call.at - time.monotonic())):
                return  # the test ended early
            self.post(call)


def ledger_history(pg: PrivatePostgres, run: str, load: Load) -> History:
    rows = pg.query(
        "SELECT id::text, state, (kwargs->>'item')::int FROM jobs_job"
        " WHERE task_name LIKE 'faults.%%'"
    )
    effects = Counter(
        dict(pg.query("SELECT item, count(*) FROM faults_applied WHERE run = %s GROUP BY 1", run))
    )
    letters = Counter(
        dict(pg.query("SELECT job_id_value::text, count(*) FROM jobs_deadletter GROUP BY 1"))
    )
    batch_rows = {
        row[0]: dict(zip(BATCH_COLUMNS, row[1:], strict=True))
        for row in pg.query(
            "SELECT id::text, total, pending, succeeded, dead, cancelled, state FROM jobs_batch"
        )
    }
    long_jobs = [j for j, kind in load.accepted.items() if kind == "long"]
    progress = {
        job_id: (done, total)
        for job_id, done, total in pg.query(
            "SELECT id::text, progress_done, coalesce(progress_total, 0) FROM jobs_job"
            " WHERE id = ANY(%s::uuid[])",
            long_jobs,
        )
    }
    return History(
        progress=progress,
        api_states=api_states(load),
        accepted=load.accepted,
        batches=load.batches,
        states={job_id: state for job_id, state, _ in rows},
        items={job_id: item for job_id, _, item in rows if item is not None},
        effects=effects,
        batch_rows=batch_rows,
        callbacks=Counter({b: effects[item] for b, item in load.callback_items.items()}),
        dead_letters=letters,
    )


def api_states(load: Load, sample: int = 30) -> dict[str, str]:
    """The state a user sees (GET /api/jobs/{id}/ with the token) of a sample of the jobs."""
    ids = sorted(load.accepted)
    picked = random.Random(load.plan.seed).sample(ids, min(sample, len(ids)))
    found = {}
    for job_id in picked:
        answer = requests.get(
            f"{load.platform.base}/api/jobs/{job_id}/", headers=load.auth, timeout=30
        )
        found[job_id] = answer.json()["state"] if answer.ok else f"HTTP {answer.status_code}"
    return found


def settled(pg: PrivatePostgres, load: Load) -> bool:
    """Every accepted job ended, every batch complete, no job of the schedule waiting."""
    waiting = pg.query(
        "SELECT count(*) FROM jobs_job WHERE task_name LIKE 'faults.%%' AND state = ANY(%s)",
        list(WAITING),
    )[0][0]
    if waiting:
        return False
    ended = pg.query(
        "SELECT count(*) FROM jobs_job WHERE id = ANY(%s::uuid[]) AND state = ANY(%s)",
        list(load.accepted),
        list(ENDED),
    )[0][0]
    open_batches = pg.query(
        "SELECT count(*) FROM jobs_batch WHERE state = 'running' AND id = ANY(%s::uuid[])",
        list(load.batches),
    )[0][0]
    return bool(ended == len(load.accepted) and not open_batches)


@pytest.fixture
def counter_redis(tmp_path: Path) -> Iterator[PrivateRedis]:
    """Where the jobs count their runs: a Redis no fault touches."""
    server = PrivateRedis(tmp_path / "counter-redis")
    server.start()
    yield server
    server.stop(signal.SIGKILL)


def issue_token(env: dict[str, str]) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "tests.system.faults.schedule_app", "token",
         json.dumps({"username": f"sched-{uuid.uuid4().hex[:6]}"})],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return str(json.loads(done.stdout.strip().splitlines()[-1])["token"])


def run_schedule(
    seed: int,
    seconds: float,
    fault_env: dict[str, str],
    private_redis: PrivateRedis,
    private_postgres: PrivatePostgres,
    counter_redis: PrivateRedis,
    run_id: str,
) -> None:
    the_plan = plan(seed, seconds, WORKERS)
    print(
        f"\nfault schedule: FAULTS_SEED={seed} FAULTS_SCHEDULE_SECONDS={seconds:g} "
        f"({len(the_plan.faults)} faults, {len(the_plan.calls)} API calls)",
        flush=True,
    )
    for fault in the_plan.faults:
        print(f"  {fault}", flush=True)
    env = {
        **fault_env,
        "DATABASE_URL": private_postgres.url,
        "FAULTS_COUNTER_URL": counter_redis.url,
        # the shipped broker timings: nothing may wait for the 2 h visibility timeout
        "CELERY_VISIBILITY_TIMEOUT": "7200",
        "BACKLOT_MAX_BROKER_COUNTDOWN": "900",
        "BACKLOT_RATE_LIMIT_MAX_RESERVE": "30",
        "BACKLOT_LEASE_SECONDS": str(LEASE_SECONDS),
    }
    platform = Platform(env, private_redis, private_postgres)
    load: Load | None = None
    began = time.monotonic()
    try:
        token = issue_token(env)
        platform.start()
        load = Load(platform, the_plan, run_id, token)
        load.began = time.monotonic()
        load.start()
        started = time.monotonic() - began

        # when: the faults at their offsets; the supervisor restarts what died
        for fault in the_plan.faults:
            while time.monotonic() < load.began + fault.at:
                platform.supervise()
                time.sleep(0.1)  # the supervisor's tick
            outcome = platform.apply(fault)
            platform.applied.append((time.monotonic() - load.began, f"{fault.kind}: {outcome}"))
            print(f"  {platform.applied[-1][0]:6.1f} s  {fault.kind} -> {outcome}", flush=True)
        while load.is_alive():
            platform.supervise()
            load.join(timeout=0.1)
        schedule_end = time.monotonic()
        platform.heal()

        # then: the platform settles within the bound
        try:

            def settling() -> bool:
                # a worker still in its SIGTERM shutdown exits during the settle: the
                # supervisor goes on starting what dies
                platform.supervise()
                return settled(private_postgres, load)

            wait_until(
                settling,
                timeout=SETTLE_SECONDS,
                interval=1.0,
                what="the platform to settle",
            )
            settle: float | None = time.monotonic() - schedule_end
        except AssertionError:
            settle = None
        history = ledger_history(private_postgres, run_id, load)
        verdict = check(history)
        counters = platform.counted + platform.read_counters()
        [(deliveries, delivered)] = private_postgres.query(
            "SELECT coalesce(sum(deliveries), 0), count(*) FILTER (WHERE deliveries > 0)"
            " FROM jobs_job WHERE task_name LIKE 'faults.%%'"
        )
        starts = sum(int(v) for v in counter_redis.client.hvals(f"faults:{run_id}:runs"))
        letters = dict(
            private_postgres.query(
                "SELECT exception_class, count(*) FROM jobs_deadletter GROUP BY 1 ORDER BY 2 DESC"
            )
        )
        restarts = {p.name: p.restarts for p in platform.processes if p.restarts}
        settled_in = f"NOT within {SETTLE_SECONDS:g} s" if settle is None else f"{settle:.1f} s"
        figures(
            f"fault schedule seed {seed}, {seconds:g} s: {len(the_plan.faults)} faults "
            f"({dict(Counter(f.kind for f in the_plan.faults))}), {len(the_plan.calls)} API calls "
            f"({sum(load.refused.values())} refused {dict(load.refused)}), {len(load.accepted)} "
            f"jobs accepted in {len(load.batches)} batches and alone; outcomes "
            f"{dict(verdict.outcomes)}, dead letters {letters}; settled "
            f"{settled_in} after the schedule; {deliveries - delivered} extra deliveries, "
            f"{starts} job bodies started, {counters[MISSING_RESENT]} lost messages re-sent by "
            f"the relay, {counters[LEASE_LAPSES]} lapsed leases re-queued, "
            f"{counters[RESTORED]} reserved messages restored, "
            f"{counters[DROPPED]} dropped; "
            f"restarts {restarts}; platform up in {started:.1f} s, "
            f"{time.monotonic() - began:.0f} s in all"
        )
        assert verdict.violations == [], (
            f"FAULTS_SEED={seed} FAULTS_SCHEDULE_SECONDS={seconds:g}: "
            + "; ".join(verdict.violations)
            + f"; faults applied: {platform.applied}"
        )
        assert settle is not None, f"FAULTS_SEED={seed}: not settled within {SETTLE_SECONDS} s"
        # PostgreSQL outages refuse calls (500s, 62 of 260 with two in 100 s); far more than
        # that means the web process itself was broken, and the run checked too little
        assert len(load.accepted) > len(the_plan.calls) // 4, f"API calls refused: {load.refused}"
    finally:
        if load is not None:
            load.halt.set()
            load.join(timeout=40)
        platform.stop()


@pytest.mark.timeout(int(SCHEDULE_SECONDS + SETTLE_SECONDS + 110))
def test_a_random_fault_schedule_loses_nothing_and_runs_no_effect_twice(
    transactional_db: None,
    fault_env: dict[str, str],
    private_redis: PrivateRedis,
    private_postgres: PrivatePostgres,
    counter_redis: PrivateRedis,
    run_id: str,
) -> None:
    """A seed drawn at random (printed; FAULTS_SEED replays it), FAULTS_SCHEDULE_SECONDS of
    faults and load (default 100 s), then the heal, the settle (at most 90 s) and the check."""
    seed = int(os.environ.get("FAULTS_SEED") or random.SystemRandom().randrange(1, 10**6))
    run_schedule(
        seed, SCHEDULE_SECONDS, fault_env, private_redis, private_postgres, counter_redis, run_id
    )


def test_a_seed_replays_the_same_plan() -> None:
    """FAULTS_SEED replays a run: the same seed and budget give the same faults at the same
    offsets and the same calls; another seed gives another schedule."""
    first, again, other = plan(4242, 100), plan(4242, 100), plan(4243, 100)
    assert first == again
    assert first.faults != other.faults
    assert all(6.0 <= f.at < 100 - 6.0 for f in first.faults)
    assert {c.kind for c in first.calls} == {"effect", "flaky", "delayed", "long", "batch"}


def test_the_checker_finds_each_violation() -> None:
    """The checker is not a test that cannot fail: a history with one of each violation
    (a lost job, one still waiting, an effect twice, a succeeded job without its effect, a dead
    job without its dead letter, drifted batch counters, a callback twice, the API disagreeing)
    yields each of them; the same history made right yields none."""
    good = History(
        accepted={"a": "effect", "b": "effect", "c": "flaky", "m1": "batch", "m2": "batch"},
        batches={"B": ["m1", "m2"]},
        states={"a": "succeeded", "b": "succeeded", "c": "dead", "m1": "succeeded",
                "m2": "dead", "cb": "succeeded"},
        items={"a": 1, "b": 2, "c": 3, "m1": 4, "m2": 5},
        effects=Counter({1: 1, 2: 1, 4: 1, 6: 1}),
        batch_rows={"B": {"total": 2, "pending": 0, "succeeded": 1, "dead": 1, "cancelled": 0,
                          "state": "complete"}},
        callbacks=Counter({"B": 1}),
        dead_letters=Counter({"c": 1, "m2": 1}),
        api_states={"a": "succeeded"},
    )  # fmt: skip
    verdict = check(good)
    assert verdict.violations == []
    assert verdict.outcomes == Counter({"succeeded": 3, "dead": 2, "batch complete": 1})

    bad = History(
        accepted={**good.accepted, "lost": "effect", "w": "delayed"},
        batches=good.batches,
        states={**good.states, "w": "scheduled", "b": "succeeded"},
        items={**good.items, "w": 7},
        effects=Counter({1: 2, 4: 1, 6: 1}),  # 1 twice, 2 (b succeeded) missing
        batch_rows={"B": {**good.batch_rows["B"], "succeeded": 2, "state": "running"}},
        callbacks=Counter({"B": 2}),
        dead_letters=Counter({"m2": 1}),  # c has none
        api_states={"a": "queued"},
    )
    found = "\n".join(check(bad).violations)
    for expected in [
        "accepted jobs missing from the ledger: 1",
        "did not end succeeded or dead: 1",
        "still waiting or running",
        "effects applied more than once: 1",
        "succeeded jobs whose effect is missing: 1",
        "dead jobs without exactly one dead letter: 1",
        "counters (row, ledger) disagree",
        "batches not complete",
        "callbacks not applied exactly once",
        "state in the API differs",
    ]:
        assert expected in found, f"{expected!r} not reported:\n{found}"
