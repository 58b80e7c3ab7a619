"""Schedules fire once per fire time: two beats at once, a leader killed right after firing,
a missed time caught up once (or skipped), and crons inside DST's skipped and repeated hours.

The beat processes are real `celery beat` processes on the test PostgreSQL and Redis; the DST
and catch-up cases drive the same scheduler class in this process with a controlled clock,
through the real fire records and ledger rows in PostgreSQL.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo

import pytest
from celery.schedules import crontab, schedule
from django.conf import settings
from django.test import override_settings
from django.utils import timezone
from django_celery_beat.models import CrontabSchedule, IntervalSchedule, PeriodicTask

import tests.support.tasks  # noqa: F401  (tests.record, the job the schedules fire)
from config.celery import app as celery_app
from jobs.broker.redis import redis_client
from jobs.core.fire_times import cron_after, cron_before, fire_time, wall_instant
from jobs.flow.beat import LOCK_KEY, LeaderDatabaseScheduler
from jobs.models import Job, ScheduleFire
from tests.conftest import LOG_DIR, ROOT, marks, wait_until

NEW_YORK = ZoneInfo("America/New_York")
BERLIN = ZoneInfo("Europe/Berlin")
LOCK_TTL = 4  # seconds; production default is 30
BEAT = [sys.executable, "-m", "celery", "-A", "config", "beat", "--pidfile=", "-l", "INFO"]


# --- real beat processes -----------------------------------------------------------------
def start_beat(name: str, env: dict[str, str], **extra: str) -> subprocess.Popen[bytes]:
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    with open(LOG_DIR / f"beat-{name}.log", "wb") as log:
        return subprocess.Popen(
            [*BEAT, "--scheduler", "tests.support.beat:Scheduler"],
            cwd=ROOT,
            env={**env, "BACKLOT_BEAT_LOCK_TTL": str(LOCK_TTL), **extra},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def log_of(name: str) -> str:
    return (LOG_DIR / f"beat-{name}.log").read_text(errors="replace")


@pytest.fixture
def beats(worker_env: dict[str, str]) -> Iterator[Callable[..., subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []

    def start(name: str, **extra: str) -> subprocess.Popen[bytes]:
        process = start_beat(name, worker_env, **extra)
        started.append(process)
        return process

    yield start
    for process in started:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=10)


def fires(name: str) -> list[ScheduleFire]:
    return list(ScheduleFire.objects.filter(schedule=name).order_by("fire_at"))


def jobs_of(unique: str) -> list[Job]:
    return list(Job.objects.filter(task_name="tests.record", args__0=unique))


def test_two_beats_leading_at_once_fire_each_time_once(worker, beats, unique):
    # given: an every-2-seconds schedule and two beats, each with a leader lock of its own, so
    # that both lead (the lock cannot help; only the fire records can)
    name = f"every 2 s {unique}"
    PeriodicTask.objects.create(
        name=name,
        task="tests.record",
        interval=IntervalSchedule.objects.create(every=2, period=IntervalSchedule.SECONDS),
        args=json.dumps([unique, "tick"]),
        queue="default",
    )
    processes = [
        beats(f"split-{side}-{unique}", BACKLOT_TEST_BEAT_LOCK_KEY=f"test:beat:{side}:{unique}")
        for side in "ab"
    ]

    # when: both have led through several fire times, and are stopped
    wait_until(
        lambda: all("is now the leader" in log_of(f"split-{side}-{unique}") for side in "ab"),
        timeout=60,
        what="both beats to lead",
    )
    wait_until(lambda: len(jobs_of(unique)) >= 5, timeout=60, what="5 fire times")
    for process in processes:
        os.killpg(process.pid, signal.SIGTERM)
    for process in processes:
        try:  # how beat exits is not what this test reads; a loaded machine once took > 30 s
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)

    # then: each fire time (on the 2-second grid; a beat more than 2 s late on this loaded
    # machine fires the latest one) fired one job, which ran once; the beats tried the same
    # fire times and found them fired by the other
    recorded = fires(name)
    gaps = [b.fire_at - a.fire_at for a, b in itertools.pairwise(recorded)]
    assert all(gap > timedelta(0) and gap % timedelta(seconds=2) == timedelta(0) for gap in gaps)
    assert sorted(str(job.id) for job in jobs_of(unique)) == sorted(
        str(fire.job_id) for fire in recorded
    )
    wait_until(lambda: len(marks(unique)) >= len(recorded), timeout=60, what="the jobs to run")
    assert len(marks(unique)) == len(recorded)
    lost = sum(
        len(re.findall(rf"Schedule {name}: (not due|fire time \S+ was already fired)", log))
        for log in (log_of(f"split-{side}-{unique}") for side in "ab")
    )
    assert lost >= 2, "the two beats never tried the same fire time"


def test_a_leader_killed_right_after_firing_is_not_repeated_by_the_next(worker, beats, unique):
    # given: an hourly schedule that last ran an hour ago, and two beats that both read it
    # while neither could lead (the test holds the lock)
    name = f"hourly {unique}"
    last_run = timezone.now() - timedelta(hours=1, seconds=1)
    PeriodicTask.objects.create(
        name=name,
        task="tests.record",
        interval=IntervalSchedule.objects.create(every=1, period=IntervalSchedule.HOURS),
        args=json.dumps([unique, "hourly"]),
        queue="default",
        last_run_at=last_run,
    )
    redis_client().set(LOCK_KEY, "the test", ex=120)
    processes = {}
    for side in ("leader", "follower"):  # the follower reads the schedule last
        processes[side] = beats(f"{side}-{unique}")
        beat_name = f"{side}-{unique}"
        wait_until(
            lambda beat_name=beat_name: "Schedule changed" in log_of(beat_name),  # type: ignore[misc]
            timeout=60,
            what=f"the {side} to read the schedule",
        )
    [identity] = re.findall(r"Beat (\S+) started", log_of(f"leader-{unique}"))

    # when: the leader takes the lock (handed to it), fires the hour and is killed at once
    # (before beat would save last_run_at: the database keeps the hour-old run, as it does
    # for 179 of every 180 s)
    redis_client().set(LOCK_KEY, identity, ex=LOCK_TTL)
    wait_until(lambda: jobs_of(unique), timeout=60, what="the hour to fire")
    os.killpg(processes["leader"].pid, signal.SIGKILL)
    processes["leader"].wait(timeout=10)
    fired = fires(name)
    PeriodicTask.objects.filter(name=name).update(last_run_at=last_run)

    # then: the other takes over, its own copy of the schedule saying the hour is due; the
    # fire record says it fired, and nothing fires again
    wait_until(
        lambda: f"Sending due task {name}" in log_of(f"follower-{unique}"),
        timeout=LOCK_TTL + 60,
        what="the new leader to try the hour",
    )
    wait_until(
        lambda: f"Schedule {name}:" in log_of(f"follower-{unique}") or len(jobs_of(unique)) > 1,
        timeout=30,
        what="the new leader's answer",
    )
    assert f"Schedule {name}: not due" in log_of(f"follower-{unique}")
    wait_until(lambda: len(marks(unique)) >= 1, timeout=60, what="the fired job to run")
    assert fires(name) == fired and len(fired) == 1
    assert [str(job.id) for job in jobs_of(unique)] == [str(fired[0].job_id)]
    assert [label for _, label in marks(unique)] == ["hourly"]


# --- the scheduler with a controlled clock -------------------------------------------------
class Clock:
    def __init__(self, start: datetime) -> None:
        self.now = start

    def __call__(self) -> datetime:
        return self.now


def cron_task(name: str, unique: str, zone: ZoneInfo, last_run_at: datetime, **fields) -> None:
    PeriodicTask.objects.create(
        name=name,
        task="tests.record",
        crontab=CrontabSchedule.objects.create(timezone=zone, **fields),
        args=json.dumps([unique, name]),
        queue="default",
        last_run_at=last_run_at,
    )


@pytest.fixture
def beat_at() -> Iterator[Callable[[Clock], LeaderDatabaseScheduler]]:
    """Beat schedulers of this process, reading the schedule now, on a controlled clock."""
    made: list[LeaderDatabaseScheduler] = []

    def make(clock: Clock) -> LeaderDatabaseScheduler:
        made.append(LeaderDatabaseScheduler(app=celery_app, clock=clock))
        return made[-1]

    yield make
    for scheduler in made:
        scheduler.close()  # writes last_run_at now, while the test database is there


def tick(scheduler: LeaderDatabaseScheduler, name: str) -> Any:
    """What beat's tick does with one entry: fire it if due (reserve, then apply)."""
    entry = scheduler.schedule[name]
    if not scheduler.is_due(entry).is_due:
        return None
    scheduler.schedule[name] = scheduler.reserve(entry)
    return scheduler.apply_async(entry, advance=False)


