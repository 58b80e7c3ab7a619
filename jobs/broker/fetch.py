"""The atomic fetch: a worker takes a message from Redis and records it as taken in one step.

kombu's Redis transport takes a message in two round trips: BRPOP (the server removes it from
its list), then QoS.append's MULTI (`unacked`, `unacked_index` and, in Backlot's workers,
`backlot:reserved`). A worker killed between the two left the message in no list and in no
`unacked` entry: gone from Redis. Here, as Sidekiq Pro's super_fetch does with its per-process
list, one Lua script pops the first message of the first non-empty list in kombu's order
(priority steps first, then the channel's queue cycle) and, in the same step, writes it into
`unacked` (the value kombu writes, `[message, exchange, routing_key]`, built around the raw
message so that nothing in it is re-encoded), `unacked_index` (Redis' own clock) and
`backlot:reserved` (delivery tag → the channel's holder, jobs.broker.reservations). A message is
always somewhere: in its list, or in a holder's hands, which jobs.broker.restore gives back once the
holder's heartbeat lapses. ReservingQoS.append then only keeps it in memory.

A script cannot block, so a consumer whose fetch found nothing waits on doorbells: each task
message published through kombu (Channel._put, its restores; jobs.broker.restore's script too)
pushes a token on its queue's bell list (`backlot:bell:<queue>`, capped) in the pipeline of its
LPUSH, and the consumer sends BRPOP on its queues' bells with the transport's timeout (1 s),
then fetches again when it wakes or times out. A bell carries no data: popping one loses
nothing; a message pushed without one (another client) is taken within the timeout. A fetch that
finds the lists empty deletes their bells (any left were for messages already taken).

Installed by class patching in worker processes (`install()`, at worker_init) and, for the
bells, in every process that publishes (jobs.broker.bells, from jobs.worker.celery). A channel
without a ReservingQoS, or with a consumer that does not acknowledge (Celery's gossip, the reply
queues of remote control), keeps kombu's BRPOP. `BACKLOT['ATOMIC_FETCH'] = False` turns it all
off.
"""

from __future__ import annotations

import hashlib
import logging
import uuid
from collections.abc import Callable
from queue import Empty
from time import monotonic
from typing import Any

from kombu.transport import redis as kombu_redis
from kombu.utils.encoding import bytes_to_str
from kombu.utils.json import dumps, loads
from redis.exceptions import NoScriptError, ResponseError

from jobs.broker import bells, counters, reservations, running
from jobs.broker.protocol import BELL
from jobs.broker.reservations import OWNERS, ReservingQoS
from jobs.core.conf import backlot_settings

logger = logging.getLogger(__name__)

