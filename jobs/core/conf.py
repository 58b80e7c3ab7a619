"""Backlot's settings: one typed object with a default for everything jobs/ reads.

A host project overrides only what it needs in ``BACKLOT = {...}``; a project that sets nothing
gets a working platform (one ``default`` queue, Redis on localhost). Read them with
``backlot_settings()``: resolved once and again whenever a test or ``override_settings``
changes BACKLOT, REDIS_URL or the Celery broker settings. An unknown key or a value of the
wrong type is an ImproperlyConfigured error naming it, at the first read (and in
``manage.py check``, which reads them).

The Celery side of the platform (JSON only, acks_late, queues with their priority steps, the
ledger's result backend, the beat leader, the periodic relay) is ``celery_settings()``, which
``jobs.worker.celery.configure(app)`` applies to a host's Celery app.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.core.signals import setting_changed

# Seconds Redis waits before redelivering an unacknowledged message, unless the project's
# CELERY_BROKER_TRANSPORT_OPTIONS says otherwise: it must outlast the longest countdown Redis
# holds (MAX_BROKER_COUNTDOWN + RATE_LIMIT_MAX_RESERVE; system check jobs.E002).
DEFAULT_VISIBILITY_TIMEOUT = 7200
# A Sentinel's port where a sentinel:// URL names none (Redis' and kombu's default).
SENTINEL_PORT = 26379
# Broker URL schemes: Redis (one server or Sentinels), and RabbitMQ (AMQP 0-9-1, py-amqp).
REDIS_SCHEMES = ("redis", "rediss", "sentinel")
AMQP_SCHEMES = ("amqp", "amqps", "pyamqp")
# The queue types Backlot declares on RabbitMQ (BACKLOT['AMQP_QUEUE_TYPE']).
AMQP_QUEUE_TYPES = ("quorum", "classic")
# What beat does with a fire time missed while no beat ran (BACKLOT['SCHEDULE_CATCH_UP']).
SCHEDULE_CATCH_UP_POLICIES = ("run_once", "skip")


@dataclass(frozen=True)
class BacklotSettings:
    """Every setting of the platform, with its default. Keys of ``BACKLOT`` are these names."""

    # Queues jobs may name; each has ten Redis priority lists (priority_steps 0-9).
    QUEUES: tuple[str, ...] = ("default",)
    # Redis used for rate limits, beat's leader lock, counters and queue depths; defaults to
    # the project's REDIS_URL, else its CELERY_BROKER_URL (when that is a Redis one). It is the
    # broker too, unless BROKER_URL names RabbitMQ.
    REDIS_URL: str = "redis://127.0.0.1:6379/0"
    # The broker, when it is RabbitMQ: an amqp:// URL (defaults to the project's
    # CELERY_BROKER_URL when that is one). Empty: the broker is REDIS_URL (or its Sentinels).
    # On RabbitMQ the queues are quorum queues (replicated; jobs.broker.amqp), every publish is
    # confirmed, and Redis still keeps the rate limits, gates, counters and beat's lock.
    BROKER_URL: str = ""
    # RabbitMQ queue type: "quorum" (replicated with Raft; RabbitMQ < 3.12 has no priorities
    # on them) or "classic" (one node, priorities 0-9 by x-max-priority).
    AMQP_QUEUE_TYPE: str = "quorum"
    # A quorum queue gives up on a message redelivered this many times (delivered this many + 1)
    # and dead-letters it to backlot.undeliverable, which the relay turns into a Backlot dead
    # letter; above MAX_WORKER_CRASHES, so the ledger dead-letters a poison job first.
    AMQP_DELIVERY_LIMIT: int = 20
    # Redis Sentinel (jobs.broker.redis): the Sentinels ("host:port") and the name of the master
    # they
    # watch (`sentinel monitor <name> ...`). When set, the broker and every platform use of Redis
    # ask them where the primary is, and follow it across a failover; REDIS_URL then gives only
    # the primary's password, user and database (its host is not used). A REDIS_URL written
    # the way Celery takes it, "sentinel://s1:26379;sentinel://s2:26379/0", fills in the
    # Sentinels; the master name may also come from CELERY_BROKER_TRANSPORT_OPTIONS' master_name.
    REDIS_SENTINELS: tuple[str, ...] = ()
    REDIS_SENTINEL_MASTER: str = ""
    # The Sentinels' own password (their `requirepass`), when they have one.
    REDIS_SENTINEL_PASSWORD: str = ""
    # Serialized args + kwargs above this many bytes are refused at enqueue.
    MAX_PAYLOAD_BYTES: int = 64 * 1024
    # A succeeded job keeps its idempotency key this long: a repeat enqueue is a no-op.
    IDEMPOTENCY_TTL: int = 24 * 3600
    # Progress writes from one job are at most this often (seconds): 100,000 steps cost one
    # UPDATE per interval instead of 100,000.
    PROGRESS_INTERVAL: float = 1.0
    # Delays up to this many seconds ride in Redis as a countdown; longer ones wait in the
    # ledger as scheduled rows and are published when due.
    MAX_BROKER_COUNTDOWN: int = 900
    # A pool process dying this many times on one job sends it to the dead letters.
    MAX_WORKER_CRASHES: int = 3
    # A rate-limited job may reserve a slot this far ahead; beyond it, it backs off unreserved.
    RATE_LIMIT_MAX_RESERVE: float = 30.0
    HEALTH_MAX_QUEUE_DEPTH: int = 1000
    HEALTH_MAX_WAIT_SECONDS: float = 300.0
    # More jobs than this giving up within an hour degrade health (and alert): a provider that
    # starts refusing, or a bad deploy. 50/h is ~1 a minute, above a healthy project's trickle
    # of permanent errors (bad addresses, invalid files), far below a refusing API's rate.
    HEALTH_MAX_DEAD_PER_HOUR: int = 50
    # Bearer token /metrics asks for (staff sessions need none); empty: staff only, unless
    # DEBUG, when /metrics is open (system check jobs.W005 warns about empty with DEBUG off).
    METRICS_TOKEN: str = ""
    # Retention (manage.py jobs purge, and daily from beat); unresolved dead letters are kept.
    JOB_RETENTION_DAYS: int = 7
    DEAD_LETTER_RETENTION_DAYS: int = 30
    # An effect record older than this no longer stops a replay from repeating the effect.
    EFFECT_RETENTION_DAYS: int = 90
    # A degraded-health cause is alerted at most once per this many seconds.
    ALERT_INTERVAL: int = 900
    # Failed sign-ins (the login page, the admin's) allowed per account and per client address,
    # and failed bearer tokens per address, as "count/period" (jobs.web.throttle): past the
    # count, the next attempt is 429 with Retry-After until a failure's token comes back
    # (period / count: 3 minutes for 5/15m) or an operator lifts it (manage.py
    # jobs_signin_unlock). 5 guesses per account per 15 minutes is OWASP's usual lockout;
    # an address gets more, for offices behind one NAT.
    SIGNIN_FAILURES_PER_ACCOUNT: str = "5/15m"
    SIGNIN_FAILURES_PER_ADDRESS: str = "20/15m"
    TOKEN_FAILURES_PER_ADDRESS: str = "20/15m"
    # The views whose POST is a sign-in (URL names), refused while locked out
    # (jobs.web.middleware.SignInThrottleMiddleware).
    SIGNIN_VIEWS: tuple[str, ...] = ("login", "admin:login")
    # A running job's claim lasts this long and is renewed every third of it while it runs: a
    # job whose worker died is re-queued by the relay within about this time.
    LEASE_SECONDS: float = 30.0
    # A short job writes the ledger once (jobs.ledger.deferred): its delivery reads the row and
    # records the run in Redis (jobs.broker.running) instead of writing the claim, and its
    # success is one UPDATE. The claim row is written when the run outlives the first third of
    # its lease, or calls progress(), an effect, a step or enqueues a child, or fails. Redis
    # brokers, workers whose jobs run in the main process (-P solo, threads); not for jobs in
    # a batch or behind a rate or concurrency gate (they claim as before). On by default;
    # False writes every run's claim before it starts (docs/reliability.md).
    DEFER_CLAIM: bool = True
    # A -P solo or prefork worker writes the successes of its short runs (DEFER_CLAIM) together
    # (a prefork pool process hands its back to the main process), up to this many in one
    # statement, each at most SUCCESS_BATCH_SECONDS after its run ended; a message is
    # acknowledged once its success is written (jobs.worker.finishes). 1 writes each success
    # as its run ends.
    SUCCESS_BATCH: int = 32
    SUCCESS_BATCH_SECONDS: float = 0.02
    # A prefork pool process writes its jobs' metric counts at most this long (s) after a finish,
    # for all the finishes meanwhile (jobs.broker.counters.hold); 0 writes them with each
    # finish, one Redis round trip per job. -P solo workers write them with their acks.
    METRICS_HOLD_SECONDS: float = 1.0
    # Beat leader lock lifetime (s): a dead leader is replaced within this time.
    BEAT_LOCK_TTL: int = 30
    # A schedule's fire time that passed while no beat ran (found more than
    # max(60 s, 3 x BEAT_LOCK_TTL) late): "run_once" fires it once when beat is back (the latest
    # missed time only, as Celery beat does), "skip" leaves it and waits for the next one.
    SCHEDULE_CATCH_UP: str = "run_once"
    # How often beat asks a worker to run the relay (s); `manage.py jobs relay` runs it too.
    RELAY_INTERVAL: float = 5.0
    # The URL name of the job status route (JobHandle.status_url): the jobs API router mounted
    # on a NinjaAPI with urls_namespace="api-1" (ninja's own default is "api-<version>").
    STATUS_URL_NAME: str = "api-1:job_status"
    # Workers take each message from Redis and record it as theirs in one Lua script
    # (jobs.broker.fetch),
    # waking on per-queue doorbells, instead of kombu's BRPOP and a second write.
    ATOMIC_FETCH: bool = True
    # Celery settings of the project's that contradict the ledger (jobs.worker.conflicts: the
    # broker URL, result backend, acks_late, task queues) fail `manage.py check` (jobs.E010)
    # and stop a worker at start; a setting named here, e.g. ("CELERY_TASK_ACKS_LATE",), is
    # the project's deliberate choice and is let through. JSON only cannot be let through.
    ALLOW_CELERY_SETTINGS: tuple[str, ...] = ()
    # Adopt mode (jobs.flow.adopt): every plain Celery task of the project (@shared_task,
    # @app.task without base=) is a platform task: ledger row, claim, status, dead letter,
    # replay. @shared_task(backlot=False) keeps one plain.
    ADOPT_CELERY_TASKS: bool = False
    # Redis' redelivery timeout for unacknowledged messages (read from the broker options).
    VISIBILITY_TIMEOUT: int = field(default=DEFAULT_VISIBILITY_TIMEOUT)


_FIELDS = {f.name: f for f in dataclasses.fields(BacklotSettings)}
# Read from elsewhere than BACKLOT: REDIS_URL and the broker's visibility timeout.
_DERIVED = frozenset({"VISIBILITY_TIMEOUT"})
# The resolved settings, under the key "settings" (a dict, not a rebound global).
_cache: dict[str, BacklotSettings] = {}


def _coerce(name: str, value: Any) -> Any:
    kind = _FIELDS[name].type
    try:
        if kind == "tuple[str, ...]":
            if isinstance(value, str) or not all(isinstance(v, str) for v in value):
                raise TypeError
            return tuple(value)
        if kind == "int" and not isinstance(value, bool):
            if isinstance(value, float) and not value.is_integer():
                raise TypeError
            return int(value)
        if kind == "float" and not isinstance(value, bool):
            return float(value)
        if kind == "str" and isinstance(value, str):
            return value
        if kind == "bool" and isinstance(value, bool):
            return value
    except (TypeError, ValueError):
        pass
    raise ImproperlyConfigured(
        f"BACKLOT[{name!r}] must be {kind}, got {value!r} ({type(value).__name__})"
    )


def _resolve() -> BacklotSettings:
    given = getattr(settings, "BACKLOT", None) or {}
    if not isinstance(given, dict):
        raise ImproperlyConfigured("BACKLOT must be a dict of Backlot's settings")
    unknown = sorted(set(given) - (set(_FIELDS) - _DERIVED))
    if unknown:
        raise ImproperlyConfigured(
            f"Unknown key(s) in BACKLOT: {', '.join(unknown)}; "
            f"known: {', '.join(sorted(set(_FIELDS) - _DERIVED))}"
        )
    values = {name: _coerce(name, value) for name, value in given.items()}
    celery_broker = str(getattr(settings, "CELERY_BROKER_URL", None) or "")
    if "REDIS_URL" not in values:
        url = getattr(settings, "REDIS_URL", None) or (
            celery_broker if url_scheme(celery_broker) in REDIS_SCHEMES else None
        )
        if url:
            values["REDIS_URL"] = str(url)
    if "BROKER_URL" not in values and url_scheme(celery_broker) in AMQP_SCHEMES:
        values["BROKER_URL"] = celery_broker
    _check_broker(values)
    options = getattr(settings, "CELERY_BROKER_TRANSPORT_OPTIONS", None) or {}
    values["VISIBILITY_TIMEOUT"] = int(
        options.get("visibility_timeout", DEFAULT_VISIBILITY_TIMEOUT)
    )
    _resolve_sentinels(values, options)
    resolved = BacklotSettings(**values)
    if not resolved.QUEUES:
        raise ImproperlyConfigured("BACKLOT['QUEUES'] names no queue")
    if resolved.SCHEDULE_CATCH_UP not in SCHEDULE_CATCH_UP_POLICIES:
        raise ImproperlyConfigured(
            f"BACKLOT['SCHEDULE_CATCH_UP'] must be one of {', '.join(SCHEDULE_CATCH_UP_POLICIES)}, "
            f"got {resolved.SCHEDULE_CATCH_UP!r}"
        )
    if resolved.SUCCESS_BATCH < 1 or not resolved.SUCCESS_BATCH_SECONDS > 0:
        raise ImproperlyConfigured(
            "BACKLOT['SUCCESS_BATCH'] must be at least 1 and BACKLOT['SUCCESS_BATCH_SECONDS'] "
            f"more than 0, got {resolved.SUCCESS_BATCH!r} and {resolved.SUCCESS_BATCH_SECONDS!r}"
        )
    return resolved


def url_scheme(url: str) -> str:
    """The scheme of a broker URL (of its first part, for a ';'-separated list)."""
    return urlsplit(url.split(";", 1)[0].strip()).scheme


def _check_broker(values: dict[str, Any]) -> None:
    broker = values.get("BROKER_URL", "")
    scheme = url_scheme(broker)
    if broker and scheme not in AMQP_SCHEMES + REDIS_SCHEMES:
        # only the scheme is shown: a broker URL may hold a password
        raise ImproperlyConfigured(
            f"BACKLOT['BROKER_URL'] is a URL of scheme {scheme!r}: Backlot's broker is Redis "
            "(leave BROKER_URL empty and set REDIS_URL) or RabbitMQ "
            "(amqp://USER:PASSWORD@HOST:5672/VHOST)"
        )
    if scheme in REDIS_SCHEMES:  # the Redis broker is REDIS_URL: one place to set it
        if values.setdefault("REDIS_URL", broker) != broker:
            raise ImproperlyConfigured(
                "BACKLOT['BROKER_URL'] names another Redis than REDIS_URL: leave BROKER_URL "
                "empty (the broker is then REDIS_URL) or set it to a RabbitMQ amqp:// URL"
            )
        values["BROKER_URL"] = ""
    kind = values.get("AMQP_QUEUE_TYPE", "quorum")
    if kind not in AMQP_QUEUE_TYPES:
        raise ImproperlyConfigured(
            f"BACKLOT['AMQP_QUEUE_TYPE'] must be 'quorum' or 'classic', got {kind!r} (classic "
            "mirrored queues are not supported: they can lose confirmed messages on a failover, "
            "and RabbitMQ 4 removed them; quorum queues replicate with Raft)"
        )


def _resolve_sentinels(values: dict[str, Any], options: dict[str, Any]) -> None:
    """REDIS_SENTINELS from a sentinel:// REDIS_URL, the master name from the broker's
    transport options; each Sentinel checked as host:port, and none without a master name."""
    url = values.get("REDIS_URL", "")
    if url.startswith("sentinel://") and not values.get("REDIS_SENTINELS"):
        hosts = [urlsplit(part.strip()).netloc.rpartition("@")[2] for part in url.split(";")]
        values["REDIS_SENTINELS"] = tuple(
            host if ":" in host else f"{host}:{SENTINEL_PORT}" for host in hosts if host
        )
    if not values.get("REDIS_SENTINEL_MASTER") and options.get("master_name"):
        values["REDIS_SENTINEL_MASTER"] = str(options["master_name"])
    sentinels = values.get("REDIS_SENTINELS", ())
    for address in sentinels:
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ImproperlyConfigured(
                f"BACKLOT['REDIS_SENTINELS']: {address!r} is not host:port "
                "(e.g. 'sentinel1.example.com:26379')"
            )
    if sentinels and not values.get("REDIS_SENTINEL_MASTER"):
        raise ImproperlyConfigured(
            "Redis Sentinels are set but no master name: set BACKLOT['REDIS_SENTINEL_MASTER'] "
            "(the reference project reads REDIS_SENTINEL_MASTER) to the name in sentinel.conf's "
            "`sentinel monitor <name> ...`"
        )
    if values.get("REDIS_SENTINEL_MASTER") and not sentinels:
        raise ImproperlyConfigured(
            "BACKLOT['REDIS_SENTINEL_MASTER'] is set but no Sentinel: set "
            "BACKLOT['REDIS_SENTINELS'] (host:port of each; the reference project reads "
            "REDIS_SENTINELS, comma-separated)"
        )


def backlot_settings() -> BacklotSettings:
    """The platform's settings, resolved from the project's (cached until they change)."""
    try:
        return _cache["settings"]
    except KeyError:
        resolved = _cache["settings"] = _resolve()
        return resolved


def _reset(*, setting: str, **kwargs: Any) -> None:
    if setting in {"BACKLOT", "REDIS_URL", "CELERY_BROKER_URL", "CELERY_BROKER_TRANSPORT_OPTIONS"}:
        _cache.clear()


setting_changed.connect(_reset, dispatch_uid="backlot-conf-reset")
