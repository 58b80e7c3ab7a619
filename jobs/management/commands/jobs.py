"""manage.py jobs status|retry|discard|cancel|pause|resume|purge|relay: the operator's terminal
tools."""

from __future__ import annotations

import json
import logging
import signal
import time
from typing import Any

from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import close_old_connections
from django.utils.dateparse import parse_datetime
from redis.exceptions import RedisError

from jobs.broker.pausing import pause, resume
from jobs.broker.redis import redis_client
from jobs.core.masking import mask_text
from jobs.flow.cancellation import cancel_many
from jobs.flow.deadletters import audit, dead_letter_discard_many, dead_letter_replay_many
from jobs.flow.relay import job_relay
from jobs.flow.retention import retention_purge
from jobs.models import DeadLetter, Job
from jobs.web.dashboard import dashboard_data

logger = logging.getLogger(__name__)
# When the relay last finished a sweep (a Unix time); read by `jobs relay --alive`.
RELAY_HEARTBEAT = "backlot:relay:heartbeat"

COLUMNS = [
    ("queue", "name"),
    ("state", "state"),
    ("waiting", "waiting"),
    ("sched", "scheduled"),
    ("parked", "parked"),
    ("running", "running"),
    ("dead", "dead_letters"),
    ("done 1h", "completed_last_hour"),
    ("failed 1h", "failed_last_hour"),
    ("per min", "throughput_per_minute"),
    ("oldest s", "oldest_wait_seconds"),
]


