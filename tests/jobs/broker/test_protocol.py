"""jobs.broker.protocol: a job's message built by Backlot and pushed in one round trip is the
message Celery's apply_async would have stored in Redis, field for field (but for the
delivery tag, a new uuid each), a worker runs it, and what the short path cannot carry still
goes through Celery.

The messages are read from the broker's Redis as a worker would pop them (the `reports`
queue: the suite's session worker does not consume it)."""

from __future__ import annotations

import base64
import json
import threading
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from celery import current_app
from celery.signals import before_task_publish

from jobs.broker import broker, protocol, unanswered
from jobs.broker.queues import queue_keys
from jobs.broker.redis import redis_client
from jobs.core.masking import message_repr
from jobs.models import Job, JobState
from tests.conftest import Worker, marks, wait_until
from tests.support import tasks

QUEUE = "reports"


def popped() -> list[dict[str, Any]]:
    """Every message on QUEUE's lists (all priorities), removed, oldest first."""
    found = []
    for key in queue_keys(QUEUE):
        while (raw := redis_client().rpop(key)) is not None:
            assert isinstance(raw, bytes)
            found.append({"list": key, **json.loads(raw)})
    return found


def comparable(message: dict[str, Any]) -> dict[str, Any]:
    message = json.loads(json.dumps(message))
    tag = message["properties"].pop("delivery_tag")
    assert uuid.UUID(tag)
    message["body"] = json.loads(base64.b64decode(message["body"]))
    return message


def publish(job_id: str, *, celerys: bool, **extra: Any) -> None:
    """One job's message, by jobs.broker.broker.publish (the short path where it applies) or
    by Celery's apply_async with the same arguments (what publish did before)."""
    args, kwargs = [job_id], {"label": "a"}
    options = {"retries": 2, "headers": {"traceparent": "00-abc-def-01"}, **extra}
    if celerys:
        tasks.prioritized.apply_async(
            args,
            kwargs,
            task_id=job_id,
            queue=QUEUE,
            priority=broker.broker_priority(7),
            eta=None,
            _backlot_internal=True,
            argsrepr=message_repr(args),
            kwargsrepr=message_repr(kwargs),
            **options,
        )
        return
    assert publish_one(job_id, args=args, kwargs=kwargs, options=options)


def publish_one(
    job_id: str,
    *,
    args: list[Any] | None = None,
    kwargs: dict[str, Any] | None = None,
    options: dict[str, Any] | None = None,
    answered: bool = True,
) -> bool:
    """jobs.broker.broker.publish of one job on QUEUE, priority 7: whether the broker took it."""
    return broker.publish(
        task=tasks.prioritized,
        job_id=job_id,
        args=args if args is not None else [job_id],
        kwargs=kwargs if kwargs is not None else {},
        queue=QUEUE,
        priority=7,
        eta=None,
        options=dict(options or {}),
        answered=answered,
    )


@pytest.fixture
def empty_queue(clean_redis: None) -> Iterator[None]:
    popped()
    yield
    popped()


