"""The core worker flows on RabbitMQ (BROKER_URL=amqp://..., quorum queues), with four worker
processes and the relay: claim and finish once, retry, dead letter and replay, the relay's
outbox, cancel, pause and resume, a batch's callbacks, a worker killed with messages in hand,
and a message RabbitMQ gives up on."""

from __future__ import annotations

import json
from collections import Counter

from jobs.testing import wait_until
from tests.amqp.rabbitmq import port_free
from tests.amqp.site import CONCURRENCY, DELIVERY_LIMIT, WORKERS, Site

FINISHED = {"succeeded", "dead", "cancelled"}
BACKLOT_QUEUES = ("default", "emails", "reports", "media")
UNDELIVERABLE = "backlot.undeliverable"


def runs(site: Site, key: str) -> Counter[str]:
    """label -> how many times a tests.amqp.work job of `key` started."""
    return Counter(value.split(":")[1] for value in site.marks(key) if value.startswith("run:"))


def pids(site: Site, key: str) -> set[str]:
    return {value.split(":")[2] for value in site.marks(key) if value.startswith("run:")}


def consumers(site: Site, queue: str) -> int:
    return site.depth(queue)[1]


def ready(site: Site, queue: str) -> int:
    return site.depth(queue)[0]


def test_the_queues_are_durable_quorum_queues_with_a_delivery_limit(site: Site):
    assert site.driver("settings") == {
        "broker": site.url,
        "queue_type": "quorum",
        "delivery_limit": DELIVERY_LIMIT,
        "queues": list(BACKLOT_QUEUES),
        "vendor": "postgresql",
    }
    # the relay declares the queue RabbitMQ dead-letters to at its first sweep
    queues = wait_until(
        lambda: (found := site.queues()) and UNDELIVERABLE in found and found,
        timeout=30,
        what="the undeliverable queue",
    )

    for name in BACKLOT_QUEUES:
        queue = queues[name]
        assert (queue["type"], queue["durable"]) == ("quorum", True), queue
        arguments = {key: value for key, _, value in queue["arguments"]}
        assert arguments == {
            "x-queue-type": "quorum",
            "x-delivery-limit": DELIVERY_LIMIT,
            "x-dead-letter-exchange": "",
            "x-dead-letter-routing-key": UNDELIVERABLE,
        }
    assert (queues[UNDELIVERABLE]["type"], queues[UNDELIVERABLE]["durable"]) == ("quorum", True)
    assert WORKERS * CONCURRENCY == 4


def test_each_job_is_claimed_and_finished_once_by_four_processes(site: Site, unique):
    # given: 60 jobs, 40 accepted at once (multi-row INSERTs) and 20 one by one
    many = site.driver.enqueue_many("tests.amqp.work", [([unique, f"m{n}"], {}) for n in range(40)])
    single = [site.driver.enqueue("tests.amqp.work", unique, f"s{n}") for n in range(20)]
    ids = many + single

    # when the workers take them
    rows = site.driver.wait_states(ids, FINISHED, timeout=90, what="60 jobs on RabbitMQ")

    # then: each succeeded after one attempt, ran and applied its effect once, and the pool
    # processes shared them
    assert {r["state"] for r in rows} == {"succeeded"}
    assert {r["attempts"] for r in rows} == {1}
    assert {r["published"] for r in rows} == {True}  # marked at the confirm, or at the claim
    expected = {f"m{n}": 1 for n in range(40)} | {f"s{n}": 1 for n in range(20)}
    assert dict(runs(site, unique)) == expected
    assert site.driver("effects", key=unique)["effects"] == expected
    assert len(pids(site, unique)) >= 2


def test_a_retry_then_success_and_a_dead_letter_replayed(site: Site, unique):
    # tests.flaky fails twice (retried after 1 s, then 2 s: the ledger holds the retries and
    # the relay publishes each when due); tests.refused fails for good at once
    flaky = site.driver.enqueue("tests.flaky", f"{unique}-f", 2)
    refused = site.driver.enqueue("tests.refused", f"{unique}-r", "x@example.com")

    first, dead = site.driver.wait_states([flaky, refused], FINISHED, timeout=60)

    assert (first["state"], first["attempts"], first["result"]) == ("succeeded", 3, "done")
    assert len(site.marks(f"{unique}-f")) == 3
    assert (dead["state"], dead["attempts"]) == ("dead", 1)
    (letter,) = site.driver("dead_letters", ids=[refused])["dead_letters"]
    assert letter["exception"] == "jobs.core.policies.Permanent"

    # when the dead letter is replayed: a new job, linked to it, that runs (and is refused again)
    replayed = site.driver("replay", dead_letter_id=letter["id"])["id"]
    (again,) = site.driver.wait_states([replayed], FINISHED, timeout=60)
    assert again["state"] == "dead" and again["replay_of"] == letter["id"]
    assert len(site.marks(f"{unique}-r")) == 2