# KEYS: the n lists in kombu's order, then unacked, unacked_index, OWNERS, then the bells of the
# channel's queues; ARGV: n, the holder ('' for none), what rides with this fetch
# (jobs.broker.reservations.RIDE_WAIT; '' for none): the acknowledgements (a JSON list of
# delivery tags), the metric counts (jobs.broker.counters.encoded) and the acknowledged runs'
# records (jobs.broker.running.forget_args, a JSON list); then for a worker that runs its jobs
# in its own process with DEFER_CLAIM (else none): a fresh claim token, the lease and the keep
# (ms), the run records' prefix and '1' to take the record `reserved` (a prefork worker's:
# jobs.broker.running.STARTED). Settles the acknowledged messages (out of unacked,
# unacked_index and OWNERS, as kombu's ack and ReservingQoS._remove_from_indices), drops their
# runs' records and writes the counts, then pops the first message of the first non-empty list
# and records it as taken: {list's index, message, 1}; {index, message, 0} for a message it
# cannot read a delivery tag, exchange and routing key from (kombu then records it, as it would
# any); nil (and the bells deleted) when every list is empty. A stamped message
# (jobs.broker.running.BORN) has its run record taken in the same step: the reply's fourth
# element is jobs.broker.running.start's answer (RUN, below). allow-oom: a message moves from
# its list to `unacked`, so a full noeviction Redis still lets workers drain it.
_FETCH_BODY = """
local n = tonumber(ARGV[1])
if ARGV[3] ~= '' then
    for _, tag in ipairs(cjson.decode(ARGV[3])) do
        redis.call('ZREM', KEYS[n + 2], tag)
        redis.call('HDEL', KEYS[n + 1], tag)
        redis.call('HDEL', KEYS[n + 3], tag)
    end
end
if ARGV[4] ~= '' then write_counts(ARGV[4]) end
if ARGV[5] ~= '' then forget_runs(cjson.decode(ARGV[5])) end
for i = 1, n do
    local payload = redis.call('RPOP', KEYS[i])
    if payload then
        local ok, message = pcall(cjson.decode, payload)
        local properties = ok and type(message) == 'table' and message.properties
        local info = type(properties) == 'table' and properties.delivery_info
        local tag = type(properties) == 'table' and properties.delivery_tag
        if type(tag) ~= 'string' or type(info) ~= 'table'
            or type(info.exchange) ~= 'string' or type(info.routing_key) ~= 'string' then
            return {i, payload, 0}
        end
        local now = redis.call('TIME')
        redis.call('ZADD', KEYS[n + 2], tonumber(now[1]) + tonumber(now[2]) / 1000000, tag)
        redis.call('HSET', KEYS[n + 1], tag, '[' .. payload .. ',' .. cjson.encode(info.exchange)
            .. ',' .. cjson.encode(info.routing_key) .. ']')
        if ARGV[2] ~= '' then redis.call('HSET', KEYS[n + 3], tag, ARGV[2]) end
        local headers = message.headers
        if ARGV[6] and ARGV[6] ~= '' and type(headers) == 'table'
            and type(headers['{born}']) == 'table' and type(headers.id) == 'string' then
            local ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
            local key = ARGV[9] .. headers.id
            local reply = start_run(key, ARGV[6], ARGV[7], ARGV[8], ms)
            if reply == 'ok' and ARGV[10] == '1' then redis.call('HSET', key, 'reserved', '1') end
            return {i, payload, 1, reply}
        end
        return {i, payload, 1}
    end
end
for i = n + 4, #KEYS do redis.call('DEL', KEYS[i]) end
return false
""".replace("{born}", running.BORN)
# Redis 7 reads the flags; an older Redis cannot compile the first line and gets the plain body
# (in effects replication, which TIME needs there).
_FUNCTIONS = running.START_FUNCTION + running.FORGET_FUNCTION + counters.WRITE_FUNCTION
_SCRIPTS = [
    "#!lua flags=allow-oom\n" + _FUNCTIONS + _FETCH_BODY,
    "if redis.replicate_commands then redis.replicate_commands() end\n" + _FUNCTIONS + _FETCH_BODY,
]
_SHAS = [hashlib.sha1(script.encode()).hexdigest() for script in _SCRIPTS]
_variant = {"index": 0}

# kombu's Redis channel (its stubs leave the private methods out) and its own methods, which
# the patched ones fall back to.
_CHANNEL: Any = kombu_redis.Channel
_KOMBU_START = _CHANNEL._brpop_start
_KOMBU_READ = _CHANNEL._brpop_read
_KOMBU_CONSUME = _CHANNEL.basic_consume
_state = {"fetch": False, "runs": False, "ride": False}
_free: dict[str, Callable[[], bool] | None] = {"now": None}
_FETCH, _BELLS = "fetch", "bells"
# The delivery's claim token and its run record's answer (jobs.broker.running.start's), in the
# properties of a message whose record the fetch took (read by jobs.worker.request).
RUN = "backlot_run"


def enabled() -> bool:
    """BACKLOT['ATOMIC_FETCH']."""
    return backlot_settings().ATOMIC_FETCH


