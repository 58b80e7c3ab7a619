"""Soft shutdown that ends when the running jobs end, not when its timeout does.

Celery's soft shutdown (``worker_soft_shutdown_timeout``, SIGTERM remapped to SIGQUIT by
jobs.worker.celery.configure) sleeps the whole timeout inside the signal handler once any task
is running (``WorkController.wait_for_soft_shutdown``): a deploy that stops a worker whose
3-second job is running waits 30 s. While the handler sleeps, the event loop is stopped, so the
worker could not see the job end even if it looked: the pool process's result waits unread in
its pipe.

``wait_for_soft_shutdown`` here, installed on each worker of an app given to
jobs.worker.celery.configure (``install``, at Celery's ``celeryd_init``), waits at most as
long, but reads the pool processes' results meanwhile, as the event loop would (the callback
the loop registered for each result pipe: the request's success or failure, its ack), and
returns once no task is running. Nothing else runs: no new message is taken or started (the
loop is stopped, as during Celery's sleep), so a job the worker held unstarted goes back to
Redis at the cold shutdown that follows, and a job still running at the timeout is cancelled
and requeued as in Celery.

It does so only when the signal interrupted the loop while it waited in its poll (a worker
running jobs spends nearly all its time there): a signal that lands while the loop is handling
a result or a message cannot safely read another. So SIGTERM's handler (installed with Celery's
others, ``install_platform_tweaks``) puts such a signal off: it is sent again to the main thread
RETRY_SECONDS later, until it lands in the poll; after RETRIES it is handled where it lands, with
Celery's own sleep, as it is for a pool without result pipes (solo, threads).
"""

from __future__ import annotations

import logging
import os
import select
import signal
import sys
import threading
from inspect import isgenerator
from time import monotonic
from types import FrameType, MethodType
from typing import Any

from celery.worker import state

logger = logging.getLogger(__name__)

# The longest a wait for a result pipe blocks: also how late the timeout may be noticed.
POLL_SECONDS = 0.25
# Where kombu's event loop waits (each poller's poll(); epoll on Linux).
EVENT_LOOP_POLL = os.path.join("kombu", "utils", "eventio.py")
# Celery's signal handler (celery.apps.worker._shutdown_handler): the frame below it is where
# the signal interrupted the main thread.
SIGNAL_HANDLER = "_handle_request"
# A SIGTERM that lands outside the poll is sent again this much later, at most RETRIES times
# (the loop of a busy worker is back in its poll within milliseconds).
RETRY_SECONDS = 0.01
RETRIES = 200
PUT_OFF = "_put_off_till_poll"  # the name of the handler that puts a signal off


def install(worker: Any) -> None:
    """Give `worker` (Celery's worker application, before it starts) this soft shutdown."""
    worker.wait_for_soft_shutdown = MethodType(wait_for_soft_shutdown, worker)
    worker.install_platform_tweaks = MethodType(_install_platform_tweaks, worker)


def _install_platform_tweaks(worker: Any, *args: Any) -> None:
    """Celery's signal handlers, SIGTERM's wrapped to wait for the poll (put_off_till_poll)."""
    type(worker).install_platform_tweaks(worker, *args)
    handler = signal.getsignal(signal.SIGTERM)
    if callable(handler):
        signal.signal(signal.SIGTERM, put_off_till_poll(worker, handler))


def put_off_till_poll(worker: Any, handler: Any) -> Any:
    """`handler` (Celery's SIGTERM handler), called once the signal lands in the event loop's
    poll when the soft shutdown will wait for running jobs; until then the signal is sent again
    to the main thread every RETRY_SECONDS (a SIGTERM arriving meanwhile counts as one of them),
    and after RETRIES it is handled where it lands."""
    tries = [0]

    def _put_off_till_poll(signum: int, frame: FrameType | None) -> None:
        if _in_poll(frame) or tries[0] >= RETRIES or not _waits(worker):
            handler(signum, frame)
            return
        tries[0] += 1
        again = threading.Timer(
            RETRY_SECONDS, signal.pthread_kill, (threading.main_thread().ident, signum)
        )
        again.daemon = True
        again.start()

    return _put_off_till_poll


