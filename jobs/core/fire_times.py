"""A schedule's fire times: the instants it names, computed the same way by every beat.

Beat fires a schedule once per fire time (jobs.flow.beat records each in ScheduleFire). For that,
two beats, or one beat before and after a restart or a clock step, must agree on what the
fire time is: these functions compute it from the schedule, the current time and the last
recorded fire time only, never from when a tick happened to run.

- crontab: the latest time the crontab names at or before now, in the crontab's time zone.
  Days match as in Celery (month, day of month and day of week must all match). Across a DST
  change, a wall-clock time that does not exist (02:30 on the spring-forward day, where
  clocks jump from 02:00 to 03:00) fires once, at the first instant after the jump (03:00),
  as cron(8) does; a wall-clock time that happens twice (01:30 on the fall-back day in New
  York) fires once, at its first occurrence. Several names that land on one instant (02:00,
  02:30 and 03:00 on the spring-forward day) are one fire time.
- interval: the last recorded fire time plus a whole number of intervals, the latest at or
  before now: the schedule keeps its phase, and a beat that was down fires the latest missed
  time only.
- clocked: its one time.
- anything else (solar): the schedule's own next time after the last one, walked forward.
"""

from __future__ import annotations

import copy
from datetime import UTC, date, datetime, timedelta, tzinfo
from typing import Any

from celery.schedules import crontab, schedule

# How far a crontab search walks through the calendar: 29 February on a given weekday
# recurs within 28 years, anything else within about 5.
SEARCH_DAYS = 366 * 29
# Steps a schedule of another kind (solar) may be walked forward to reach now.
MAX_STEPS = 10_000


def wall_instant(wall: datetime, zone: tzinfo) -> datetime:
    """The UTC instant a naive wall-clock time in `zone` fires at (see the module's DST rule)."""
    first = wall.replace(tzinfo=zone, fold=0).astimezone(UTC)
    second = wall.replace(tzinfo=zone, fold=1).astimezone(UTC)
    if first <= second:  # an ordinary time, or one that happens twice: its first occurrence
        return first
    # In a gap: fold=0 reads it with the offset before the jump (an instant after it), fold=1
    # with the one after (an instant before it); the jump lies between. Find it to the second.
    before, after = second, first
    offset_after = wall.replace(tzinfo=zone, fold=1).utcoffset()
    while (after - before) > timedelta(seconds=1):
        middle = before + (after - before) / 2
        if middle.astimezone(zone).utcoffset() == offset_after:
            after = middle
        else:
            before = middle
    return after.replace(microsecond=0)


# celery-types declares neither a crontab's expanded fields (sets of ints) nor its tz.
def _zone(cron: Any) -> tzinfo:
    zone = cron.tz
    return zone if isinstance(zone, tzinfo) else UTC


def _day_matches(cron: Any, day: date) -> bool:
    return (
        day.month in cron.month_of_year
        and day.day in cron.day_of_month
        and day.isoweekday() % 7 in cron.day_of_week  # Celery's Sunday is 0
    )


def _day_instants(cron: Any, day: date, zone: tzinfo) -> list[datetime]:
    times = sorted((hour, minute) for hour in cron.hour for minute in cron.minute)
    return [wall_instant(datetime(day.year, day.month, day.day, h, m), zone) for h, m in times]


def cron_before(cron: crontab, now: datetime) -> datetime | None:
    """The latest instant `cron` names at or before `now` (UTC), or None within the search."""
    zone = _zone(cron)
    today = now.astimezone(zone).date()
    for back in range(-1, SEARCH_DAYS):  # from tomorrow: a jump may move a time across midnight
        day = today - timedelta(days=back)
        if _day_matches(cron, day):
            past = [instant for instant in _day_instants(cron, day, zone) if instant <= now]
            if past:
                return past[-1]
    return None


def cron_after(cron: crontab, now: datetime) -> datetime | None:
    """The first instant `cron` names after `now` (UTC), or None within the search."""
    zone = _zone(cron)
    today = now.astimezone(zone).date()
    for ahead in range(-1, SEARCH_DAYS):
        day = today + timedelta(days=ahead)
        if _day_matches(cron, day):
            future = [instant for instant in _day_instants(cron, day, zone) if instant > now]
            if future:
                return future[0]
    return None


def _walked(other: Any, last: datetime, now: datetime) -> tuple[datetime | None, datetime | None]:
    """(the latest time at or before now, the first after) of a schedule of another kind,
    walked forward from `last` with the schedule's own remaining_estimate."""
    fixed = copy.copy(other)
    latest: datetime | None = None
    cursor = last
    for _ in range(MAX_STEPS):
        fixed.nowfun = lambda at=cursor: at
        following = cursor + fixed.remaining_estimate(cursor)
        if following <= cursor:  # no progress: nothing more this schedule names
            return latest, None
        if following > now:
            return latest, following
        latest = cursor = following
    return latest, None


def _aware(moment: datetime) -> datetime:
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


def fire_time(sched: Any, *, now: datetime, last: datetime | None) -> datetime | None:
    """The fire time due at `now`: the latest one at or before `now` that is after `last`
    (the last one fired; None: never fired), or None when nothing is due."""
    now = _aware(now)
    last = _aware(last) if last is not None else None
    if isinstance(sched, crontab):
        latest = cron_before(sched, now)
    elif isinstance(sched, schedule):
        if last is None:
            return None  # an interval counts from its last run; Celery always has one
        every: timedelta = sched.run_every  # type: ignore[attr-defined]  # not in celery-types
        if every <= timedelta(0):
            return None
        steps = (now - last) // every
        return last + steps * every if steps >= 1 else None
    elif hasattr(sched, "clocked_time"):
        latest = _aware(sched.clocked_time) if _aware(sched.clocked_time) <= now else None
    else:
        if last is None:
            return None
        latest = _walked(sched, last, now)[0]
    if latest is None or (last is not None and latest <= last):
        return None
    return latest


def next_fire_time(sched: Any, *, now: datetime, last: datetime | None) -> datetime | None:
    """The first fire time after `now` (None: none ahead), `last` being the last fired."""
    now = _aware(now)
    last = _aware(last) if last is not None else None
    if isinstance(sched, crontab):
        return cron_after(sched, now)
    if isinstance(sched, schedule):
        every: timedelta = sched.run_every  # type: ignore[attr-defined]  # not in celery-types
        if last is None or every <= timedelta(0):
            return None
        steps = max((now - last) // every + 1, 1)
        return last + steps * every
    if hasattr(sched, "clocked_time"):
        clocked_time = _aware(sched.clocked_time)
        return clocked_time if clocked_time > now else None
    if last is None:
        return None
    return _walked(sched, last, now)[1]
