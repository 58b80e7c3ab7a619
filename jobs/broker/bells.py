"""The doorbells of the atomic fetch (jobs.broker.fetch): each task message kombu pushes on a
queue (Channel._put, its restores) rings the queue's bell list (`backlot:bell:<queue>`, capped)
in the pipeline of its LPUSH; a consumer whose fetch found nothing waits on the bells with BRPOP.
Installed by class patching in every process that publishes (`ring_bells()`, from
jobs.worker.celery, and jobs.broker.fetch.install); off with BACKLOT['ATOMIC_FETCH'].
"""

from __future__ import annotations

from typing import Any

from kombu.transport import redis as kombu_redis
from kombu.utils.json import dumps

from jobs.broker import running
from jobs.broker.protocol import BELL, BELL_CAP
from jobs.broker.reservations import ReservingQoS
from jobs.core.conf import backlot_settings

# kombu's Redis channel (its stubs leave the private methods out) and its own methods, which
# the patched ones fall back to.
_CHANNEL: Any = kombu_redis.Channel
_KOMBU_PUT = _CHANNEL._put
_KOMBU_RESTORE = _CHANNEL._do_restore_message


def ring_bells() -> None:
    """In every process that publishes (jobs.worker.celery): each task message kombu pushes on a
    queue rings its bell, in the same pipeline; off with BACKLOT['ATOMIC_FETCH']."""
    _CHANNEL._put = _put
    _CHANNEL._do_restore_message = _do_restore_message


def ring(pipe: Any, prefix: str, queue: str) -> None:
    """Add the bell of `queue` to a pipeline of kombu's client (whose LPUSH prefixes the key
    itself and whose LTRIM does not)."""
    pipe.lpush(f"{BELL}{queue}", 1)
    pipe.ltrim(f"{prefix}{BELL}{queue}", 0, BELL_CAP - 1)


def _rings(message: Any) -> bool:
    """Whether a message pushed on a queue rings its bell: a task message, with the setting on
    (events and remote-control replies go to consumers that keep kombu's BRPOP)."""
    try:
        task = message["headers"]["task"]
    except (KeyError, TypeError):
        return False
    return bool(task) and backlot_settings().ATOMIC_FETCH


def _put(self: Any, queue: str, message: Any, **kwargs: Any) -> None:
    """kombu's Channel._put, and the queue's bell in the same round trip."""
    if not _rings(message):
        return _KOMBU_PUT(self, queue, message, **kwargs)
    batch = kwargs.get("_publish_batch")
    if batch is not None:  # kombu buffers the message's commands; the bell's join them
        _KOMBU_PUT(self, queue, message, **kwargs)
        # One bell per message for the first BELL_CAP messages of a queue in each pipelined
        # flush, trimmed once: more would wake no more consumers than the cap lets wait, and a
        # fan-out of 1,000 messages paid two extra commands for each (+45 % Python work per
        # job, measured). kombu's count of buffered commands only grows between flushes: the
        # first message, or a count that did not grow, starts a new flush's bells.
        seen = getattr(batch, "_backlot_seen", None)
        if seen is None or batch._buffered <= seen:
            batch._backlot_rung = {}
        batch._backlot_seen = batch._buffered
        rung = batch._backlot_rung.get(queue, 0)
        if rung < BELL_CAP:
            batch.add("lpush", f"{BELL}{queue}", 1)
            if rung in (0, BELL_CAP - 1):  # trimmed at a flush's first bell and at its last:
                # the list never holds more than twice the cap, and the cap after a full flush
                batch.add("ltrim", f"{self.global_keyprefix}{BELL}{queue}", 0, BELL_CAP - 1)
            batch._backlot_rung[queue] = rung + 1
        return None
    key = self._q_for_pri(queue, self._get_message_priority(message, reverse=False))
    with self.conn_or_acquire() as client, client.pipeline(transaction=False) as pipe:
        pipe.lpush(key, dumps(message))
        if self._expires and queue in self._expires:
            for step in self.priority_steps:
                pipe.pexpire(self._q_for_pri(queue, step), self._expires[queue])
        ring(pipe, self.global_keyprefix, queue)
        pipe.execute()
    return None


def _do_restore_message(
    self: Any, payload: Any, exchange: str, routing_key: str, pipe: Any, leftmost: bool = False
) -> None:
    """kombu's restore of an unacknowledged message to its queue (a reject with requeue, a
    channel closing, the visibility timeout), ringing the queue's bell in its transaction. The
    copy goes without `born` (jobs.broker.running.unstamp): its run reads the row."""
    running.unstamp(payload)
    if isinstance(self.qos, ReservingQoS):  # a record its fetch reserved goes (unstarted)
        self.qos.unreserve(payload.get("properties", {}).get("delivery_tag"), pipe)
    _KOMBU_RESTORE(self, payload, exchange, routing_key, pipe, leftmost)
    if not _rings(payload):
        return
    try:
        queues = list(self._lookup(exchange, routing_key))
    except Exception:  # noqa: BLE001 - kombu logged it; the message waits one poll at most
        return
    for queue in queues:
        ring(pipe, self.global_keyprefix, queue)
