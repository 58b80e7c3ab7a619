"""Celery settings of a host project that contradict what the job ledger needs.

``jobs.worker.celery.configure`` lets a project's own ``CELERY_*`` setting win; for the few
below, the project's value silently breaks the platform (a non-Redis broker: the worker cannot
connect and the relay cannot see its queues; another result backend: ``AsyncResult.get()`` of a
@job waits forever; pickle; acks on receipt: a crashed worker loses its job; queues without
Backlot's: nothing consumes them; a route to a queue Backlot does not declare: every enqueue of
its tasks is refused). ``manage.py check`` reports each as jobs.E010 (see
jobs.web.checks) and a worker refuses to start with them (jobs.worker.signals), each naming the
setting and what to change. A project that means it lists the setting in
``BACKLOT["ALLOW_CELERY_SETTINGS"]``: it is then neither reported nor refused.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from celery.utils.imports import symbol_by_name

from jobs.core.conf import AMQP_SCHEMES, REDIS_SCHEMES, backlot_settings

# Celery's lowercase name -> the Django setting a host writes (the CELERY namespace).
CHECKED = {
    "broker_url": "CELERY_BROKER_URL",
    "result_backend": "CELERY_RESULT_BACKEND",
    "task_serializer": "CELERY_TASK_SERIALIZER",
    "result_serializer": "CELERY_RESULT_SERIALIZER",
    "accept_content": "CELERY_ACCEPT_CONTENT",
    "task_acks_late": "CELERY_TASK_ACKS_LATE",
    "task_queues": "CELERY_TASK_QUEUES",
    "task_routes": "CELERY_TASK_ROUTES",
    "task_default_queue": "CELERY_TASK_DEFAULT_QUEUE",
}
# Read from the environment by Celery itself, before any setting (celery.app.utils.Settings).
FROM_ENVIRONMENT = ("broker_url", "result_backend")
# JSON only is a rule that protects users (docs/reliability.md), and a route to a queue that
# Backlot does not declare fails every enqueue of its tasks: these are never allowed.
NEVER_ALLOWED = frozenset(
    {
        "CELERY_TASK_SERIALIZER",
        "CELERY_RESULT_SERIALIZER",
        "CELERY_ACCEPT_CONTENT",
        "CELERY_TASK_ROUTES",
    }
)
LEDGER_BACKEND = "jobs.worker.results:LedgerResultBackend"


@dataclass(frozen=True)
class Conflict:
    """One setting of the project's that the ledger cannot work with."""

    setting: str
    message: str
    hint: str

    def __str__(self) -> str:
        return f"{self.message} {self.hint}"


def given_in_django_settings(django_settings: Any, environ: Mapping[str, str]) -> dict[str, Any]:
    """The checked settings the project set: its Django settings under the CELERY namespace,
    the broker URL and result backend from the environment first, as Celery reads them."""
    given = {
        name: getattr(django_settings, setting)
        for name, setting in CHECKED.items()
        if hasattr(django_settings, setting)
    }
    for name in FROM_ENVIRONMENT:
        if environ.get(CHECKED[name]):
            given[name] = environ[CHECKED[name]]
    return given


def given_in_app(conf: Any) -> dict[str, Any]:
    """The checked settings as a configured Celery app holds them (Backlot's values where the
    project left them unset, which never conflict)."""
    return {
        name: getattr(conf, name) if name in FROM_ENVIRONMENT else conf[name] for name in CHECKED
    }


def conflicts(given: Mapping[str, Any]) -> list[Conflict]:
    """Each of `given` (Celery's lowercase names) that contradicts the ledger, unless the
    project allowed it in BACKLOT['ALLOW_CELERY_SETTINGS']."""
    allowed = set(backlot_settings().ALLOW_CELERY_SETTINGS) - NEVER_ALLOWED
    found = [
        conflict
        for name, value in given.items()
        if name in CHECKED and CHECKED[name] not in allowed
        for conflict in _conflicts_of(name, value)
    ]
    return found


def refused_allowances() -> list[str]:
    """Names in BACKLOT['ALLOW_CELERY_SETTINGS'] that cannot be allowed: not a setting
    checked here, or one of JSON only's."""
    allowable = set(CHECKED.values()) - NEVER_ALLOWED
    return sorted(set(backlot_settings().ALLOW_CELERY_SETTINGS) - allowable)