def run_through(
    schedulers: list[LeaderDatabaseScheduler],
    clock: Clock,
    name: str,
    *,
    until: datetime,
    step: timedelta = timedelta(seconds=60),
) -> list[datetime]:
    """Step the clock to `until`, every beat ticking at each step; when each fire happened."""
    fired_at = []
    while clock.now < until:
        for scheduler in schedulers:
            if tick(scheduler, name) is not None:
                fired_at.append(clock.now)
        clock.now += step
    return fired_at


DST_CASES = [
    # (zone, wall time, day, the one instant it fires at)
    pytest.param(  # spring forward 02:00 EST -> 03:00 EDT: 02:30 does not exist
        NEW_YORK,
        2,
        30,
        datetime(2026, 3, 8),
        datetime(2026, 3, 8, 7, 0, tzinfo=UTC),
        id="ny-spring",
    ),
    pytest.param(  # fall back 02:00 EDT -> 01:00 EST: 01:30 happens twice
        NEW_YORK,
        1,
        30,
        datetime(2026, 11, 1),
        datetime(2026, 11, 1, 5, 30, tzinfo=UTC),
        id="ny-fall",
    ),
    pytest.param(  # 02:00 CET -> 03:00 CEST
        BERLIN,
        2,
        30,
        datetime(2026, 3, 29),
        datetime(2026, 3, 29, 1, 0, tzinfo=UTC),
        id="berlin-spring",
    ),
    pytest.param(  # 03:00 CEST -> 02:00 CET: 02:30 happens twice
        BERLIN,
        2,
        30,
        datetime(2026, 10, 25),
        datetime(2026, 10, 25, 0, 30, tzinfo=UTC),
        id="berlin-fall",
    ),
]