def test_jobs_that_fail_at_once_in_a_bulk_enqueue_are_each_retried_when_due(site: Site, unique):
    # given: 200 jobs accepted at once, each failing its first run (retried 1 s later): the
    # first ones run, and fail, while the rest of the bulk publish is still under way
    keys = [f"{unique}-{n}" for n in range(200)]
    ids = site.driver.enqueue_many("tests.flaky", [([key, 1], {}) for key in keys])

    # then every one is retried once, when due, and succeeds. (The bound is ten times what
    # 400 runs and a 1 s backoff take here, and below the relay's RELAY_LOST_AFTER (30 s),
    # past which its idle-queue reconcile re-sends a retry whose message was never sent: a
    # retry must not wait for that, which on a busy queue never comes.)
    rows = site.driver.wait_states(ids, FINISHED, timeout=20, what="200 jobs retried when due")
    assert {(r["state"], r["attempts"]) for r in rows} == {("succeeded", 2)}


def test_the_relay_publishes_what_an_enqueue_could_not_send(site: Site, unique):
    # given: an enqueue from a process whose RabbitMQ does not answer (nothing listens there)
    closed = next(port for port in range(47000, 48000) if port_free(port))
    away = site.start_driver({"BROKER_URL": f"amqp://guest:guest@127.0.0.1:{closed}//"})
    try:
        job_id = away.enqueue("tests.amqp.work", unique, "outbox")
        (row,) = away.jobs([job_id])
    finally:
        away.stop()

    # the job is accepted, and waits in the ledger's outbox
    assert (row["state"], row["published"]) == ("queued", False)

    # then the relay (on the reachable RabbitMQ) sends it once its grace is up, and it runs once
    (done,) = site.driver.wait_states([job_id], FINISHED, timeout=60, what="the outbox job")
    # (its published mark lands after RabbitMQ's confirm, or with the claim of a worker that
    # took it first: either way a finished job says its message left the outbox)
    assert (done["state"], done["attempts"], done["published"]) == ("succeeded", 1, True)
    assert runs(site, unique) == {"outbox": 1}
    assert site.driver("effects", key=unique)["effects"] == {"outbox": 1}


def test_a_delayed_job_waits_in_the_ledger_and_runs_when_due(site: Site, unique):
    # on RabbitMQ nothing waits broker-side: the relay publishes the job when it is due
    job_id = site.driver.enqueue("tests.amqp.work", unique, "later", delay=2)
    (row,) = site.driver.jobs([job_id])
    assert (row["state"], row["published"]) == ("scheduled", False)

    (done,) = site.driver.wait_states([job_id], FINISHED, timeout=60, what="the delayed job")
    # (its published mark lands after RabbitMQ's confirm, or with the claim of a worker that
    # took it first: either way a finished job says its message left the outbox)
    assert (done["state"], done["attempts"], done["published"]) == ("succeeded", 1, True)
    assert runs(site, unique) == {"later": 1}


def test_rate_limited_jobs_each_run_once_through_their_gate(site: Site, unique):
    # 20/s cluster-wide: most wait at their gate in Redis, which publishes them to RabbitMQ
    many = site.driver.enqueue_many("tests.rate_limited", [([unique], {}) for _ in range(20)])
    single = [site.driver.enqueue("tests.rate_limited", unique) for _ in range(10)]

    rows = site.driver.wait_states(many + single, FINISHED, timeout=90, what="30 rate-limited")

    assert {r["state"] for r in rows} == {"succeeded"}
    assert {r["attempts"] for r in rows} == {1}  # a wait for a token spends no attempt
    assert len(site.marks(unique)) == 30


