"""One job's message straight to Redis: Backlot's own protocol-2 builder and one pipelined
round trip (the message's LPUSH and its queue's doorbell), without Celery's send_task and
kombu's Producer in between.

Celery's path builds the same message through the router, the exec options, the producer
pool, the Producer, the channel's prepare/augment steps and the transport's put: ~1,800
Python calls and a new redis-py client object per message (measured, cProfile, Celery 5.7),
which is most of what a ledger-on enqueue costs beyond its INSERT. What a worker reads is the
same, field for field (tests/jobs/broker/test_protocol.py compares the two in Redis).

The short path is taken only where it is the same message: Redis transport, protocol 2, JSON
without compression, a due job (no eta) of a task without an expiry of its own (Task.expires)
on a declared direct-exchange queue without TTLs, only the options below, no sent events, and
no receiver of before_task_publish/after_task_publish but Backlot's own (a host's tracing or
auditing receiver must see every message). Anything else goes through Celery's apply_async, as
before (jobs.broker.broker.publish decides).
"""

from __future__ import annotations

import base64
import binascii
import functools
import os
import socket
import threading
import uuid
from bisect import bisect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from json.encoder import encode_basestring_ascii
from typing import Any

import hiredis
import redis
from celery.backends.base import Backend
from celery.signals import after_task_publish, before_task_publish
from kombu.utils.json import JSONEncoder, dumps

from jobs.broker import unanswered
from jobs.core import jsontext
from jobs.core.conf import backlot_settings

# The publish options a short-path message can carry; any other (link, expires, shadow,
# stamps, countdown...) takes Celery's path.
SHORT_OPTIONS = frozenset(
    {"retries", "headers", "argsrepr", "kwargsrepr", "time_limit", "soft_time_limit"}
)
# Receivers of the publish signals that the short path stands in for: Backlot's message
# slimming (jobs.worker.signals), which the builder below does itself.
OWN_RECEIVER_MODULES = frozenset({"jobs.worker.signals"})
# A queue's doorbell (jobs.broker.fetch): a token pushed with each of its task messages, which a
# consumer waiting for one pops; at most BELL_CAP wait (they carry nothing).
BELL = "backlot:bell:"
BELL_CAP = 100
# A message's embed: no callbacks, errbacks, chain or chord (those take Celery's path).
_EMBED = {"callbacks": None, "errbacks": None, "chain": None, "chord": None}


@dataclass(frozen=True)
class Route:
    """Where a queue's messages go in the broker's Redis, read once from kombu's channel."""

    client: redis.Redis
    prefix: str
    sep: str
    steps: tuple[int, ...]
    min_priority: int
    max_priority: int
    delivery_mode: int

    def list_key(self, priority: int) -> str:
        """kombu's list for a message of this broker priority (Channel._q_for_pri)."""
        level = max(min(priority, self.max_priority), self.min_priority)
        step = self.steps[bisect(self.steps, level) - 1]
        return f"{self.sep}{step}" if step else ""


_lock = threading.Lock()
_routes: dict[tuple[int, int, str], Route | None] = {}
_signals_seen: dict[int, tuple[int, bool]] = {}


def _only_own_receivers(signal: Any, sender: str) -> bool:
    """Whether every receiver of `signal` for `sender` is Backlot's own (re-read whenever the
    number of receivers changes)."""
    count = len(signal.receivers)
    seen = _signals_seen.get(id(signal))
    if seen is not None and seen[0] == count:
        return seen[1]
    receivers = signal._live_receivers(sender)  # Celery's own resolution of weak receivers
    own = all(getattr(r, "__module__", None) in OWN_RECEIVER_MODULES for r in receivers)
    _signals_seen[id(signal)] = (count, own)
    return own


def route(app: Any, queue: str) -> Route | None:
    """The Redis route of `queue` for the short path, or None where it does not apply."""
    key = (id(app), os.getpid(), queue)
    try:
        return _routes[key]
    except KeyError:
        pass
    with _lock:
        if key not in _routes:
            _routes[key] = _read_route(app, queue)
    return _routes[key]