def _conflicts_of(name: str, value: Any) -> Iterable[Conflict]:
    setting = CHECKED[name]
    allow = (
        ""
        if setting in NEVER_ALLOWED
        else f"(Or, deliberately, list {setting!r} in BACKLOT['ALLOW_CELERY_SETTINGS'].)"
    )
    if name == "broker_url":
        yield from _broker_conflicts(setting, value, allow)
    elif name == "result_backend" and not _is_ledger_backend(value):
        yield Conflict(
            setting,
            f"{setting} is {_shown(value)}: a @job's result and state are kept in the job "
            "ledger, so with another backend AsyncResult.get() of a @job waits forever "
            "(PENDING).",
            f"Delete {setting} (Backlot's backend, {LEDGER_BACKEND}, stores the results of "
            f"untracked tasks in django-celery-results' table). {allow}",
        )
    elif name in ("task_serializer", "result_serializer") and value != "json":
        yield Conflict(
            setting,
            f"{setting} is {value!r}: Backlot accepts JSON only (the ledger stores the "
            "arguments and results as JSON; pickle runs code).",
            f"Delete {setting} or set it to 'json'.",
        )
    elif name == "accept_content" and set(_listed(value)) - {"json", "application/json"}:
        yield Conflict(
            setting,
            f"{setting} is {sorted(_listed(value))}: Backlot accepts JSON only (pickle runs code).",
            f"Delete {setting} or set it to ['json'].",
        )
    elif name == "task_acks_late" and value is not True:
        yield Conflict(
            setting,
            f"{setting} is {value!r}: a message acknowledged when it is received is lost with "
            "a worker that dies while running it, and the ledger's claim cannot give it back.",
            f"Delete {setting} (Backlot sets True; @job tasks ack late whatever it says). {allow}",
        )
    elif name == "task_queues":
        missing = [q for q in backlot_settings().QUEUES if q not in _queue_names(value)]
        if missing:
            yield Conflict(
                setting,
                f"{setting} declares no queue {', '.join(map(repr, missing))} of "
                "BACKLOT['QUEUES']: no worker consumes the jobs sent there (and Backlot "
                "declares each with its ten priority lists).",
                f"Delete {setting} and name the queues in BACKLOT['QUEUES'] instead. {allow}",
            )
    elif name == "task_default_queue" and value != default_queue():
        yield Conflict(
            setting,
            f"{setting} is {_shown(value)}: Backlot sends a job whose task and call name no "
            f"queue to {default_queue()!r} (the 'default' of BACKLOT['QUEUES'], else its "
            "first queue), so the setting would be ignored.",
            f"Delete {setting} and name your default queue 'default' in BACKLOT['QUEUES'], or "
            "list it first there (without a 'default'). "
            f"{allow}",
        )
    elif name == "task_routes":
        declared = set(backlot_settings().QUEUES)
        unknown = sorted(set(_routed_queues(value)) - declared)
        if unknown:
            yield Conflict(
                setting,
                f"{setting} routes tasks to {', '.join(map(repr, unknown))}, not a queue of "
                "BACKLOT['QUEUES']: every enqueue of those tasks is refused (Unknown queue) and "
                "no worker consumes it.",
                f"Add {', '.join(map(repr, unknown))} to BACKLOT['QUEUES'] (Backlot declares "
                "each queue with its ten priority lists), or route those tasks to one of its "
                "queues.",
            )
        unread = sorted(set(_unread_route_keys(value)))
        if unread:
            yield Conflict(
                setting,
                f"{setting} has routes with {', '.join(map(repr, unread))}: Backlot reads only a "
                "route's 'queue' (a job's priority is its call's or its task's, and a message "
                "goes to its queue's own exchange), so these would be ignored.",
                "Keep {'queue': NAME} in each route; give a priority with priority= on the task "
                "or the call.",
            )


def default_queue() -> str:
    """Where a job goes when neither its task nor its call names a queue."""
    queues = backlot_settings().QUEUES
    return "default" if "default" in queues else queues[0]