def install(
    *, runs: bool = False, inline: bool = False, free: Callable[[], bool] | None = None
) -> bool:
    """In a worker's main process, before it consumes (worker_init, after
    jobs.broker.reservations.install): its channels take messages with the atomic fetch. False (and
    kombu's BRPOP) when BACKLOT['ATOMIC_FETCH'] is off. `runs`: the worker runs its jobs with
    DEFER_CLAIM; a stamped message's run record is taken with it, by every fetch (-P solo) or,
    `reserved` until it is handed to the pool, by those `free` says find a process free (prefork).
    `inline`: it runs each job in its event loop's thread as it takes it (-P solo); its
    acknowledgements ride with its next fetch (jobs.broker.reservations.RIDE_WAIT)."""
    bells.ring_bells()
    _state["fetch"] = enabled()
    _state["runs"] = runs
    _free["now"] = free
    _state["ride"] = inline and _state["fetch"]
    reservations.ride_acks(_state["ride"])
    if _state["fetch"]:
        _CHANNEL._brpop_start = _brpop_start
        _CHANNEL._brpop_read = _brpop_read
        _CHANNEL.basic_consume = _basic_consume
    return _state["fetch"]


def _basic_consume(self: Any, queue: str, *args: Any, **kwargs: Any) -> Any:
    """kombu's basic_consume, remembering the queues consumed without acknowledgements: their
    messages must not be recorded as taken (nothing would acknowledge them)."""
    no_ack = kwargs.get("no_ack", args[0] if args else False)
    plain = self.__dict__.setdefault("_backlot_no_ack", set())
    if no_ack:
        plain.add(queue)
    else:
        plain.discard(queue)
    return _KOMBU_CONSUME(self, queue, *args, **kwargs)


def _fetches(channel: Any) -> bool:
    """Whether this channel takes its messages with the atomic fetch."""
    if not _state["fetch"] or not isinstance(channel.qos, ReservingQoS):
        return False
    plain = channel.__dict__.get("_backlot_no_ack")
    return not (plain and plain.intersection(channel.active_queues))


def _brpop_start(self: Any, timeout: Any = None) -> None:
    """Take the next message: the fetch script, or kombu's BRPOP (see `_fetches`)."""
    if not _fetches(self):
        self._backlot_phase = None
        _settle_riding(self)
        return _KOMBU_START(self, timeout)
    queues = self._queue_cycle.consume(len(self.active_queues))
    if not queues:
        _settle_riding(self)
        return None
    # The poller calls the handler bound when the channel was made (before install(), for a
    # channel opened that early): make it this module's.
    self.handlers["BRPOP"] = self._brpop_read
    self._backlot_queues = list(queues)
    self._backlot_wait = timeout or self.brpop_timeout or 1
    self._in_poll = self.client.connection
    _send_fetch(self)
    return None


def _send_fetch(channel: Any, *, load: bool = False) -> None:
    prefix = channel.global_keyprefix
    queues = channel._backlot_queues
    lists = [
        f"{prefix}{channel._q_for_pri(queue, step)}"
        for step in channel.priority_steps
        for queue in queues
    ]
    keys = [
        *lists,
        f"{prefix}{channel.unacked_key}",
        f"{prefix}{channel.unacked_index_key}",
        f"{prefix}{OWNERS}",
        *(f"{prefix}{BELL}{queue}" for queue in queues),
    ]
    owner = getattr(channel.qos, "owner", None) or ""
    variant = _variant["index"]
    command = ("EVAL", _SCRIPTS[variant]) if load else ("EVALSHA", _SHAS[variant])
    runs: tuple[Any, ...] = ()
    # the run records are the platform's keys: only where the broker's Redis is the platform's
    free = _free["now"]
    if _state["runs"] and channel.qos.carries_counts and (free is None or free()):
        lease = int(backlot_settings().LEASE_SECONDS * 1000)
        runs = (str(uuid.uuid4()), lease, running.KEEP_MS, running.PREFIX, "1" if free else "")
    channel._backlot_token = runs[0] if runs else None
    riders = getattr(channel, "_backlot_riders", ("", "", "")) if load else _riders(channel)
    channel._backlot_phase = _FETCH
    channel._backlot_loaded = load
    channel._brpop_sent_at = monotonic()
    channel.client.connection.send_command(
        *command, len(keys), *keys, len(lists), owner, *riders, *runs
    )