def _read_route(app: Any, queue: str) -> Route | None:
    conf = app.conf
    if (
        conf.task_protocol != 2
        or conf.task_send_sent_event
        or conf.task_compression
        or conf.task_serializer != "json"
    ):
        return None
    if type(app.backend).on_task_call is not Backend.on_task_call:
        return None  # a backend that acts on each call (rpc://) needs Celery's send_task
    declared = app.amqp.queues.get(queue)
    if declared is None or declared.exchange is None or declared.exchange.type != "direct":
        return None
    arguments = declared.queue_arguments or {}
    if declared.expires or declared.message_ttl or "x-expires" in arguments:
        return None  # kombu's put refreshes a queue's expiry with every message
    with app.pool.acquire(block=True, timeout=5) as connection:
        if connection.transport.driver_type != "redis":
            return None
        channel = connection.default_channel
        if getattr(channel, "body_encoding", None) != "base64":
            return None
        pool = channel.client.connection_pool
        if type(pool) is not redis.ConnectionPool:
            return None  # Sentinel's pool follows its master: Celery's path keeps it
        return Route(
            client=redis.Redis(connection_pool=_blocking_pool(pool, conf)),
            prefix=channel.global_keyprefix or "",
            sep=channel.sep,
            steps=tuple(channel.priority_steps),
            min_priority=channel.min_priority,
            max_priority=channel.max_priority,
            delivery_mode=getattr(declared.exchange, "delivery_mode", None) or 2,
        )


def _blocking_pool(pool: redis.ConnectionPool, conf: Any) -> redis.BlockingConnectionPool:
    """A pool of the short path's own on the broker's connection parameters, which waits for a
    free connection as Celery's producer pool does (kombu's channel pool raises "Too many
    connections" past its 10 when more threads publish at once): broker_pool_limit connections
    (kombu's 10 where it is unlimited), broker_pool_acquire_timeout to wait (10 s if unset)."""
    limit = conf.broker_pool_limit or pool.max_connections
    return redis.BlockingConnectionPool(
        connection_class=pool.connection_class,
        max_connections=max(limit, pool.max_connections),
        timeout=conf.broker_pool_acquire_timeout or 10,
        **pool.connection_kwargs,
    )


def takes(task: Any, options: Mapping[str, Any], eta: Any) -> bool:
    """Whether this publish may take the short path (the queue is checked by route())."""
    return (
        eta is None
        # a task's own expiry: Celery's apply_async writes it into every message
        and getattr(task, "expires", None) is None
        and options.keys() <= SHORT_OPTIONS
        and getattr(task, "serializer", "json") == "json"
        and not getattr(task, "compression", None)
        and _only_own_receivers(before_task_publish, task.name)
        and _only_own_receivers(after_task_publish, task.name)
    )


@functools.cache
def _origin(pid: int) -> str:
    """Celery's anon_nodename(): the publishing process, gen<pid>@<host>."""
    return f"gen{pid}@{socket.gethostname()}"


def build(
    *,
    task: Any,
    job_id: str,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    queue: str,
    priority: int,
    delivery_mode: int,
    options: Mapping[str, Any],
    parent: Any = None,
) -> dict[str, Any]:
    """The message as kombu's Redis transport stores it: Celery's protocol-2 headers (those at
    their default left out, as jobs.broker.broker.slim_message leaves them), the body
    [args, kwargs, embed] in base64, and the delivery properties."""
    headers: dict[str, Any] = {
        "task": task.name,
        "id": job_id,
        "timelimit": [
            options.get("time_limit", task.time_limit),
            options.get("soft_time_limit", task.soft_time_limit),
        ],
        "argsrepr": options["argsrepr"],
        "kwargsrepr": options["kwargsrepr"],
        "origin": _origin(os.getpid()),
    }
    retries = options.get("retries")
    if retries:
        headers["retries"] = retries
    if parent is not None:  # as send_task: the running task is the message's parent
        request = parent.request
        root_id = request.root_id or request.id
        if root_id and root_id != job_id:
            headers["root_id"] = root_id
        if request.id:
            headers["parent_id"] = request.id
    if task.ignore_result:
        headers["ignore_result"] = True
    if options.get("headers"):
        headers.update(options["headers"])
    body = dumps([list(args), dict(kwargs), _EMBED])
    return {
        "body": base64.b64encode(body.encode("utf-8")).decode("ascii"),
        "content-encoding": "utf-8",
        "content-type": "application/json",
        "headers": headers,
        "properties": {
            "delivery_mode": delivery_mode,
            "delivery_info": {"exchange": "", "routing_key": queue},
            "priority": priority,
            "body_encoding": "base64",
            "delivery_tag": str(uuid.uuid4()),
        },
    }