def test_cancel_stops_a_running_job_and_a_queued_one_never_runs(site: Site, unique):
    running = site.driver.enqueue("tests.cooperative", unique, kwargs={"seconds": 60})
    wait_until(
        lambda: "started" in site.marks(unique), timeout=60, what="the cooperative job to start"
    )
    # a job whose message waits in RabbitMQ: its queue is paused while it is enqueued
    site.driver("command", args=["pause", "reports"])
    try:
        wait_until(lambda: consumers(site, "reports") == 0, timeout=30, what="reports paused")
        waiting = site.driver.enqueue("tests.amqp.work", f"{unique}-w", "late", queue="reports")
        wait_until(lambda: ready(site, "reports") == 1, timeout=30, what="the message queued")

        assert site.driver("cancel", job_id=waiting)["cancelled"] == [waiting]
        assert site.driver("cancel", job_id=running)["requested"] == [running]
    finally:
        site.driver("command", args=["resume", "reports"])

    stopped, never = site.driver.wait_states([running, waiting], FINISHED, timeout=60)
    assert stopped["state"] == "cancelled" and never["state"] == "cancelled"
    assert site.marks(unique) == ["started", "stopped"]
    # the cancelled job's message is delivered once the queue is resumed, and dropped at claim
    wait_until(lambda: ready(site, "reports") == 0, timeout=30, what="the message taken")
    wait_until(
        lambda: site.driver.jobs([waiting])[0]["deliveries"] >= 1,
        timeout=30,
        what="the cancelled job's message to be delivered and dropped",
    )
    assert site.marks(f"{unique}-w") == []
    assert site.driver("effects", key=f"{unique}-w")["effects"] == {}


def test_a_paused_queue_keeps_its_jobs_until_resumed(site: Site, unique):
    # given: reports paused (its workers stop consuming it)
    answer = site.driver("command", args=["pause", "reports"])["output"]
    assert "reports" in answer
    try:
        wait_until(lambda: consumers(site, "reports") == 0, timeout=30, what="reports paused")

        # when jobs are enqueued on it and on a queue that runs
        held = [
            site.driver.enqueue("tests.amqp.work", unique, f"r{n}", queue="reports")
            for n in range(5)
        ]
        other = site.driver.enqueue("tests.amqp.work", unique, "d0", queue="default")
        site.driver.wait_states([other], FINISHED, timeout=60, what="the default queue's job")

        # then they wait in RabbitMQ, accepted and queued, not run
        assert ready(site, "reports") == 5
        assert {r["state"] for r in site.driver.jobs(held)} == {"queued"}
        assert runs(site, unique) == {"d0": 1}
        # and the operator's status (the dashboard's data) reads the depth from RabbitMQ
        status = json.loads(site.driver("command", args=["status", "--json"])["output"])
        reports = next(q for q in status["queues"] if q["name"] == "reports")
        assert reports["waiting"] == 5 and reports["state"] == "paused"
        assert site.driver("depths")["reports"] == 5  # what Backlot reads of RabbitMQ
        assert len(status["workers"]) == WORKERS
    finally:
        site.driver("command", args=["resume", "reports"])

    # and once resumed, every one runs, once
    wait_until(lambda: consumers(site, "reports") == WORKERS, timeout=30, what="reports resumed")
    rows = site.driver.wait_states(held, FINISHED, timeout=60, what="the resumed jobs")
    assert {r["state"] for r in rows} == {"succeeded"}
    assert runs(site, unique) == {"d0": 1} | {f"r{n}": 1 for n in range(5)}


def test_a_batch_runs_its_callbacks_once_after_its_members(site: Site, unique):
    opened = site.driver("batch", key=unique, members=20)

    site.driver.wait_states(opened["members"], FINISHED, timeout=60, what="the batch's members")
    wait_until(
        lambda: site.marks(f"{unique}:success") and site.marks(f"{unique}:complete"),
        timeout=60,
        what="the batch's callbacks",
    )

    state = site.driver("batch_state", batch_id=opened["id"])
    assert (state["total"], state["succeeded"], state["pending"]) == (20, 20, 0)
    assert sorted(site.marks(f"{unique}:runs")) == sorted(str(n) for n in range(20))
    # each callback ran once, and every member's run was recorded before it
    assert site.marks(f"{unique}:success") == [f"{opened['id']}:20"]
    assert site.marks(f"{unique}:complete") == [f"{opened['id']}:20"]


