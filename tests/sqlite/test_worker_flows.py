"""The core worker flows on SQLite (a WAL file, as `make run` uses), with four worker processes
on the one file: claim and finish once, retry, dead letter and replay, the relay's outbox, a
cluster rate limit, cancel — and a busy database ("database is locked") is waited out, never
counted as a failed attempt."""

from __future__ import annotations

import sqlite3
import time

from jobs.testing import wait_until
from jobs.worker.outcomes import DELIVERIES
from tests.sqlite.conftest import BUSY_TIMEOUT, CONCURRENCY, WORKERS, SQLiteSite

FINISHED = {"succeeded", "dead", "cancelled"}


def values(site: SQLiteSite, key: str) -> list[str]:
    return [value for _, value in site.marks(key)]


def test_the_suite_runs_on_a_sqlite_file_in_wal_mode(site: SQLiteSite):
    answer = site.driver("sqlite")

    assert answer == {"vendor": "sqlite", "journal_mode": "wal", "name": str(site.path)}
    assert WORKERS * CONCURRENCY == 4


def test_each_job_is_claimed_and_finished_once_by_four_processes(site: SQLiteSite, unique):
    # given: 60 jobs, 40 accepted at once (multi-row INSERTs) and 20 one by one
    many = site.driver.enqueue_many(
        "tests.sqlite.note", [([unique, f"m{n}"], {}) for n in range(40)]
    )
    single = [site.driver.enqueue("tests.sqlite.note", unique, f"s{n}") for n in range(20)]
    ids = many + single

    # when the workers take them
    rows = site.driver.wait_states(ids, FINISHED, timeout=90, what="60 jobs on SQLite")

    # then: each succeeded after one attempt, ran once, and the pool processes shared them
    assert {r["state"] for r in rows} == {"succeeded"}
    assert {r["attempts"] for r in rows} == {1}
    runs = [value.split(":") for value in values(site, unique)]
    expected = [f"m{n}" for n in range(40)] + [f"s{n}" for n in range(20)]
    assert sorted(label for label, _ in runs) == sorted(expected)
    assert len({pid for _, pid in runs}) >= 2, runs


def test_a_retry_then_success_and_a_dead_letter_replayed(site: SQLiteSite, unique):
    flaky = site.driver.enqueue("tests.flaky", f"{unique}-f", 2)
    refused = site.driver.enqueue("tests.refused", f"{unique}-r", "x@example.com")

    first, dead = site.driver.wait_states([flaky, refused], FINISHED, timeout=60)

    assert (first["state"], first["attempts"]) == ("succeeded", 3)
    assert (dead["state"], dead["attempts"]) == ("dead", 1)
    (letter,) = site.driver("dead_letters", ids=[refused])["dead_letters"]
    assert letter["exception"] == "jobs.core.policies.Permanent"

    # when the dead letter is replayed: a new job, linked to it, that runs (and is refused again)
    replayed = site.driver("replay", dead_letter_id=letter["id"])["id"]
    (again,) = site.driver.wait_states([replayed], FINISHED, timeout=60)
    assert again["state"] == "dead" and again["replay_of"] == letter["id"]
    assert len(site.marks(f"{unique}-r")) == 2


def test_the_relay_publishes_the_outbox(site: SQLiteSite, unique):
    # given: a row the broker never took (enqueued while Redis was down)
    job_id = site.driver("outbox", task="tests.sqlite.note", args=[unique, "outbox"], kwargs={})
    job_id = job_id["id"]
    (row,) = site.driver.jobs([job_id])
    assert (row["state"], row["published"]) == ("queued", False)

    # when the relay sweeps, then a worker runs it
    assert site.driver("relay")["sent"] >= 1
    (done,) = site.driver.wait_states([job_id], FINISHED, timeout=60)
    assert done["state"] == "succeeded" and done["published"]
    assert [value.split(":")[0] for value in values(site, unique)] == ["outbox"]


def test_a_cluster_rate_limit_holds_across_the_processes(site: SQLiteSite, unique):
    ids = site.driver.enqueue_many("tests.rate_limited", [([unique], {}) for _ in range(30)])

    rows = site.driver.wait_states(ids, FINISHED, timeout=90, what="30 rate-limited jobs")

    assert {r["state"] for r in rows} == {"succeeded"}
    assert {r["attempts"] for r in rows} == {1}  # a wait for a token spends no attempt
    stamps = sorted(stamp for stamp, _ in site.marks(unique))
    assert len(stamps) == 30
    # 20/s with no burst: 30 runs take at least 29 intervals of 50 ms (some slack for clocks)
    assert stamps[-1] - stamps[0] >= 1.3, stamps[-1] - stamps[0]


def test_cancel_stops_a_running_job_and_a_waiting_one_never_runs(site: SQLiteSite, unique):
    running = site.driver.enqueue("tests.cooperative", unique, kwargs={"seconds": 60})
    waiting = site.driver.enqueue("tests.sqlite.note", f"{unique}-w", "late", delay=5)
    # started, and its claim written (its first progress(); with DEFER_CLAIM a job that
    # has not written it yet reads queued, and a cancel then cancels the row outright)
    site.driver.wait_states([running], {"running"}, timeout=60, what="the job's claim")
    wait_until(
        lambda: "started" in values(site, unique),
        timeout=60,
        what="the cooperative job to start",
    )

    assert site.driver("cancel", job_id=waiting)["cancelled"] == [waiting]
    assert site.driver("cancel", job_id=running)["requested"] == [running]

    stopped, never = site.driver.wait_states([running, waiting], FINISHED, timeout=60)
    assert stopped["state"] == "cancelled" and never["state"] == "cancelled"
    assert values(site, unique) == ["started", "stopped"]
    # the waiting job's message arrives once its 5 s are up, and is dropped at claim
    wait_until(
        lambda: site.driver.jobs([waiting])[0]["deliveries"] >= 1,
        timeout=30,
        what="the cancelled job's delayed message to be delivered and dropped",
    )
    assert site.marks(f"{unique}-w") == []