class Command(BaseCommand):
    help = "Queue status, bulk retry or discard of dead letters, and retention."
    # An operator's command prints its own answer only: the system checks (warnings such as
    # an empty METRICS_TOKEN, and a worker ping) belong to `manage.py check` and the deploy,
    # not in front of every `jobs status` (Django runs them all, printing each warning).
    requires_system_checks: list[str] = []

    def add_arguments(self, parser: CommandParser) -> None:
        sub = parser.add_subparsers(dest="action", required=True)
        status = sub.add_parser("status", help="Queues, workers and health.")
        status.add_argument("--json", action="store_true", help="Print JSON for scripts.")
        status.add_argument(
            "--watch",
            type=float,
            nargs="?",
            const=2.0,
            metavar="SECONDS",
            help="Refresh every SECONDS (default 2) until Ctrl-C.",
        )
        for name, text in (("retry", "Replay dead letters."), ("discard", "Discard dead letters.")):
            action = sub.add_parser(name, help=text)
            action.add_argument("--task")
            action.add_argument("--exception", help="Exception class, e.g. ConnectionRefusedError")
            action.add_argument("--queue")
            action.add_argument("--since", help="ISO time: failed at or after")
            action.add_argument("--until", help="ISO time: failed before")
            action.add_argument("--limit", type=int)
            action.add_argument(
                "--dry-run", action="store_true", help="Only say what would happen."
            )
        cancel = sub.add_parser(
            "cancel", help="Cancel jobs that have not ended (by id, or every one matching)."
        )
        cancel.add_argument("job_ids", nargs="*", metavar="JOB_ID")
        cancel.add_argument("--task")
        cancel.add_argument("--queue")
        cancel.add_argument("--since", help="ISO time: enqueued at or after")
        cancel.add_argument("--until", help="ISO time: enqueued before")
        cancel.add_argument("--limit", type=int)
        cancel.add_argument("--dry-run", action="store_true", help="Only say what would happen.")
        for name, text in (
            ("pause", "Stop workers taking QUEUE's jobs (enqueue still accepts them)."),
            ("resume", "Let workers take QUEUE's jobs again."),
        ):
            sub.add_parser(name, help=text).add_argument("queue", metavar="QUEUE")
        purge = sub.add_parser("purge", help="Apply retention now.")
        purge.add_argument("--dry-run", action="store_true")
        relay = sub.add_parser(
            "relay", help="Publish the outbox until stopped (a process of its own)."
        )
        relay.add_argument("--interval", type=float, default=1.0, help="Seconds between sweeps.")
        relay.add_argument("--once", action="store_true", help="One sweep, then exit.")
        relay.add_argument(
            "--alive",
            type=float,
            nargs="?",
            const=30.0,
            metavar="SECONDS",
            help="Healthcheck: exit 0 if a relay finished a sweep in the last SECONDS (30), "
            "else fail. Sweeps nothing.",
        )

    def handle(self, *args: Any, action: str, **options: Any) -> None:
        getattr(self, f"do_{action}")(**options)

    # --- status -------------------------------------------------------------------------
    def do_status(self, json: bool = False, watch: float | None = None, **_: Any) -> None:
        while True:
            data = dashboard_data()
            data.pop("chart_svg", None)
            if json:
                self.stdout.write(_json(data))
            else:
                if watch:
                    self.stdout.write("\x1b[2J\x1b[H", ending="")
                self.stdout.write(self.render(data))
            if not watch:
                return
            try:
                time.sleep(watch)
            except KeyboardInterrupt:
                return

    def render(self, data: dict[str, Any]) -> str:
        rows = [[title for title, _ in COLUMNS]] + [
            [str(q[key]) for _, key in COLUMNS] for q in data["queues"]
        ]
        widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
        lines = [f"Health: {data['health']['status']}"]
        lines += [f"  ! {p}" for p in data["health"]["problems"]]
        lines.append("")
        for index, row in enumerate(rows):
            lines.append(
                "  ".join(
                    cell.ljust(w) if i == 0 else cell.rjust(w)
                    for i, (cell, w) in enumerate(zip(row, widths, strict=True))
                )
            )
            if index == 0:
                lines.append("  ".join("-" * w for w in widths))
        lines.append("")
        workers = data["workers"]
        lines.append(f"Workers ({len(workers)}):")
        for host, detail in workers.items():
            lines.append(
                f"  {host}  queues={','.join(detail['queues'])}"
                f"  concurrency={detail['concurrency']}"
            )
        return "\n".join(lines) + "\n"

    # --- retry / discard ----------------------------------------------------------------
    def _matching(self, options: dict[str, Any]) -> Any:
        for key in ("since", "until"):
            if options.get(key) and parse_datetime(options[key]) is None:
                raise CommandError(f"--{key} must be an ISO date-time, e.g. 2026-11-29T09:00:00Z")
        filters = {
            key: options.get(key) for key in ("task", "exception", "queue", "since", "until")
        }
        queryset = DeadLetter.objects.unresolved().matching(filters)
        return queryset, {k: v for k, v in filters.items() if v}

    def _preview(self, queryset: Any, limit: int | None, verb: str) -> None:
        rows = list(
            queryset.order_by("pk")[: limit or None].values_list(
                "pk", "task_name", "exception_class", "exception_message"
            )
        )
        self.stdout.write(f"Would {verb} {len(rows)} dead letter(s):")
        for pk, task, exc, message in rows[:50]:
            self.stdout.write(f"  #{pk} {task} {exc}: {mask_text(message)[:80]}")
        if len(rows) > 50:
            self.stdout.write(f"  … and {len(rows) - 50} more")

    def do_retry(self, limit: int | None = None, dry_run: bool = False, **options: Any) -> None:
        queryset, filters = self._matching(options)
        if dry_run:
            return self._preview(queryset, limit, "replay")
        outcome = dead_letter_replay_many(queryset=queryset, limit=limit)
        audit(user=None, action="replay-cli", count=outcome.done, filters=filters)
        self.stdout.write(f"Replayed {outcome.done} dead letter(s); skipped {outcome.skipped}.")
        for error in outcome.errors or []:
            self.stderr.write(error)

    def do_discard(self, limit: int | None = None, dry_run: bool = False, **options: Any) -> None:
        queryset, filters = self._matching(options)
        if dry_run:
            return self._preview(queryset, limit, "discard")
        ids = list(queryset.order_by("pk").values_list("pk", flat=True)[: limit or None])
        count = dead_letter_discard_many(queryset=DeadLetter.objects.filter(pk__in=ids))
        audit(user=None, action="discard-cli", count=count, filters=filters)
        self.stdout.write(f"Discarded {count} dead letter(s).")

    # --- cancel -------------------------------------------------------------------------
    def do_cancel(
        self,
        job_ids: list[str],
        limit: int | None = None,
        dry_run: bool = False,
        **options: Any,
    ) -> None:
        jobs = Job.objects.active()
        filters = {key: options.get(key) for key in ("task", "queue", "since", "until")}
        if not job_ids and not any(filters.values()):
            raise CommandError("Name job ids or a filter (--task, --queue, --since, --until).")
        for key in ("since", "until"):
            if filters[key] and parse_datetime(str(filters[key])) is None:
                raise CommandError(f"--{key} must be an ISO date-time, e.g. 2026-11-29T09:00:00Z")
        try:
            if job_ids:
                jobs = jobs.filter(id__in=job_ids)
        except ValidationError as exc:
            raise CommandError(f"Not a job id: {exc.messages[0]}") from None
        if filters["task"]:
            jobs = jobs.filter(task_name=filters["task"])
        if filters["queue"]:
            jobs = jobs.filter(queue=filters["queue"])
        if filters["since"]:
            jobs = jobs.filter(enqueued_at__gte=parse_datetime(str(filters["since"])))
        if filters["until"]:
            jobs = jobs.filter(enqueued_at__lt=parse_datetime(str(filters["until"])))
        rows = list(jobs.order_by("enqueued_at").values_list("id", "task_name", "state")[:limit])
        if dry_run:
            self.stdout.write(f"Would cancel {len(rows)} job(s):")
            for job_id, task, state in rows[:50]:
                self.stdout.write(f"  {job_id} {task} ({state})")
            return
        done, ended = cancel_many([job_id for job_id, _, _ in rows])
        audit(
            user=None,
            action="cancel-cli",
            count=done,
            filters={k: v for k, v in filters.items() if v},
        )
        self.stdout.write(f"Cancelled {done} job(s); {ended} had already finished.")

    # --- pause / resume -----------------------------------------------------------------
    def do_pause(self, queue: str, **_: Any) -> None:
        try:
            changed = pause(queue)
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        audit(user=None, action="pause-cli", count=int(changed), queue=queue)
        self.stdout.write(
            f"Paused queue {queue}: workers stop taking its jobs within 2 s."
            if changed
            else f"Queue {queue} was paused already."
        )

    def do_resume(self, queue: str, **_: Any) -> None:
        try:
            changed = resume(queue)
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        audit(user=None, action="resume-cli", count=int(changed), queue=queue)
        self.stdout.write(
            f"Resumed queue {queue}." if changed else f"Queue {queue} was not paused."
        )

    # --- relay --------------------------------------------------------------------------
    def do_relay(
        self, interval: float = 1.0, once: bool = False, alive: float | None = None, **_: Any
    ) -> None:
        """Publish what the ledger holds back (outbox, due jobs, expired leases), every second."""
        if alive is not None:
            raw = redis_client().get(RELAY_HEARTBEAT)
            age = time.time() - float(raw) if raw is not None else None
            if age is None or age > alive:
                seen = "never" if age is None else f"{age:.0f}s ago"
                raise CommandError(f"relay: last sweep {seen} (allowed: {alive:.0f}s)")
            self.stdout.write(f"relay: alive, last sweep {age:.1f}s ago")
            return
        _relay_loop(interval, once, self.stdout)

    # --- purge --------------------------------------------------------------------------
    def do_purge(self, dry_run: bool = False, **_: Any) -> None:
        counts = retention_purge(dry_run=dry_run)
        verb = "Would delete" if dry_run else "Deleted"
        self.stdout.write(f"{verb}: " + ", ".join(f"{n} {kind}" for kind, n in counts.items()))


def _relay_loop(interval: float, once: bool, out: Any) -> None:
    stopping = False

    def stop(*_: Any) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    while not stopping:
        close_old_connections()
        try:
            sent = job_relay()
        except Exception as exc:  # noqa: BLE001 - the database is away: try again next sweep
            out.write(f"relay: sweep failed ({type(exc).__name__}); retrying")
            sent = 0
        else:
            _heartbeat(interval)
        if sent:
            out.write(f"relay: published {sent} job(s)")
        if once:
            return
        time.sleep(interval)


def _heartbeat(interval: float) -> None:
    """Record a finished sweep for `relay --alive` (the compose healthcheck)."""
    try:
        redis_client().set(RELAY_HEARTBEAT, repr(time.time()), ex=max(60, int(interval * 10)))
    except RedisError as exc:  # Redis is away: the healthcheck will say so
        logger.warning("relay: could not record its heartbeat: %s", exc)


def _json(data: Any) -> str:
    return json.dumps(data, indent=2, default=str)