@pytest.mark.parametrize("zone, hour, minute, day, expected", DST_CASES)
def test_fire_time_of_a_cron_inside_the_skipped_or_repeated_hour(zone, hour, minute, day, expected):
    cron = crontab(minute=minute, hour=hour)
    cron.tz = zone  # type: ignore[misc]  # celery-types: read-only; Celery sets it
    midnight = day.replace(tzinfo=zone)

    assert cron_after(cron, midnight.astimezone(UTC)) == expected
    assert cron_before(cron, expected) == expected
    assert cron_before(cron, expected - timedelta(seconds=1)) < midnight
    # every instant of the day up to 6 h after names it as the latest, and nothing later
    later = [expected + timedelta(minutes=m) for m in range(0, 360, 7)]
    assert {cron_before(cron, moment) for moment in later} == {expected}
    assert cron_after(cron, expected) > expected + timedelta(hours=20)


def test_the_wall_clock_rule_across_dst():
    # skipped: the first instant after the jump (03:00 local); repeated: the first occurrence
    assert wall_instant(datetime(2026, 3, 8, 2, 30), NEW_YORK).astimezone(NEW_YORK).hour == 3
    assert wall_instant(datetime(2026, 3, 8, 2, 0), NEW_YORK) == wall_instant(
        datetime(2026, 3, 8, 3, 0), NEW_YORK
    )
    repeated = wall_instant(datetime(2026, 11, 1, 1, 30), NEW_YORK)
    assert repeated.astimezone(NEW_YORK).utcoffset() == timedelta(hours=-4)  # EDT, the first
    # an hourly cron on the spring-forward day: 01:30, then 03:00 (for 02:30), then 03:30
    cron = crontab(minute=30)
    cron.tz = NEW_YORK  # type: ignore[misc,assignment]  # celery-types: read-only; Celery sets it
    start = datetime(2026, 3, 8, 6, 0, tzinfo=UTC)
    seen = []
    for _ in range(3):
        after = cron_after(cron, start)
        assert after is not None
        start = after
        seen.append(start.astimezone(NEW_YORK).strftime("%H:%M"))
    assert seen == ["01:30", "03:00", "03:30"]


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("zone, hour, minute, day, expected", DST_CASES)
def test_two_beats_fire_a_dst_hour_cron_once_even_after_a_clock_step(
    zone, hour, minute, day, expected, clean_redis, unique, beat_at
):
    # given: a daily cron inside the DST hour, last run the day before; two beats on one clock
    midnight = day.replace(tzinfo=zone).astimezone(UTC)
    name = f"dst {unique}"
    cron_task(name, unique, zone, midnight - timedelta(hours=20), minute=minute, hour=hour)
    clock = Clock(midnight)
    schedulers = [beat_at(clock), beat_at(clock)]

    # when: both tick every minute through the night, then the clock steps back an hour and on
    fired_at = run_through(schedulers, clock, name, until=midnight + timedelta(hours=6))
    clock.now -= timedelta(hours=1)
    fired_at += run_through(schedulers, clock, name, until=midnight + timedelta(hours=7))

    # then: one fire, at the documented instant, one job in the ledger
    [fire] = fires(name)
    assert fire.fire_at == expected
    assert len(fired_at) == 1 and expected <= fired_at[0] < expected + timedelta(seconds=60)
    assert [str(job.id) for job in jobs_of(unique)] == [str(fire.job_id)]