def test_a_busy_database_is_waited_out_never_dead_lettered(site: SQLiteSite, unique):
    # given: four one-attempt jobs running (one per pool process), each about to write a row,
    # and ten more jobs waiting behind them
    names = [f"{unique}-g{n}" for n in range(4)]
    writers = [site.driver.enqueue("tests.sqlite.write_when_told", unique, name) for name in names]
    wait_until(
        lambda: sum(v.startswith("started:") for v in values(site, unique)) >= 4,
        timeout=60,
        what="four writers to start",
    )
    waiting = site.driver.enqueue_many(
        "tests.sqlite.note", [([f"{unique}-n", str(n)], {}) for n in range(10)]
    )

    # when: another process holds SQLite's write lock for four busy timeouts while the writers
    # write, the waiting jobs are claimed and the finishes land
    lock = sqlite3.connect(site.path, timeout=30, isolation_level=None)
    try:
        lock.execute("BEGIN IMMEDIATE")
        site.set_flag(unique)
        time.sleep(BUSY_TIMEOUT * 4)
    finally:
        lock.execute("COMMIT")
        lock.close()

    # then: every job succeeded, none spent an attempt on the lock, nothing is dead
    ids = writers + waiting
    rows = site.driver.wait_states(ids, FINISHED, timeout=90, what="the jobs after the lock")
    assert {r["state"] for r in rows} == {"succeeded"}, [(r["state"], r["error"]) for r in rows]
    assert {r["attempts"] for r in rows} == {1}
    assert site.driver("dead_letters", ids=ids)["dead_letters"] == []
    assert site.driver("groups", names=names)["groups"] == sorted(names)
    assert sum(v.startswith("wrote:") for v in values(site, unique)) == 4


def test_the_active_jobs_copy_follows_the_ledger_on_sqlite(site: SQLiteSite, unique):
    # given: jobs accepted in bulk and one by one, and one that waits an hour
    many = site.driver.enqueue_many(
        "tests.sqlite.note", [([unique, f"a{n}"], {}) for n in range(5)]
    )
    single = site.driver.enqueue("tests.sqlite.note", unique, "b")
    later = site.driver.enqueue("tests.sqlite.note", f"{unique}-l", "later", delay=3600)

    # the waiting one has its copy (the SQLite triggers wrote it with the row)
    assert site.driver("active", ids=[later])["active"] == {later: "scheduled"}

    # when the others run and the waiting one is cancelled
    site.driver.wait_states([*many, single], FINISHED, timeout=60, what="6 jobs on SQLite")
    assert site.driver("cancel", job_id=later)["cancelled"] == [later]

    # then no copy is left: every one of them ended
    assert site.driver("active", ids=[*many, single, later])["active"] == {}


def test_short_jobs_succeed_in_one_write_with_the_claim_deferred_on_sqlite(
    site: SQLiteSite, unique
):
    # given the site's prefork workers off the default queue, and a -P solo worker deferring
    # its claims (BACKLOT['DEFER_CLAIM']: a short job's row is written once, at its finish)
    names = [worker.name for worker in site.workers]
    site.control.cancel_consumer("default", destination=names, reply=True, timeout=5)
    deferred = site.start_worker("sqlite-deferred", pool="solo", BACKLOT_DEFER_CLAIM="1")
    try:
        before = int(site.redis.hget(DELIVERIES, "deferred") or 0)

        # when short jobs run on it
        ids = [site.driver.enqueue("tests.sqlite.note", unique, f"d{n}") for n in range(10)]
        rows = site.driver.wait_states(ids, FINISHED, timeout=60, what="10 jobs, claim deferred")

        # then each ran once and succeeded on its first attempt with its result, every one
        # of them run without a claim write (the deliveries metric's "deferred" count)
        assert [(r["state"], r["attempts"], r["deliveries"]) for r in rows] == [
            ("succeeded", 1, 1)
        ] * 10
        assert sorted(r["result"] for r in rows) == sorted(f"d{n}" for n in range(10))
        labels = [value.split(":")[0] for value in values(site, unique)]
        assert sorted(labels) == sorted(f"d{n}" for n in range(10))
        wait_until(
            lambda: int(site.redis.hget(DELIVERIES, "deferred") or 0) - before == 10,
            timeout=10,
            interval=0.1,
            what="10 deferred deliveries counted",
        )
    finally:
        deferred.stop()
        site.control.add_consumer("default", destination=names, reply=True, timeout=5)


def test_a_row_alongside_a_job_is_written_with_it_or_not_at_all_on_sqlite(site: SQLiteSite, unique):
    # given: a job enqueued with a new row of the caller's alongside (SQLite: the row's
    # INSERT just before the job's, in one transaction)
    done = site.driver("alongside", task="tests.sqlite.note", args=[unique, "a"], name=unique)
    rows = site.driver.wait_states([done["id"]], FINISHED, timeout=60, what="the job to run")

    # then: the row is saved with its key, and the job ran
    assert done["group"] is not None and rows[0]["state"] == "succeeded"
    assert site.driver("groups", names=[unique])["groups"] == [unique]

    # when: a job whose INSERT fails (its id taken) is enqueued with another row
    failed = site.driver(
        "alongside",
        task="tests.sqlite.note",
        args=[unique, "b"],
        name=f"{unique}-b",
        job_id=done["id"],
    )

    # then: neither is written
    assert failed == {"error": "IntegrityError"}
    assert site.driver("groups", names=[f"{unique}-b"])["groups"] == []
