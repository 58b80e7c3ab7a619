"""Beat: fires only while it holds the leader lock in Redis, and each fire time only once.

Two beats (an overlapping deploy, a second replica by mistake) would fire every schedule
twice. Each beat tries to take or renew a Redis key with an expiry on every tick; only the
holder fires. A dead leader's key expires and another beat takes over within the TTL.

The lock alone is not enough: the next leader reads django-celery-beat's ``last_run_at``,
which beat saves only every 3 minutes, so a leader killed right after firing 09:00 would let
the next one fire 09:00 again; a leader stopped past its TTL that wakes mid-tick, or a clock
stepped back, would too. So every fire is recorded: a ScheduleFire row keyed by (schedule,
fire time), computed the same way by every beat (jobs.core.fire_times), inserted in the same
transaction as the ledger row of the job it fires, before its message is sent (the platform's
outbox sends it after commit, or the relay does). A second insert of the same time fails on
the unique pair and fires nothing. A plain Celery task (no ledger row) is sent after the
record commits: at most once per fire time.

A fire time that passed while no beat ran (found more than ``catch_up_grace`` late) is fired
once when beat is back under BACKLOT['SCHEDULE_CATCH_UP'] = "run_once" (the latest missed
time only), and left under "skip".
"""

from __future__ import annotations

import datetime as dt
import heapq
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from typing import Any

from celery.beat import SchedulingError, event_t
from celery.schedules import schedstate
from celery.utils.time import maybe_make_aware
from django.db import IntegrityError, transaction
from django.db.models import Q
from django.utils import timezone
from django_celery_beat.clockedschedule import clocked
from django_celery_beat.schedulers import SCHEDULE_SYNC_MAX_INTERVAL, DatabaseScheduler
from django_celery_beat.utils import NEVER_CHECK_TIMEOUT

from jobs.broker.redis import redis_client, redis_text
from jobs.core import fire_times
from jobs.core.conf import backlot_settings
from jobs.models.schedule import ScheduleFire
from jobs.worker.task import PlatformTask

logger = logging.getLogger(__name__)

LOCK_KEY = "backlot:beat:leader"
# When the leader last finished a tick (a Unix time): /metrics' beat heartbeat.
LAST_TICK_KEY = "backlot:beat:last_tick"
# Take the lock if free, or renew it if it is ours; 1 = we lead.
_LEAD = """
local holder = redis.call('GET', KEYS[1])
if holder == false or holder == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[1], 'EX', tonumber(ARGV[2]))
  return 1
end
return 0
"""
# The platform's own sweeps (jobs.worker.celery.platform_beat_schedule) fire every few seconds and
# a second run of one is harmless by design: they fire without a record (one each would be
# ~20,000 rows a day).
UNRECORDED_TASKS = frozenset({"jobs.relay", "jobs.health_watch"})
# Superseded fire records are deleted at most this often (s), by the leader.
PRUNE_EVERY = 3600.0