def _broker_conflicts(setting: str, value: Any, allow: str) -> Iterable[Conflict]:
    url = str(value or "")
    first = url.split(";", 1)[0]
    scheme = urlsplit(first).scheme
    conf = backlot_settings()
    if scheme in AMQP_SCHEMES:
        if url != conf.BROKER_URL:
            yield Conflict(
                setting,
                f"{setting} names another RabbitMQ than BACKLOT['BROKER_URL']: Backlot declares "
                "its quorum queues and reads their depths on BACKLOT['BROKER_URL'].",
                f"Delete one of them, or give both the same URL. {allow}",
            )
        return
    if scheme not in REDIS_SCHEMES:
        # Only the scheme is shown: a broker URL may hold a password.
        yield Conflict(
            setting,
            f"{setting} is a URL of scheme {scheme!r}: Backlot's broker is Redis or RabbitMQ "
            "(its queues, the claim of each delivery and the relay read them there).",
            f"Delete {setting}: the broker is then BACKLOT['REDIS_URL'] (or REDIS_URL); "
            "set that to your Redis, e.g. redis://HOST:6379/0, or set BACKLOT['BROKER_URL'] "
            f"to an amqp:// URL. {allow}",
        )
        return
    if conf.BROKER_URL:
        yield Conflict(
            setting,
            f"{setting} is a Redis URL but BACKLOT['BROKER_URL'] names RabbitMQ: the workers "
            "would consume one broker while Backlot publishes to the other.",
            f"Delete {setting} (the broker is then BACKLOT['BROKER_URL']). {allow}",
        )
        return
    if (
        scheme != "sentinel"
        and not conf.REDIS_SENTINELS
        and _redis_key(url) != _redis_key(conf.REDIS_URL)
    ):
        yield Conflict(
            setting,
            f"{setting} names another Redis than BACKLOT['REDIS_URL']: queue depths, the "
            "atomic fetch, delivery holders and the relay read the broker's lists on "
            "BACKLOT['REDIS_URL'].",
            f"Delete {setting} (the broker is then BACKLOT['REDIS_URL']), or give both the "
            f"same URL. {allow}",
        )


def _redis_key(url: str) -> tuple[Any, ...]:
    parts = urlsplit(url)
    return (
        parts.scheme,
        parts.hostname or "localhost",
        parts.port or 6379,
        parts.path.strip("/") or "0",
        parts.username or None,
        parts.password or None,
    )


def _is_ledger_backend(value: Any) -> bool:
    from jobs.worker.results import LedgerResultBackend  # imports models: Django must be set up

    if isinstance(value, type):
        return issubclass(value, LedgerResultBackend)
    text = str(value or "")
    if not text or "://" in text:
        return False
    try:
        found = symbol_by_name(text)
    except (ImportError, AttributeError, ValueError):
        return False
    return isinstance(found, type) and issubclass(found, LedgerResultBackend)


def _shown(value: Any) -> str:
    """A result backend as the message shows it: its scheme or its class path, no password."""
    text = str(value)
    return f"a {text.split('://', 1)[0]}:// URL" if "://" in text else repr(text)


def _listed(value: Any) -> list[str]:
    return [value] if isinstance(value, str) else [str(v) for v in value or ()]


def _routed_queues(value: Any) -> Iterable[str]:
    """The queues CELERY_TASK_ROUTES names where it can be read without calling anything: a
    dict of names, globs or regexes to a queue's name, a dict with "queue" or a Queue, or a
    list of such dicts (a router function or its dotted path answers only when called)."""
    for routes in value if isinstance(value, (list, tuple)) else [value]:
        if not isinstance(routes, Mapping):
            continue
        for route in routes.values():
            queue = route.get("queue") if isinstance(route, Mapping) else route
            name = getattr(queue, "name", queue)
            if isinstance(name, str) and name:
                yield name


def _unread_route_keys(value: Any) -> Iterable[str]:
    """Keys of CELERY_TASK_ROUTES' dict routes that Backlot does not read ('queue' it does; a
    route without one is reported as its missing 'queue')."""
    for routes in value if isinstance(value, (list, tuple)) else [value]:
        if not isinstance(routes, Mapping):
            continue
        for route in routes.values():
            if isinstance(route, Mapping):
                yield from (key for key in route if key != "queue")
                if "queue" not in route:
                    yield "no 'queue'"


def _queue_names(value: Any) -> set[str]:
    if isinstance(value, Mapping):
        return {str(name) for name in value}
    return {q if isinstance(q, str) else str(getattr(q, "name", q)) for q in value or ()}
