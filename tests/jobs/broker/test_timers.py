"""jobs.broker.timers: cancelled time-limit timers leave the worker's event loop (kombu's own
Timer)."""

from __future__ import annotations

from kombu.asynchronous.timer import Timer

from jobs.broker.timers import purge_cancelled


def noop() -> None:
    pass


def test_cancelled_entries_leave_the_heap_and_the_armed_ones_fire_in_order():
    timer = Timer()
    fired: list[int] = []
    armed = {}
    for n in range(1000):
        # as the prefork pool arms a soft time limit per job: far away, then cancelled
        armed[n] = timer.call_after(1740 + n, fired.append, (n,))
    keep = {7, 500, 999}
    for n, tref in armed.items():
        if n not in keep:
            tref.cancel()
    soon = timer.call_after(0, fired.append, (-1,))

    assert len(timer) == 1001
    assert purge_cancelled(timer) == 997
    assert len(timer) == 4
    assert purge_cancelled(timer) == 0

    # what is left is still a heap: the due entry first, then the armed ones by their time
    order = [event[2] for event in sorted(timer._queue)]
    assert order[0] is soon
    assert [entry.args[0] for entry in order[1:]] == [7, 500, 999]
    wait, entry = next(iter(timer))
    assert wait is None and entry is soon
    entry()
    assert fired == [-1]


def test_a_timer_with_nothing_cancelled_is_left_alone():
    timer = Timer()
    entries = [timer.call_after(60, noop) for _ in range(3)]
    queue = timer._queue
    assert purge_cancelled(timer) == 0
    assert timer._queue is queue and [e[2] for e in sorted(queue)] == entries