class LeaderDatabaseScheduler(DatabaseScheduler):
    # The Redis key of the leader lock (one per Redis: every beat of a project shares it).
    lock_key = LOCK_KEY

    def __init__(
        self, *args: Any, clock: Callable[[], dt.datetime] | None = None, **kwargs: Any
    ) -> None:
        conf = backlot_settings()
        self.identity = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.lock_ttl = int(conf.BEAT_LOCK_TTL)
        self.leading = False
        # The time fire times are computed against (aware); tests pass a controlled clock.
        self.clock = clock or timezone.now
        self.catch_up = conf.SCHEDULE_CATCH_UP
        # A fire time found later than this is a missed one (beat was down), not a fire
        # delayed by a tick or a leader change (which takes up to 4/3 of the lock's TTL).
        self.catch_up_grace = dt.timedelta(seconds=max(60.0, 3.0 * self.lock_ttl))
        # The last fire time of each schedule, as recorded (refreshed with the schedule).
        self.last_fires: dict[str, dt.datetime] = {}
        self._pruned_at = 0.0
        super().__init__(*args, **kwargs)
        if not kwargs.get("lazy"):  # (celery beat makes a lazy one for its banner too)
            logger.info(
                "Beat %s started (missed fire times: %s)",
                self.identity,
                "run once" if self.catch_up == "run_once" else "skipped",
            )

    # --- leading ---------------------------------------------------------------------
    def lead(self) -> bool:
        try:
            leading = bool(
                redis_client().eval(_LEAD, 1, self.lock_key, self.identity, self.lock_ttl)
            )
        except Exception as exc:  # noqa: BLE001 - no Redis, no way to know who leads: do not fire
            logger.warning("Beat cannot reach Redis for the leader lock: %s", exc)
            leading = False
        if leading != self.leading:
            logger.warning(
                "Beat %s %s the leader", self.identity, "is now" if leading else "is no longer"
            )
            self.leading = leading
        return leading

    def tick(self, *args: Any, **kwargs: Any) -> float:
        # Renew well inside the TTL; a follower looks again as often.
        check_again = self.lock_ttl / 3
        if not self.lead():
            return check_again
        next_tick = min(super().tick(*args, **kwargs), check_again)
        try:
            redis_client().set(LAST_TICK_KEY, repr(time.time()))
        except Exception as exc:  # noqa: BLE001 - a missed heartbeat must not stop the schedules
            logger.warning("Beat could not record its tick: %s", exc)
        self._prune()
        return next_tick

    def close(self) -> None:
        if self.leading:
            try:
                holder = redis_client().get(self.lock_key)
                if holder and redis_text(holder) == self.identity:
                    redis_client().delete(self.lock_key)  # hand over at once on a clean stop
            except Exception:  # noqa: BLE001 - best effort: the lock expires anyway, close goes on
                pass
        super().close()

    # --- reading the schedule ----------------------------------------------------------
    def enabled_models_qs(self) -> Any:
        # django-celery-beat leaves out crontabs whose hour is more than 2 hours from now (a
        # speed-up for thousands of them); a missed fire time is caught up only if its schedule
        # is read, so every enabled one is. Far-off clocked ones are still left to a later read.
        later = timezone.now() + dt.timedelta(seconds=SCHEDULE_SYNC_MAX_INTERVAL)
        return self.Model.objects.enabled().exclude(
            Q(clocked__isnull=False, clocked__clocked_time__gt=later)
        )

    def all_as_schedule(self) -> dict[str, Any]:
        entries = super().all_as_schedule()
        try:
            self.last_fires = ScheduleFire.objects.last_fires(list(entries))
        except Exception as exc:  # noqa: BLE001 - every fire reads its record again anyway
            logger.warning("Beat could not read the schedules' last fires: %s", exc)
        return entries

    # --- when an entry is due ----------------------------------------------------------
    def recorded(self, entry: Any) -> bool:
        """Whether `entry` fires through a fire record (all but the platform's sweeps)."""
        return entry.task not in UNRECORDED_TASKS and hasattr(entry, "model")

    def last_fire(self, entry: Any, recorded: dt.datetime | None) -> dt.datetime | None:
        """Where the entry's next fire time counts from: its last recorded fire, else the
        run django-celery-beat knows of (a clocked schedule has only its one time)."""
        if recorded is not None:
            return recorded
        if isinstance(entry.schedule, clocked) or entry.last_run_at is None:
            return None
        return maybe_make_aware(entry.last_run_at)

    def is_due(self, entry: Any) -> schedstate:
        """Celery's (is_due, seconds to the next check), from the entry's fire times."""
        model = getattr(entry, "model", None)
        if not self.recorded(entry) or model is None or self._held_back(entry):
            return entry.is_due()  # disabled, not started, expired: Celery's answer
        now = self.clock()
        last = self.last_fire(entry, self.last_fires.get(entry.name))
        if model.one_off and entry.name in self.last_fires:
            return schedstate(False, NEVER_CHECK_TIMEOUT)
        due = fire_times.fire_time(entry.schedule, now=now, last=last)
        following = fire_times.next_fire_time(entry.schedule, now=now, last=due or last)
        wait = NEVER_CHECK_TIMEOUT if following is None else (following - now).total_seconds()
        return schedstate(due is not None, max(wait, 0.0))

    def _held_back(self, entry: Any) -> bool:
        model = entry.model
        now = timezone.now()
        return (
            not model.enabled
            or (model.start_time is not None and now < model.start_time)
            or (model.expires is not None and now >= model.expires)
            or (model.one_off and model.total_run_count > 0)
        )

    def populate_heap(self, event_t: Any = event_t, heapify: Any = heapq.heapify) -> None:
        # Celery's, asking self.is_due (fire times) rather than each entry.
        self._heap = []
        for entry in self.schedule.values():
            try:
                is_due, next_call_delay = self.is_due(entry)
            except Exception:  # noqa: BLE001 - one bad entry must not stop the others
                is_due, next_call_delay = self._is_due_failed(entry)
            self._heap.append(
                event_t(self._when(entry, 0 if is_due else next_call_delay) or 0, 5, entry)
            )
        heapify(self._heap)

    # --- firing ------------------------------------------------------------------------
    def apply_async(
        self, entry: Any, producer: Any = None, advance: bool = True, **kwargs: Any
    ) -> Any:
        if not self.recorded(entry):
            return super().apply_async(entry, producer=producer, advance=advance, **kwargs)
        entry = self.reserve(entry) if advance else entry
        try:
            return self.fire(entry, producer=producer)
        except Exception as exc:
            raise SchedulingError(f"Couldn't apply scheduled task {entry.name}: {exc}") from exc
        finally:
            self._tasks_since_sync += 1
            if self.should_sync():
                self._do_sync()

    def fire(self, entry: Any, producer: Any = None) -> Any:
        """Fire the entry's due fire time once: record it and accept its job in one
        transaction; nothing when another beat recorded it first (or it was missed and the
        policy is "skip"). Returns the job's AsyncResult, or None."""
        name, now = entry.name, self.clock()
        fire_at: dt.datetime | None = None
        try:
            with transaction.atomic():
                recorded = ScheduleFire.objects.last_fire_at(name)
                known = [at for at in (recorded, self.last_fires.get(name)) if at is not None]
                fire_at = fire_times.fire_time(
                    entry.schedule, now=now, last=self.last_fire(entry, max(known, default=None))
                )
                if fire_at is None:
                    if recorded is not None:
                        self.last_fires[name] = recorded
                    logger.info("Schedule %s: not due (last fired %s)", name, recorded)
                    return None
                late = now - fire_at > self.catch_up_grace
                if late and self.catch_up == "skip":
                    self.last_fires[name] = fire_at
                    logger.warning(
                        "Schedule %s: fire time %s was missed while no beat ran; skipped "
                        "(BACKLOT['SCHEDULE_CATCH_UP'] = 'skip')",
                        name,
                        fire_at.isoformat(),
                    )
                    return None
                job_id = str(uuid.uuid4())
                # fired_at by the clock that found the time due (and late or not), as fire_at
                ScheduleFire.objects.create(
                    schedule=name, fire_at=fire_at, fired_at=now, job_id=job_id, beat=self.identity
                )
                result = self._send(entry, job_id, producer)
        except IntegrityError:
            if fire_at is not None:
                self.last_fires[name] = fire_at
            logger.info(
                "Schedule %s: fire time %s was already fired by another beat",
                name,
                fire_at and fire_at.isoformat(),
            )
            return None
        self.last_fires[name] = fire_at
        logger.log(
            logging.WARNING if late else logging.INFO,
            "Schedule %s: fired %s as job %s%s",
            name,
            fire_at.isoformat(),
            job_id,
            " (caught up: it was missed while no beat ran)" if late else "",
        )
        return result

    def _send(self, entry: Any, job_id: str, producer: Any) -> Any:
        args, kwargs = list(entry.args), dict(entry.kwargs)  # JSON from the database
        options = dict(entry.options)
        options["headers"] = {**options.get("headers", {}), "celery_beat_task": True}
        task = self.app.tasks.get(entry.task)
        if isinstance(task, PlatformTask):
            # Its ledger row joins this transaction; its message goes after commit (the relay
            # sends it if this process dies first).
            return task.apply_async(args, kwargs, task_id=job_id, producer=producer, **options)

        def send() -> None:
            if task is not None:
                task.apply_async(args, kwargs, task_id=job_id, producer=producer, **options)
            else:
                self.send_task(entry.task, args, kwargs, task_id=job_id, **options)

        transaction.on_commit(send, robust=True)  # no ledger row: sent once the record is in
        return None

    def _prune(self) -> None:
        if time.monotonic() - self._pruned_at < PRUNE_EVERY:
            return
        self._pruned_at = time.monotonic()
        days = backlot_settings().JOB_RETENTION_DAYS
        try:
            deleted, _ = ScheduleFire.objects.prunable(
                timezone.now() - dt.timedelta(days=days)
            ).delete()
        except Exception as exc:  # noqa: BLE001 - pruning is housekeeping: try again later
            logger.warning("Beat could not prune old schedule fires: %s", exc)
            return
        if deleted:
            logger.info("Beat pruned %s schedule fire(s) older than %s days", deleted, days)