@pytest.fixture
def celery_sends(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The task ids Celery's send_task published (the long path) while the test ran."""
    sent: list[str] = []
    app_class = type(current_app._get_current_object())  # type: ignore[attr-defined]
    send_task = app_class.send_task

    def counted(app: Any, name: str, *args: Any, **kwargs: Any) -> Any:
        sent.append(kwargs.get("task_id") or "")
        return send_task(app, name, *args, **kwargs)

    monkeypatch.setattr(app_class, "send_task", counted)
    return sent


def test_the_short_path_stores_the_message_celery_would(
    empty_queue: None, celery_sends: list[str]
) -> None:
    # given: the same job published both ways
    job_id = str(uuid.uuid4())
    publish(job_id, celerys=True)
    [celerys] = popped()
    assert celery_sends == [job_id]
    publish(job_id, celerys=False)
    [ours] = popped()
    assert celery_sends == [job_id], "publish() went through Celery's send_task"

    # then: the same list (priority 7's), headers, properties and body
    assert comparable(ours) == comparable(celerys)
    assert ours["list"] == queue_keys(QUEUE)[broker.broker_priority(7)]
    assert ours["headers"]["retries"] == 2 and ours["headers"]["traceparent"] == "00-abc-def-01"


def test_the_short_path_takes_one_round_trip_and_rings_the_bell(
    empty_queue: None, celery_sends: list[str]
) -> None:
    # given: a counter of what this process sends Redis
    sent: list[Any] = []
    pool = redis_client().connection_pool
    connection = pool.get_connection()
    pool.release(connection)
    connection_class = type(connection)
    original = connection_class.send_packed_command

    def counted(self: Any, command: Any, check_health: bool = True) -> None:
        sent.append(command)
        original(self, command, check_health)

    job_id = str(uuid.uuid4())
    publish(str(uuid.uuid4()), celerys=False)  # the queue's route is read once per process
    popped()
    connection_class.send_packed_command = counted  # type: ignore[method-assign]
    try:
        publish(job_id, celerys=False)
    finally:
        connection_class.send_packed_command = original  # type: ignore[method-assign]

    # then: one packet to Redis, the message's LPUSH with the bell's LPUSH and LTRIM
    assert len(sent) == 1
    packet = b"".join(sent[0]) if isinstance(sent[0], list) else sent[0]
    assert packet.count(b"LPUSH") == 2 and packet.count(b"LTRIM") == 1
    assert [m["headers"]["id"] for m in popped()] == [job_id]
    assert celery_sends == []


def test_a_host_receiver_of_before_task_publish_still_sees_every_message(
    empty_queue: None, celery_sends: list[str]
) -> None:
    # given: a host's own receiver of Celery's publish signal (tracing, auditing)
    seen: list[str] = []

    def audit(sender: str | None = None, headers: dict[str, Any] | None = None, **_: Any) -> None:
        seen.append((headers or {}).get("id", ""))

    before_task_publish.connect(audit, weak=False)
    try:
        job_id = str(uuid.uuid4())
        publish(job_id, celerys=False)
    finally:
        before_task_publish.disconnect(audit)

    # then: the message went through Celery's path, which sent the signal
    assert seen == [job_id] and celery_sends == [job_id]
    assert [m["headers"]["id"] for m in popped()] == [job_id]


def test_options_the_short_path_cannot_carry_go_through_celery(
    empty_queue: None, celery_sends: list[str]
) -> None:
    # when: a job with an expiry and a link callback is published
    job_id = str(uuid.uuid4())
    link = tasks.record.si("x")
    publish(job_id, celerys=False, expires=600, link=link)

    # then: its message carries them as Celery writes them
    [message] = popped()
    assert celery_sends == [job_id]
    body = json.loads(base64.b64decode(message["body"]))
    assert message["headers"]["expires"] is not None
    assert body[2]["callbacks"][0]["task"] == "tests.record"


@pytest.mark.django_db(transaction=True)
def test_a_worker_runs_a_short_path_job(
    worker: Worker, unique: str, celery_sends: list[str]
) -> None:
    # when: an enqueue from a view or a shell (the short path: no eta, no canvas options)
    handle = tasks.record.delay(unique, "short")
    assert celery_sends == []

    # then: the worker ran it once, and the ledger says so
    wait_until(lambda: marks(unique), timeout=30, what="the job to run")
    wait_until(
        lambda: Job.objects.get(id=handle.id).state == JobState.SUCCEEDED,
        timeout=30,
        what="the job to succeed",
    )
    assert [label for _, label in marks(unique)] == ["short"]


def test_more_threads_than_broker_connections_all_publish(
    empty_queue: None, celery_sends: list[str]
) -> None:
    # given: more threads than broker_pool_limit's connections, released at once
    threads = 3 * (current_app.conf.broker_pool_limit or 10)
    start = threading.Barrier(threads)
    job_ids = [str(uuid.uuid4()) for _ in range(threads)]
    published: list[bool] = []

    def one(job_id: str) -> None:
        start.wait(timeout=10)
        published.append(publish_one(job_id))

    # when
    with ThreadPoolExecutor(max_workers=threads) as pool:
        list(pool.map(one, job_ids))

    # then: each waited for a connection (as Celery's producer pool waits) and published
    assert published == [True] * threads
    assert sorted(m["headers"]["id"] for m in popped()) == sorted(job_ids)
    assert celery_sends == []


def test_a_connection_redis_closed_is_replaced_and_the_message_sent_once(
    empty_queue: None, celery_sends: list[str]
) -> None:
    # given: the short path's pooled connection, closed by Redis since its last use (as a
    # Redis restart or a client timeout leaves it)
    assert publish_one(str(uuid.uuid4()))
    popped()
    route = protocol.route(current_app, QUEUE)
    assert route is not None
    pool = route.client.connection_pool
    connection = pool.get_connection()
    connection.send_command("CLIENT", "ID")
    client_id = connection.read_response()
    pool.release(connection)
    assert redis_client().client_kill_filter(_id=client_id) == 1

    # when
    job_id = str(uuid.uuid4())
    published = publish_one(job_id)

    # then: published on a fresh connection (the pool reconnects it at checkout), once
    assert published
    assert [m["headers"]["id"] for m in popped()] == [job_id]
    assert celery_sends == []


def test_a_refused_push_leaves_the_connection_usable_for_the_next(
    empty_queue: None, celery_sends: list[str]
) -> None:
    # given: the queue's list is taken by a value of another type, so Redis refuses the LPUSH
    key = queue_keys(QUEUE)[broker.broker_priority(7)]
    redis_client().set(key, "not a list")
    try:
        # when
        refused = publish_one(str(uuid.uuid4()))
    finally:
        redis_client().delete(key)
    job_id = str(uuid.uuid4())
    published = publish_one(job_id)

    # then: the first publish says the broker did not take it (its job stays in the outbox),
    # and the next one on the same pool is stored, its replies not mixed with the first's
    assert not refused and published
    assert [m["headers"]["id"] for m in popped()] == [job_id]


def test_an_unanswered_push_is_refused_in_the_log_and_the_next_ones_are_stored(
    empty_queue: None, celery_sends: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    # given: the queue's list taken by a value of another type, so Redis refuses the LPUSH
    key = queue_keys(QUEUE)[broker.broker_priority(7)]
    redis_client().set(key, "not a list")
    refused_id = str(uuid.uuid4())

    # when: a message whose reply is not waited for (a ledger-on enqueue's) is pushed
    with caplog.at_level("WARNING", logger="jobs.broker.unanswered"):
        sent = publish_one(refused_id, answered=False)
        wait_until(replies_read, timeout=5, what="Redis's replies")
    redis_client().delete(key)
    later = [str(uuid.uuid4()) for _ in range(3)]
    for job_id in later:
        assert publish_one(job_id, answered=False)
    unanswered.flush()

    # then: the caller was told it was sent (its row stays published: the relay's reconcile
    # re-sends what Redis lacks), the refusal is logged, and the next messages are stored
    # with their replies read in step
    assert sent
    assert "Redis refused a job's message: WRONGTYPE" in caplog.text
    assert [m["headers"]["id"] for m in popped()] == later
    assert replies_read()
    assert celery_sends == []


def replies_read() -> bool:
    """Whether this thread's unanswered writer to QUEUE's Redis has read every reply (it reads
    those arrived first)."""
    route = protocol.route(current_app, QUEUE)
    assert route is not None
    writer = unanswered.for_thread(route.client.connection_pool, "a job's message")
    writer.read()
    return writer.pending == 0


def test_a_fan_out_stores_the_messages_kombus_batch_would(
    empty_queue: None, celery_sends: list[str]
) -> None:
    # given: the same jobs published by a fan-out both ways (a host's receiver of Celery's
    # publish signal sends them through kombu's batch, as before the short path)
    jobs = [(str(uuid.uuid4()), [n], {"label": "a"}) for n in range(3)]
    trace = {"traceparent": "00-abc-def-01"}

    def host_receiver(**_: Any) -> None:
        pass

    before_task_publish.connect(host_receiver, weak=False)
    try:
        assert broker.publish_many(
            task=tasks.prioritized, jobs=jobs, priority=7, queue=QUEUE, headers=trace
        ) == len(jobs)
    finally:
        before_task_publish.disconnect(host_receiver)
    kombus = popped()
    assert broker.publish_many(
        task=tasks.prioritized, jobs=jobs, priority=7, queue=QUEUE, headers=trace
    ) == len(jobs)
    ours = popped()

    # then: the same messages, in the same order, on priority 7's list
    assert [comparable(m) for m in ours] == [comparable(m) for m in kombus]
    assert [m["headers"]["id"] for m in ours] == [job_id for job_id, _, _ in jobs]
    assert {m["list"] for m in ours} == {queue_keys(QUEUE)[broker.broker_priority(7)]}


# Arguments a fan-out's template must carry as build() does: unicode (escaped, ensure_ascii),
# quotes, backslashes, control characters, %-signs (the template is %-formatted), nesting,
# integers past 64 bits, floats, empty containers.
AWKWARD = [
    ([], {}),
    (["héllo ☃ 𝄞 日本"], {"名前": "Zoë", "emoji": "🙂"}),
    (['say "hi"', "back\\slash", "tab\there\nnew line\r\x01"], {"%s": "%(body)s %% 100%"}),
    ([{"a": [1, {"b": [None, True, False, 1.5, -0.0, 1e300]}]}], {"deep": [[[[[]]]]], "o": {}}),
    ([10**30, -(2**63), 2**64 + 1, 0], {"big": 123456789012345678901234567890}),
    (["x" * 3000], {"k": ["y" * 100] * 10}),
]


@pytest.mark.parametrize("trace", [None, {"traceparent": "00-abc-def-01"}])
@pytest.mark.parametrize(("args", "kwargs"), AWKWARD)
def test_a_fan_outs_template_gives_each_message_builds_bytes(
    args: list[Any], kwargs: dict[str, Any], trace: dict[str, str] | None
) -> None:
    # given: the options a fan-out's messages carry (jobs.broker.broker._publish_many_short)
    task = tasks.prioritized._get_current_object()  # type: ignore[attr-defined]
    options: dict[str, Any] = {"time_limit": None, "soft_time_limit": None}
    if trace:
        options["headers"] = dict(trace)
    where = {"task": task, "queue": QUEUE, "priority": broker.broker_priority(7)}
    template = protocol.template(
        **where, delivery_mode=2, options={"argsrepr": "", "kwargsrepr": "", **options}
    )
    assert template is not None
    job_id = str(uuid.uuid4())

    # when: the job's message is filled in from the template
    [text] = protocol.fill(template, [(job_id, args, kwargs)], message_repr)

    # then: the text is build()'s message as message_text() writes it, byte for byte, with a
    # new uuid4 as its delivery tag
    message = protocol.build(
        **where,
        job_id=job_id,
        args=args,
        kwargs=kwargs,
        delivery_mode=2,
        options={"argsrepr": message_repr(args), "kwargsrepr": message_repr(kwargs), **options},
    )
    tag = json.loads(text)["properties"]["delivery_tag"]
    assert str(uuid.UUID(tag)) == tag
    assert uuid.UUID(tag).version == 4 and uuid.UUID(tag).variant == uuid.RFC_4122
    message["properties"]["delivery_tag"] = tag
    assert text == protocol.message_text(message)


def test_each_filled_message_has_its_own_delivery_tag() -> None:
    task = tasks.prioritized._get_current_object()  # type: ignore[attr-defined]
    template = protocol.template(
        task=task, queue=QUEUE, priority=2, delivery_mode=2, options={"argsrepr": ""}
    )
    assert template is not None
    jobs: list[tuple[str, list[Any], dict[str, Any]]] = [
        (str(uuid.uuid4()), [n], {}) for n in range(500)
    ]
    tags = [
        json.loads(t)["properties"]["delivery_tag"] for t in protocol.fill(template, jobs, repr)
    ]
    assert len(set(tags)) == len(jobs)
    assert all(uuid.UUID(tag).version == 4 for tag in tags)


def test_headers_that_replace_a_messages_own_field_leave_the_template_to_build() -> None:
    # given: headers (a host's trace carrier) holding a field each message sets itself
    task = tasks.prioritized._get_current_object()  # type: ignore[attr-defined]
    for header in ("id", "argsrepr", "kwargsrepr"):
        options = {"argsrepr": "", "kwargsrepr": "", "headers": {header: "fixed"}}

        # then: no template; each message is build()'s
        assert (
            protocol.template(task=task, queue=QUEUE, priority=2, delivery_mode=2, options=options)
            is None
        )


# Not AWKWARD[0]: with no kwargs kombu's batch leaves out kwargsrepr "{}" (slim_message) where
# build() writes it, as it has since the short path came (7f5e6bf); the template keeps build()'s.
@pytest.mark.parametrize(("args", "kwargs"), AWKWARD[1:])
def test_a_fan_out_of_awkward_arguments_stores_what_kombus_batch_would(
    empty_queue: None, args: list[Any], kwargs: dict[str, Any]
) -> None:
    # given: the same jobs published through kombu's batch (a host's receiver of the publish
    # signal sends them that way) and through the template
    jobs = [(str(uuid.uuid4()), args, kwargs), (str(uuid.uuid4()), [*args, 1], kwargs)]

    def host_receiver(**_: Any) -> None:
        pass

    before_task_publish.connect(host_receiver, weak=False)
    try:
        assert broker.publish_many(task=tasks.prioritized, jobs=jobs, priority=7, queue=QUEUE) == 2
    finally:
        before_task_publish.disconnect(host_receiver)
    kombus = popped()
    assert broker.publish_many(task=tasks.prioritized, jobs=jobs, priority=7, queue=QUEUE) == 2
    ours = popped()

    # then: the same messages, the arguments as given
    assert [comparable(m) for m in ours] == [comparable(m) for m in kombus]
    assert [comparable(m)["body"][:2] for m in ours] == [[a, k] for _, a, k in jobs]


def test_a_fan_out_whose_headers_replace_a_field_sends_builds_messages(
    empty_queue: None, celery_sends: list[str]
) -> None:
    # when: a fan-out whose trace carrier holds an "argsrepr" (no template: build() per job)
    jobs = [(str(uuid.uuid4()), [n], {"label": "a"}) for n in range(3)]
    carrier = {"argsrepr": "hidden"}
    sent = broker.publish_many(
        task=tasks.prioritized, jobs=jobs, priority=7, queue=QUEUE, headers=carrier
    )

    # then: every message sent on the short path, with the carrier's header as build() puts it
    assert sent == 3 and celery_sends == []
    ours = popped()
    assert [m["headers"]["id"] for m in ours] == [job_id for job_id, _, _ in jobs]
    assert {m["headers"]["argsrepr"] for m in ours} == {"hidden"}


def test_a_job_with_an_eta_goes_through_celery(empty_queue: None, celery_sends: list[str]) -> None:
    # when: a job due later is published (the relay publishes due jobs; an eta is Celery's)
    job_id = str(uuid.uuid4())
    eta = datetime.now(UTC) + timedelta(minutes=5)
    assert broker.publish(
        task=tasks.prioritized,
        job_id=job_id,
        args=[job_id],
        kwargs={"label": "later"},
        queue=QUEUE,
        priority=7,
        eta=eta,
    )

    # then: Celery's send_task wrote it, with its eta
    [message] = popped()
    assert celery_sends == [job_id]
    assert message["headers"]["eta"] == eta.isoformat()


def test_a_task_declaring_an_expiry_goes_through_celery(
    empty_queue: None, celery_sends: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # given: a task whose messages expire (Task.expires, which Celery's apply_async applies)
    task = tasks.prioritized._get_current_object()  # type: ignore[attr-defined]
    monkeypatch.setattr(task, "expires", 600, raising=False)
    monkeypatch.setattr(task, "_exec_options", None, raising=False)  # Celery's cache of them

    # when: one job and a fan-out are published
    job_id = str(uuid.uuid4())
    assert publish_one(job_id, kwargs={"label": "a"})
    fanned = [(str(uuid.uuid4()), [str(n)], {"label": "a"}) for n in range(2)]
    assert broker.publish_many(task=task, jobs=fanned, priority=7, queue=QUEUE) == 2

    # then: the single job took Celery's path and carries its expiry; the fan-out took
    # kombu's batch, as before the short path
    messages = popped()
    assert celery_sends == [job_id]
    by_id = {m["headers"]["id"]: m for m in messages}
    assert by_id[job_id]["headers"]["expires"] is not None
    assert set(by_id) == {job_id, *(i for i, _, _ in fanned)}