@dataclass(frozen=True)
class Template:
    """A fan-out's messages as text, built once by build() and kombu's dumps with the fields
    that differ from message to message left open: the body (the job's args and kwargs), the
    id, the argsrepr and kwargsrepr headers and the delivery tag. fill() gives each message the
    text build() and push_many() would give it, byte for byte: with push_texts(), 19 Python
    calls a message (8 of them the masked reprs) where build() and push_many() took 42
    (cProfile of 10,000: the message's dict, two kombu dumps each building its encoder, a
    uuid4 per tag, redis-py's per-argument encoding)."""

    text: str  # the message's JSON with %(body)s, %(id)s, %(argsrepr)s, %(kwargsrepr)s, %(tag)s


# The body's third element, the same in every short-path message (kombu's dumps of _EMBED).
_EMBED_TEXT = dumps(_EMBED)
# A short-path body holds plain JSON (payload_check); kombu's encoder hook stays for the rest.
_body_dumps = jsontext.dumper(JSONEncoder().default)
# A uuid4's variant nibble (RFC 4122: 10xx) from any random hex digit.
_VARIANT = {digit: "89ab"[int(digit, 16) & 3] for digit in "0123456789abcdef"}


def message_text(message: Mapping[str, Any]) -> str:
    """A message as the text pushed on its list: kombu's dumps without the blanks after its
    separators (~30 bytes of ~580 per queued job; any JSON reader takes it, kombu's too)."""
    return dumps(message, separators=(",", ":"))


def template(
    *,
    task: Any,
    queue: str,
    priority: int,
    delivery_mode: int,
    options: Mapping[str, Any],
) -> Template | None:
    """The template of `task`'s messages on `queue` with these options (their argsrepr and
    kwargsrepr are each message's own), or None where the headers given in `options` replace
    one of the fields that differ (then each message is build()'s)."""
    marks = {name: f"backlot-{name}-{uuid.uuid4().hex}" for name in _FIELDS}
    message = build(
        task=task,
        job_id=marks["id"],
        args=[],
        kwargs={},
        queue=queue,
        priority=priority,
        delivery_mode=delivery_mode,
        options={**options, "argsrepr": marks["argsrepr"], "kwargsrepr": marks["kwargsrepr"]},
    )
    message["body"] = marks["body"]
    message["properties"]["delivery_tag"] = marks["tag"]
    text = message_text(message).replace("%", "%%")
    for name, mark in marks.items():
        if text.count(mark) != 1:
            return None
        # the id and the reprs are JSON-quoted by fill(); the base64 body and the tag need none
        opened = f"%({name})s" if name in _QUOTED else f'"%({name})s"'
        text = text.replace(f'"{mark}"', opened)
    return Template(text)


_FIELDS = ("body", "id", "argsrepr", "kwargsrepr", "tag")
_QUOTED = frozenset({"id", "argsrepr", "kwargsrepr"})