@pytest.mark.clock  # its June 2026 times are fixed; the real date must not leak in
@pytest.mark.django_db(transaction=True)
def test_a_missed_fire_time_is_caught_up_once(clean_redis, unique, beat_at):
    # given: a 09:00 Berlin daily and an hourly report, last run yesterday and at 08:00; no beat
    # ran from 08:30 to 11:40
    today = datetime(2026, 6, 10, tzinfo=BERLIN)
    daily, hourly = f"daily {unique}", f"hourly {unique}"
    cron_task(daily, unique, BERLIN, today - timedelta(hours=15), minute=0, hour=9)
    cron_task(hourly, unique, BERLIN, today + timedelta(hours=8), minute=0)
    clock = Clock((today + timedelta(hours=11, minutes=40)).astimezone(UTC))

    # when: beat starts, then restarts (killed, a new one reads the schedule), then runs on
    beat = beat_at(clock)
    fired = [n for n in (daily, hourly) if tick(beat, n) is not None]
    clock.now += timedelta(minutes=5)
    again = beat_at(clock)
    refired = [n for n in (daily, hourly) if tick(again, n) is not None]
    clock.now = (today + timedelta(days=1, hours=8, minutes=59)).astimezone(UTC)
    run_through([again], clock, daily, until=clock.now + timedelta(minutes=2))

    # then: each fired once for its latest missed time (not once per missed hour), and the
    # daily one again on time the next day
    assert fired == [daily, hourly] and refired == []
    assert [f.fire_at.astimezone(BERLIN).strftime("%d %H:%M") for f in fires(daily)] == [
        "10 09:00",
        "11 09:00",
    ]
    assert [f.fire_at.astimezone(BERLIN).strftime("%d %H:%M") for f in fires(hourly)] == [
        "10 11:00"
    ]
    assert len(jobs_of(unique)) == 3
    caught_up = fires(daily)[0]
    assert caught_up.fired_at - caught_up.fire_at > timedelta(hours=2)  # fired late, once


@pytest.mark.clock  # as above
@pytest.mark.django_db(transaction=True)
def test_a_missed_fire_time_is_skipped_under_skip(clean_redis, unique, beat_at):
    today = datetime(2026, 6, 10, tzinfo=BERLIN)
    daily = f"daily {unique}"
    cron_task(daily, unique, BERLIN, today - timedelta(hours=15), minute=0, hour=9)
    clock = Clock((today + timedelta(hours=11, minutes=40)).astimezone(UTC))

    with override_settings(BACKLOT={**settings.BACKLOT, "SCHEDULE_CATCH_UP": "skip"}):
        beat = beat_at(clock)
        assert tick(beat, daily) is None  # 09:00 today was missed: left
        assert fires(daily) == [] and jobs_of(unique) == []
        # the next day, a fire found a tick late (well within the grace) is on time
        clock.now = (today + timedelta(days=1, hours=8, minutes=59)).astimezone(UTC)
        run_through([beat], clock, daily, until=clock.now + timedelta(minutes=2))

    # the next day's 09:00 fired; today's never did
    assert [f.fire_at.astimezone(BERLIN).strftime("%d %H:%M") for f in fires(daily)] == ["11 09:00"]
    assert len(jobs_of(unique)) == 1


def test_interval_fire_times_keep_their_phase():
    last = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
    hourly = schedule(timedelta(hours=1))
    assert fire_time(hourly, now=last + timedelta(minutes=59), last=last) is None
    assert fire_time(
        hourly, now=last + timedelta(hours=1, seconds=3), last=last
    ) == last + timedelta(hours=1)
    # down for five hours: the latest missed time, once
    assert fire_time(
        hourly, now=last + timedelta(hours=5, minutes=20), last=last
    ) == last + timedelta(hours=5)
    # a clock stepped back: nothing
    assert fire_time(hourly, now=last - timedelta(hours=2), last=last) is None