def _riders(channel: Any) -> tuple[str, str, str]:
    """The acknowledgements, their runs' records and the metric counts that ride with this
    fetch (a solo worker's: jobs.broker.reservations.RIDE_WAIT), as the script's arguments;
    kept on the channel for a fetch sent again in full (its first send never ran: NoScriptError,
    an old Redis)."""
    tags: list[str] = []
    counts = None
    forget = ""
    if _state["ride"]:
        qos = channel.qos
        tags = qos.take_riding()
        ended = qos.ended(tags)
        if ended and qos.carries_counts:
            forget = dumps(running.forget_args(ended))
        elif ended:
            reservations.forget_elsewhere(ended)
        # the counts go with acknowledgements (a success's ack waits for its row's write:
        # jobs.worker.finishes), not with a fetch that settles none
        counts = counters.take() if qos.carries_counts and tags else None
    riders = (dumps(tags) if tags else "", counters.encoded(counts) if counts else "", forget)
    channel._backlot_riders = riders
    return riders


def _settle_riding(channel: Any) -> None:
    """The acknowledgements waiting for a fetch that this channel will not send now."""
    if isinstance(channel.qos, ReservingQoS):
        channel.qos.settle_riding()


def _send_bells(channel: Any) -> None:
    prefix = channel.global_keyprefix
    bells = [f"{prefix}{BELL}{queue}" for queue in channel._backlot_queues]
    channel._backlot_phase = _BELLS
    channel._brpop_sent_at = monotonic()
    channel.client.connection.send_command("BRPOP", *bells, channel._backlot_wait)


def _brpop_read(self: Any, **options: Any) -> bool:
    """The reply to what `_brpop_start` sent: a message is delivered (it is already recorded
    as this holder's); an empty fetch sends BRPOP on the bells; a bell or its timeout ends the
    round (the next poll fetches again). A script Redis lost (a restart, SCRIPT FLUSH) is sent
    again in full; connection errors disconnect and raise, as kombu's BRPOP does."""
    phase = getattr(self, "_backlot_phase", None)
    if phase is None:
        return bool(_KOMBU_READ(self, **options))
    pending = False
    try:
        try:
            reply = self.client.parse_response(
                self.client.connection, "EVALSHA" if phase == _FETCH else "BRPOP", **options
            )
        except NoScriptError:
            if not self._closing:  # a closing channel reads its last reply and sends nothing
                _send_fetch(self, load=True)
                pending = True
            raise Empty() from None
        except self.connection_errors:
            self.client.connection.disconnect()
            raise
        except ResponseError as exc:
            if phase == _FETCH and _variant["index"] == 0 and "compiling" in str(exc).lower():
                _variant["index"] = 1  # a Redis before 7 reads no flags
                _send_fetch(self, load=True)
                pending = True
                raise Empty() from None
            self.client.connection.disconnect()
            raise
        if phase == _BELLS:
            raise Empty()
        if not reply:
            if not self._closing:
                _send_bells(self)
                pending = True
            raise Empty()
        index, payload, recorded, *run = reply
        queues = self._backlot_queues
        queue = queues[(int(index) - 1) % len(queues)]
        message = loads(bytes_to_str(payload))
        if run and self._backlot_token:  # its run record, taken with it
            message["properties"][RUN] = [self._backlot_token, answer := bytes_to_str(run[0])]
            if _free["now"] and answer == "ok":  # reserved: the message's until it is handed
                self.qos.reserve(message, self._backlot_token)
        self._queue_cycle.rotate(queue)
        if int(recorded):
            self.qos.fetched(message["properties"]["delivery_tag"])
        self.connection._deliver(message, queue)
        if self.qos.reserved:  # delivered, not handed back: the record says started
            self.qos.handed(message["properties"]["delivery_tag"])
        return True
    finally:
        if not pending:
            self._in_poll = None
            self._backlot_phase = None
            flush = getattr(self, "_flush_brpop_reauth", None)
            if flush is not None:
                flush()