def fill(
    template: Template,
    jobs: Sequence[tuple[str, Sequence[Any], Mapping[str, Any]]],
    describe: Callable[[Any], str],
) -> list[str]:
    """Each (id, args, kwargs) job's message as push_texts() takes it: the template with the
    job's body, id, argsrepr and kwargsrepr (`describe` of its args and of its kwargs) and a
    new delivery tag (a uuid4, as kombu's)."""
    text = template.text
    quote = encode_basestring_ascii
    body_dumps = _body_dumps
    b64 = binascii.b2a_base64
    variant = _VARIANT
    embed = _EMBED_TEXT
    random = os.urandom(16 * len(jobs)).hex()
    messages = []
    at = 0
    for job_id, args, kwargs in jobs:
        # as build(): the body is [list(args), dict(kwargs), embed]
        listed = args if type(args) is list or type(args) is tuple else list(args)
        mapped = kwargs if type(kwargs) is dict else dict(kwargs)
        body = f"[{body_dumps(listed)}, {body_dumps(mapped)}, {embed}]"
        tag = (
            f"{random[at : at + 8]}-{random[at + 8 : at + 12]}-4{random[at + 13 : at + 16]}-"
            f"{variant[random[at + 16]]}{random[at + 17 : at + 20]}-{random[at + 20 : at + 32]}"
        )
        at += 32
        messages.append(
            text
            % {
                "body": b64(body.encode(), newline=False).decode("ascii"),
                "id": quote(job_id),
                "argsrepr": quote(describe(args)),
                "kwargsrepr": quote(describe(kwargs)),
                "tag": tag,
            }
        )
    return messages


def push(route: Route, queue: str, message: dict[str, Any], *, answered: bool = True) -> None:
    """The message's LPUSH on its list and its queue's bell's LPUSH and LTRIM in one packet on
    one pooled connection, their replies read back: one round trip, without redis-py's Pipeline
    (its command stack, parsing hooks and retry wrapper cost about as much Python as the LPUSH).
    The pool reconnects a connection Redis closed since; one that fails here is dropped; a
    command Redis refuses is raised once every reply is read. Either error reaches publish(),
    which leaves the job in the outbox. Not `answered`: the packet goes on this thread's
    connection whose replies are read later (jobs.broker.unanswered); a failed send raises."""
    push_many(route, queue, [message], answered=answered)


def push_many(
    route: Route, queue: str, messages: Sequence[dict[str, Any]], *, answered: bool = True
) -> None:
    """Messages of one priority on their list in one LPUSH (the first given is the first a
    consumer pops, as with one LPUSH each), with one bell token each up to BELL_CAP and the
    bell's LTRIM: one packet, one round trip, as push()."""
    if not messages:
        return
    priority = messages[0]["properties"]["priority"]
    push_texts(route, queue, priority, [message_text(m) for m in messages], answered=answered)


def push_texts(
    route: Route, queue: str, priority: int, messages: Sequence[str], *, answered: bool = True
) -> None:
    """push_many() of messages already serialized (fill()'s), all of broker `priority`, packed
    by hiredis in one call (redis-py's packer encodes each argument in Python: ~4 calls each)."""
    if not messages:
        return
    key = f"{route.prefix}{queue}{route.list_key(priority)}"
    commands: list[tuple[Any, ...]] = [("LPUSH", key, *messages)]
    if backlot_settings().ATOMIC_FETCH:  # the bell rings only for the atomic fetch
        bell = f"{route.prefix}{BELL}{queue}"
        tokens = [1] * min(len(messages), BELL_CAP)
        commands += [("LPUSH", bell, *tokens), ("LTRIM", bell, 0, BELL_CAP - 1)]
    # One bytes object, so one send: a list is sent item by item, a syscall and a packet each,
    # which cost a single enqueue ~0.1 ms (its LPUSH, bell LPUSH and LTRIM apart).
    packed = b"".join([hiredis.pack_command(c) for c in commands])
    if not answered:
        writer = unanswered.for_thread(route.client.connection_pool, "a job's message")
        return writer.send_packed(packed, len(commands))
    pool = route.client.connection_pool
    connection = pool.get_connection()
    refused: redis.ResponseError | None = None
    try:
        connection.send_packed_command([packed])
        for _ in commands:  # every reply is read, so the connection stays in step
            try:
                connection.read_response()
            except redis.ResponseError as exc:
                refused = refused or exc
    except BaseException:
        connection.disconnect()  # a reply may be left unread: the connection is not reused
        raise
    finally:
        pool.release(connection)
    if refused is not None:
        raise refused