def _waits(worker: Any) -> bool:
    """Whether the soft shutdown would wait, reading the pool's results (see module doc)."""
    conf = worker.app.conf
    return (
        float(conf.worker_soft_shutdown_timeout or 0) > 0
        and not conf.worker_enable_soft_shutdown_on_idle
        and bool(state.active_requests)
        and _result_pipes(worker) is not None
    )


def wait_for_soft_shutdown(worker: Any) -> None:
    """Wait up to ``worker_soft_shutdown_timeout`` for the running tasks to end (Celery's
    rules: no wait when none runs, unless ``worker_enable_soft_shutdown_on_idle``)."""
    timeout = float(worker.app.conf.worker_soft_shutdown_timeout or 0)
    pipes = _result_pipes(worker)
    if pipes is None or not _waits(worker) or not _interrupted_in_poll(sys._getframe(1)):
        type(worker).wait_for_soft_shutdown(worker)  # Celery's own
        return
    logger.warning(
        "Initiating Soft Shutdown: waiting up to %s s for %d running task(s)",
        timeout,
        len(state.active_requests),
    )
    deadline = monotonic() + timeout
    while state.active_requests:
        left = deadline - monotonic()
        if left <= 0:
            logger.warning(
                "Soft shutdown timed out with %d task(s) running: they are requeued",
                len(state.active_requests),
            )
            return
        _read_results(worker.hub, pipes, min(left, POLL_SECONDS))
    logger.info("Soft shutdown: no task running, stopping")


def _result_pipes(worker: Any) -> dict[int, Any] | None:
    """The prefork pool's result pipes (descriptor -> process), None for another pool."""
    pool = getattr(getattr(worker, "pool", None), "_pool", None)
    pipes = getattr(pool, "_fileno_to_outq", None)
    hub = getattr(worker, "hub", None)
    if not isinstance(pipes, dict) or hub is None:
        return None
    return pipes


def _interrupted_in_poll(frame: FrameType | None) -> bool:
    """Whether the signal handler whose frames start at `frame` interrupted the event loop's
    poll (nothing of the loop's half done)."""
    while frame is not None and frame.f_code.co_name != SIGNAL_HANDLER:
        frame = frame.f_back
    interrupted = frame.f_back if frame is not None else None
    if interrupted is not None and interrupted.f_code.co_name == PUT_OFF:
        interrupted = interrupted.f_back  # put_off_till_poll's handler, called where it landed
    return _in_poll(interrupted)


def _in_poll(frame: FrameType | None) -> bool:
    """Whether `frame`, where a signal landed, is the event loop's poll."""
    return (
        frame is not None
        and frame.f_code.co_name == "poll"
        and frame.f_code.co_filename.endswith(EVENT_LOOP_POLL)
    )


def _read_results(hub: Any, pipes: dict[int, Any], timeout: float) -> None:
    """Wait up to `timeout` for a result pipe to be readable and hand each readable one to the
    reader the event loop registered for it (as kombu's Hub does)."""
    watched = [fd for fd in list(pipes) if fd in hub.readers]
    if not watched:
        select.select([], [], [], timeout)  # a pipe may be registered again; wait all the same
        return
    try:
        readable, _, _ = select.select(watched, [], [], timeout)
    except (OSError, ValueError):  # a process and its pipe gone meanwhile: look again
        return
    for fd in readable:
        entry = hub.readers.get(fd)
        if entry is None:
            continue
        callback, args = entry
        try:
            if isgenerator(callback):  # a message read in part: go on with it
                try:
                    next(callback)
                except StopIteration:
                    pass
                except (OSError, EOFError):
                    hub.remove_reader(fd)
            else:
                callback(*args)
        except Exception:  # raised out of a signal handler it would end the worker unclean
            logger.exception("Soft shutdown: reading a pool process's result failed")
            hub.remove_reader(fd)