def test_a_killed_worker_s_jobs_each_run_to_success_once(site: Site, unique):
    # given: a third worker that holds messages it has not started (prefetch 4 a process)
    victim = site.start_worker("victim")
    labels = [f"k{n}" for n in range(60)]
    ids = site.driver.enqueue_many(
        "tests.amqp.work", [([unique, label], {"seconds": 0.5}) for label in labels]
    )
    victim_pids = {str(pid) for pid in victim.pool_pids()}

    def victim_holds_more_than_it_runs() -> int:
        ports = victim.broker_ports(site.amqp_port)
        held = sum(
            count
            for port, count in site.rabbitmq.unacknowledged_by_port(site.vhost).items()
            if port in ports
        )
        started = victim_pids & pids(site, unique)
        return held if started and held > CONCURRENCY else 0

    held = wait_until(
        victim_holds_more_than_it_runs, timeout=30, interval=0.1, what="the victim's prefetch"
    )

    # when: kill -9 of the worker and its pool, running jobs and prefetched messages in hand
    victim.kill()

    # then: every job succeeds (the prefetched ones as RabbitMQ gives them back, the running
    # ones once their lease lapses and the relay re-sends them), each effect applied once
    rows = site.driver.wait_states(ids, FINISHED, timeout=60, what="every job after the kill")
    assert {r["state"] for r in rows} == {"succeeded"}, Counter(r["state"] for r in rows)
    assert site.driver("effects", key=unique)["effects"] == dict.fromkeys(labels, 1)
    started = runs(site, unique)
    assert set(started) == set(labels)
    # only the jobs running at the kill ran twice; the held ones it had not started ran once
    twice = sorted(label for label, count in started.items() if count > 1)
    assert len(twice) <= CONCURRENCY and max(started.values()) <= 2, (held, twice)


def test_a_message_rabbitmq_gives_up_on_becomes_a_dead_letter(site: Site, unique):
    # given: a job that kills its pool process every run (a segfault): each death gives the
    # message back to RabbitMQ, which gives up past x-delivery-limit, before the ledger's own
    # MAX_WORKER_CRASHES (3) would
    job_id = site.driver.enqueue("tests.crashes", unique, 100)

    # then the relay drains it from backlot.undeliverable into a dead letter
    (row,) = site.driver.wait_states([job_id], FINISHED, timeout=60, what="the poison job")
    assert row["state"] == "dead"
    assert len(site.marks(unique)) == DELIVERY_LIMIT + 1
    (letter,) = site.driver("dead_letters", ids=[job_id])["dead_letters"]
    assert letter["exception"] == "billiard.exceptions.WorkerLostError"
    assert "x-delivery-limit" in letter["message"]
    wait_until(lambda: ready(site, UNDELIVERABLE) == 0, timeout=10, what="the drain's ack")


def test_the_dead_letter_says_how_many_times_rabbitmq_delivered_the_message(site: Site, unique):
    job_id = site.driver.enqueue("tests.crashes", unique, 100)

    site.driver.wait_states([job_id], FINISHED, timeout=60, what="the poison job")

    (letter,) = site.driver("dead_letters", ids=[job_id])["dead_letters"]
    delivered = len(site.marks(unique))  # each delivery ran it once, and it died
    assert delivered == DELIVERY_LIMIT + 1
    assert f"delivered this job's message {delivered} times" in letter["message"], letter


def test_a_job_that_expires_in_rabbitmq_ends_cancelled_not_dead(site: Site, unique):
    # given: reports paused, and a job on it that expires in 1 s (Celery sends `expires` as
    # the message's TTL on RabbitMQ, which dead-letters it to backlot.undeliverable)
    site.driver("command", args=["pause", "reports"])
    try:
        wait_until(lambda: consumers(site, "reports") == 0, timeout=30, what="reports paused")
        job_id = site.driver(
            "apply_async",
            task="tests.amqp.work",
            args=[unique, "late"],
            kwargs={},
            options={"queue": "reports", "expires": 1},
        )["id"]

        # then the relay's drain ends it cancelled ("expired"), as a worker discards it on Redis
        (row,) = site.driver.wait_states([job_id], FINISHED, timeout=60, what="the expiry")
    finally:
        site.driver("command", args=["resume", "reports"])
    assert row["state"] == "cancelled" and row["error"] == "expired", row
    assert site.driver("dead_letters", ids=[job_id])["dead_letters"] == []
    assert runs(site, unique) == {}


def test_a_job_whose_message_rabbitmq_lost_is_sent_again_by_the_relay(site: Site, unique):
    # given: a job accepted on a paused queue, its message then purged from RabbitMQ
    site.driver("command", args=["pause", "reports"])
    try:
        wait_until(lambda: consumers(site, "reports") == 0, timeout=30, what="reports paused")
        job_id = site.driver.enqueue("tests.amqp.work", unique, "lost", queue="reports")
        wait_until(lambda: ready(site, "reports") == 1, timeout=30, what="its message")
        assert site.driver("purge", queue="reports")["purged"] == 1
    finally:
        site.driver("command", args=["resume", "reports"])

    # then: the relay finds it waiting on a queue with no message ready (RELAY_LOST_AFTER,
    # 30 s, after its publish) and sends it again; it runs once
    (row,) = site.driver.wait_states([job_id], FINISHED, timeout=120, what="the re-sent job")
    assert (row["state"], row["attempts"]) == ("succeeded", 1)
    assert runs(site, unique) == {"lost": 1}
