"""Django settings for Backlot, read from the environment with safe defaults."""

import os
from pathlib import Path
from typing import Any

import dj_database_url
import django

BASE_DIR = Path(__file__).resolve().parent.parent
DATA_DIR = Path(os.environ.get("BACKLOT_DATA_DIR", BASE_DIR / ".data"))


def env_bool(name: str, default: bool = False) -> bool:
    value = os.environ.get(name)
    if value is None:
        return default
    return value.strip().lower() in {"1", "true", "yes", "on"}


def env_list(name: str, default: str = "") -> list[str]:
    return [item.strip() for item in os.environ.get(name, default).split(",") if item.strip()]


DEBUG = env_bool("DEBUG", False)
# Without SECRET_KEY a fixed development key is used; its "django-insecure-" prefix makes
# `manage.py check --deploy` fail loudly, and compose requires a real one.
SECRET_KEY = (
    os.environ.get("SECRET_KEY") or "django-insecure-backlot-development-key-0123456789abcdef"
)
ALLOWED_HOSTS = env_list("ALLOWED_HOSTS", "localhost,127.0.0.1,[::1],testserver")
CSRF_TRUSTED_ORIGINS = env_list("CSRF_TRUSTED_ORIGINS")

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django_celery_results",
    "django_celery_beat",
    "jobs",
    "emails",
    "reports",
    "media_pipeline",
    "web",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "jobs.web.middleware.ActingAsMiddleware",
    # login and admin login refuse attempts while locked out: 429 (jobs.web.throttle)
    "jobs.web.middleware.SignInThrottleMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "config.urls"
WSGI_APPLICATION = "config.wsgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

DATABASES = {
    "default": dj_database_url.config(
        default=f"sqlite:///{DATA_DIR / 'backlot.sqlite3'}",
        conn_max_age=int(os.environ.get("DB_CONN_MAX_AGE", "60")),
    )
}
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    # WAL lets the web process read while a worker writes; the timeout (seconds a write waits
    # for the single write lock before "database is locked") rides out short locks; IMMEDIATE
    # takes the lock at BEGIN, so a transaction waits there instead of failing mid-way.
    DATABASES["default"]["OPTIONS"] = {
        "timeout": float(os.environ.get("SQLITE_TIMEOUT", "20")),
        "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
        "transaction_mode": "IMMEDIATE",
    }
    DATABASES["default"]["CONN_MAX_AGE"] = 0
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = os.environ.get("TIME_ZONE", "UTC")
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = BASE_DIR / "staticfiles"
MEDIA_URL = "media/"
MEDIA_ROOT = Path(os.environ.get("MEDIA_ROOT", DATA_DIR / "media"))
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {"BACKEND": "whitenoise.storage.CompressedStaticFilesStorage"},
}
WHITENOISE_USE_FINDERS = DEBUG

# Email: SMTP in production, a file sink for `make run`; tests point EMAIL_HOST at aiosmtpd.
EMAIL_BACKEND = os.environ.get(
    "EMAIL_BACKEND",
    "emails.backends.TrackedSMTPBackend"
    if os.environ.get("EMAIL_HOST")
    else "django.core.mail.backends.filebased.EmailBackend",
)
EMAIL_FILE_PATH = DATA_DIR / "sent-emails"
EMAIL_HOST = os.environ.get("EMAIL_HOST", "localhost")
EMAIL_PORT = int(os.environ.get("EMAIL_PORT", "25"))
EMAIL_HOST_USER = os.environ.get("EMAIL_HOST_USER", "")
EMAIL_HOST_PASSWORD = os.environ.get("EMAIL_HOST_PASSWORD", "")
EMAIL_USE_TLS = env_bool("EMAIL_USE_TLS", False)
EMAIL_TIMEOUT = int(os.environ.get("EMAIL_TIMEOUT", "10"))
DEFAULT_FROM_EMAIL = os.environ.get("DEFAULT_FROM_EMAIL", "Backlot <noreply@example.com>")
# Cluster-wide sending rate per SMTP provider (host), shared by every worker.
EMAIL_RATE_LIMIT = os.environ.get("EMAIL_RATE_LIMIT", "100/s")
# At most this many sends talk to one SMTP provider at once, across every worker: providers
# cap open connections per account (10 is a common cap; above it they refuse with 421).
EMAIL_CONCURRENCY = int(os.environ.get("EMAIL_CONCURRENCY", "10"))
# At most this many transcodes of one user's videos run at once, across every worker: one
# user's batch upload cannot take every media worker from the others.
TRANSCODES_PER_USER = int(os.environ.get("TRANSCODES_PER_USER", "2"))

SESSION_COOKIE_HTTPONLY = True
SESSION_COOKIE_SECURE = env_bool("SESSION_COOKIE_SECURE", not DEBUG and "CI" not in os.environ)
CSRF_COOKIE_SECURE = SESSION_COOKIE_SECURE
X_FRAME_OPTIONS = "DENY"

# Every line goes through a formatter that masks email addresses; LOG_FORMAT=json for JSON lines.
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {
        "plain": {
            "()": "web.logs.MaskingFormatter",
            "format": "%(asctime)s %(levelname)s %(name)s %(message)s",
        },
        "json": {"()": "web.logs.JsonFormatter"},
    },
    "handlers": {
        "console": {
            "class": "logging.StreamHandler",
            "formatter": "json" if os.environ.get("LOG_FORMAT") == "json" else "plain",
        }
    },
    "root": {"handlers": ["console"], "level": os.environ.get("LOG_LEVEL", "INFO")},
    # aiosmtpd (tests) logs whole SMTP conversations at INFO.
    # Job start/success/retry/dead lines come from backlot.jobs (ids only); Celery's own
    # per-task lines repeat them with return values, so only its warnings are kept.
    "loggers": {
        "mail.log": {"level": "WARNING"},
        "celery.app.trace": {"level": "WARNING"},
        "celery.worker.strategy": {"level": "WARNING"},
        "weasyprint": {"level": "WARNING"},
        "fontTools": {"level": "WARNING"},
    },
}

# --- Error reporting (optional: pip install backlot[sentry]) -------------------------------
# With SENTRY_DSN set, errors go to Sentry: a dead job is one event (jobs.web.errors), tagged with
# job id, task, queue and attempt, its arguments masked. Traces stay off (no
# traces_sample_rate) and no personal data is sent by default. Integrations are not
# auto-enabled: Sentry's Celery one is not needed (jobs.web.errors reports dead jobs, and drops the
# repeat Celery's would send as the worker re-raises the exception) and would add trace headers
# to every message.
# https://docs.sentry.io/platforms/python/configuration/options/
SENTRY_DSN = os.environ.get("SENTRY_DSN", "")
if SENTRY_DSN:
    import sentry_sdk
    from sentry_sdk.integrations.django import DjangoIntegration

    sentry_sdk.init(
        dsn=SENTRY_DSN,
        environment=os.environ.get("SENTRY_ENVIRONMENT", "production"),
        send_default_pii=False,
        auto_enabling_integrations=False,
        integrations=[DjangoIntegration()],
    )

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
# Redis Sentinel (docs/scaling.md): REDIS_SENTINELS="s1:26379,s2:26379,s3:26379" and the name
# of the master they watch; REDIS_URL then gives only the primary's password and database.
# The broker, the locks, leases, rate limits and counters all follow the primary they name.
REDIS_SENTINELS = tuple(env_list("REDIS_SENTINELS"))
REDIS_SENTINEL_MASTER = os.environ.get("REDIS_SENTINEL_MASTER", "")
REDIS_SENTINEL_PASSWORD = os.environ.get("REDIS_SENTINEL_PASSWORD", "")

# --- Celery -------------------------------------------------------------------------------
# jobs.worker.celery.configure(app) (config/celery.py) gives the app Backlot's Celery settings: JSON
# only, acks_late, the ledger's result backend, the beat leader, the platform's periodic tasks.
# Set here is only what this project chooses itself, from the environment.
# https://docs.celeryq.dev/en/stable/userguide/configuration.html
# BROKER_URL=amqp://USER:PASSWORD@HOST:5672/VHOST: RabbitMQ is the broker (quorum queues,
# publisher confirms; docs/scaling.md); Redis (REDIS_URL) still keeps the platform's limits,
# counters and locks. Unset: the broker is REDIS_URL.
# (Read into CELERY_BROKER_URL only: a setting named BROKER_URL is Celery's old name for
# broker_url, and an empty one would count as the project's choice of broker.)
if os.environ.get("BROKER_URL"):
    CELERY_BROKER_URL = os.environ["BROKER_URL"]
elif not REDIS_SENTINELS:
    # With Sentinels, jobs.worker.celery gives the broker kombu's sentinel:// URL and master_name.
    CELERY_BROKER_URL = REDIS_URL
# Merged key by key into Backlot's transport options (jobs.worker.celery.PRIORITY_TRANSPORT_OPTIONS:
# priority lists, bounded socket timeouts).
CELERY_BROKER_TRANSPORT_OPTIONS: dict[str, Any] = {
    # An unacknowledged message is redelivered after this many seconds; it must outlast the
    # longest countdown Redis may hold (the system check jobs.E002 compares them).
    "visibility_timeout": int(os.environ.get("CELERY_VISIBILITY_TIMEOUT", "7200")),
}
# Long-running jobs: one message per process at a time, so a backlog is not hoarded.
CELERY_WORKER_PREFETCH_MULTIPLIER = int(os.environ.get("CELERY_WORKER_PREFETCH_MULTIPLIER", "1"))
# Celery's monitoring events (task-sent, -received, -started, -succeeded) are off unless asked
# for: each is a Redis PUBLISH, and publishing them took a third of a worker's main process on
# short jobs. Flower turns workers' events on when it connects (its enable_events option);
# CELERY_EVENTS=1 keeps them on from the start, task-sent included. Backlot's own dashboard,
# metrics and status read the ledger and Redis counters, not events.
CELERY_WORKER_SEND_TASK_EVENTS = os.environ.get("CELERY_EVENTS", "0") == "1"
CELERY_TASK_SEND_SENT_EVENT = CELERY_WORKER_SEND_TASK_EVENTS
CELERY_RESULT_EXPIRES = int(os.environ.get("CELERY_RESULT_EXPIRES", str(7 * 24 * 3600)))
CELERY_TASK_TIME_LIMIT = int(os.environ.get("CELERY_TASK_TIME_LIMIT", "1800"))
CELERY_TASK_SOFT_TIME_LIMIT = int(os.environ.get("CELERY_TASK_SOFT_TIME_LIMIT", "1740"))
# SIGTERM (a deploy): running jobs get this many seconds to finish and be acked; the rest are
# cancelled, their claims released and their messages requeued (acks_late) to run elsewhere.
# https://docs.celeryq.dev/en/stable/userguide/workers.html#soft-shutdown
CELERY_WORKER_SOFT_SHUTDOWN_TIMEOUT = float(
    os.environ.get("CELERY_WORKER_SOFT_SHUTDOWN_TIMEOUT", "30")
)
# The queues (BACKLOT["QUEUES"]); jobs.worker.celery declares each with ten priority lists.
BACKLOT_QUEUES = ("default", "emails", "reports", "media")

# --- Backlot -----------------------------------------------------------------------------


# Backlot's settings (jobs.core.conf.BacklotSettings has every key, its default and its reason);
# the reference project reads each from the environment.
BACKLOT: dict[str, Any] = {
    "QUEUES": BACKLOT_QUEUES,
    # How often beat asks a worker to sweep the outbox (the relay process sweeps every second).
    "RELAY_INTERVAL": float(os.environ.get("BACKLOT_RELAY_INTERVAL", "5")),
    # Serialized args + kwargs above this many bytes are refused at enqueue.
    "MAX_PAYLOAD_BYTES": int(os.environ.get("BACKLOT_MAX_PAYLOAD_BYTES", str(64 * 1024))),
    # A succeeded job keeps its idempotency key this long: a repeat enqueue is a no-op.
    "IDEMPOTENCY_TTL": int(os.environ.get("BACKLOT_IDEMPOTENCY_TTL", str(24 * 3600))),
    # Progress writes from one job are at most this often (seconds); 100,000 steps cost ~1 write
    # per interval instead of 100,000 UPDATEs.
    "PROGRESS_INTERVAL": float(os.environ.get("BACKLOT_PROGRESS_INTERVAL", "1.0")),
    "METRICS_HOLD_SECONDS": float(os.environ.get("BACKLOT_METRICS_HOLD_SECONDS", "1.0")),
    # Delays up to this many seconds ride in Redis as a countdown; longer ones wait in the
    # ledger as scheduled rows and are published when due.
    "MAX_BROKER_COUNTDOWN": int(os.environ.get("BACKLOT_MAX_BROKER_COUNTDOWN", "900")),
    # A pool process dying this many times on one job sends it to the dead letters.
    "MAX_WORKER_CRASHES": int(os.environ.get("BACKLOT_MAX_WORKER_CRASHES", "3")),
    # With BROKER_URL=amqp://...: "quorum" (replicated) or "classic" (one node, priorities),
    # and how many redeliveries of one message RabbitMQ makes before the relay dead-letters it.
    "AMQP_QUEUE_TYPE": os.environ.get("BACKLOT_AMQP_QUEUE_TYPE", "quorum"),
    "AMQP_DELIVERY_LIMIT": int(os.environ.get("BACKLOT_AMQP_DELIVERY_LIMIT", "20")),
    # A rate-limited job may reserve a slot this far ahead; beyond it, it backs off unreserved.
    "RATE_LIMIT_MAX_RESERVE": float(os.environ.get("BACKLOT_RATE_LIMIT_MAX_RESERVE", "30")),
    "HEALTH_MAX_QUEUE_DEPTH": int(os.environ.get("BACKLOT_HEALTH_MAX_QUEUE_DEPTH", "1000")),
    "HEALTH_MAX_WAIT_SECONDS": float(os.environ.get("BACKLOT_HEALTH_MAX_WAIT_SECONDS", "300")),
    # More dead letters than this in the last hour degrade health (a provider refusing).
    "HEALTH_MAX_DEAD_PER_HOUR": int(os.environ.get("BACKLOT_HEALTH_MAX_DEAD_PER_HOUR", "50")),
    "METRICS_TOKEN": os.environ.get("METRICS_TOKEN", ""),
    # Retention (manage.py jobs purge, and daily from beat); unresolved dead letters are kept.
    "JOB_RETENTION_DAYS": int(os.environ.get("BACKLOT_JOB_RETENTION_DAYS", "7")),
    "DEAD_LETTER_RETENTION_DAYS": int(os.environ.get("BACKLOT_DEAD_LETTER_RETENTION_DAYS", "30")),
    # An effect record older than this no longer stops a replay from repeating the effect.
    "EFFECT_RETENTION_DAYS": int(os.environ.get("BACKLOT_EFFECT_RETENTION_DAYS", "90")),
    # A degraded-health cause is alerted at most once per this many seconds.
    "ALERT_INTERVAL": int(os.environ.get("BACKLOT_ALERT_INTERVAL", "900")),
    # A running job's claim lasts this long and is renewed every third of it while it runs:
    # a job whose worker died is re-queued by the relay within about this time.
    "LEASE_SECONDS": float(os.environ.get("BACKLOT_LEASE_SECONDS", "30")),
    # A short job writes its row once, at its finish (jobs.ledger.deferred); 0 writes every
    # run's claim before it starts.
    "DEFER_CLAIM": os.environ.get("BACKLOT_DEFER_CLAIM", "1") != "0",
    "SUCCESS_BATCH": int(os.environ.get("BACKLOT_SUCCESS_BATCH", "32")),
    "SUCCESS_BATCH_SECONDS": float(os.environ.get("BACKLOT_SUCCESS_BATCH_SECONDS", "0.02")),
    # Beat leader lock lifetime (s): a dead leader is replaced within this time.
    "BEAT_LOCK_TTL": int(os.environ.get("BACKLOT_BEAT_LOCK_TTL", "30")),
    # A schedule's fire time missed while no beat ran: "run_once" (fired once when beat is
    # back) or "skip".
    "SCHEDULE_CATCH_UP": os.environ.get("BACKLOT_SCHEDULE_CATCH_UP", "run_once"),
    # Workers take each message and record it as theirs in one Redis step (jobs.broker.fetch); "0"
    # gives kombu's BRPOP and second write back.
    "ATOMIC_FETCH": os.environ.get("BACKLOT_ATOMIC_FETCH", "1") != "0",
    # Adopt mode (jobs.flow.adopt): plain Celery tasks become platform tasks; "1" turns it on.
    "ADOPT_CELERY_TASKS": os.environ.get("BACKLOT_ADOPT_CELERY_TASKS", "0") == "1",
    "REDIS_SENTINELS": REDIS_SENTINELS,
    "REDIS_SENTINEL_MASTER": REDIS_SENTINEL_MASTER,
    "REDIS_SENTINEL_PASSWORD": REDIS_SENTINEL_PASSWORD,
}
# Alert emails go to ADMINS="Ops <ops@example.com>, oncall@example.com" (a bare address is
# its own name).
ADMINS = [
    (name.strip() or address, address)
    for name, address in (
        (name, address.strip(" >") or name.strip())
        for name, _, address in (entry.partition("<") for entry in env_list("ADMINS"))
    )
]
SERVER_EMAIL = os.environ.get("SERVER_EMAIL", DEFAULT_FROM_EMAIL)
EMAIL_SUBJECT_PREFIX = "[Backlot] "

LOGIN_URL = "login"
LOGIN_REDIRECT_URL = "/"
LOGOUT_REDIRECT_URL = "/"
# Uploads (videos, CSV imports) larger than this are refused with 413 before they are stored.
BACKLOT_MAX_UPLOAD_BYTES = int(os.environ.get("BACKLOT_MAX_UPLOAD_BYTES", str(500 * 1024 * 1024)))
FILE_UPLOAD_MAX_MEMORY_SIZE = 5 * 1024 * 1024  # larger uploads stream to a temp file
# A JSON API body larger than this is refused unread with a JSON 413 naming the limit; a route
# may set its own (web.api_input.body_limit: a campaign's recipients take 5 MB).
API_MAX_BODY_BYTES = int(os.environ.get("API_MAX_BODY_BYTES", str(1024 * 1024)))
# A recipients CSV reads at most this many data rows; past it the import ends failed naming
# the row (emails.services).
EMAIL_IMPORT_MAX_ROWS = int(os.environ.get("EMAIL_IMPORT_MAX_ROWS", "100000"))
DATA_UPLOAD_MAX_MEMORY_SIZE = 10 * 1024 * 1024

# --- Standard Tasks API (django.tasks; django-tasks backport on Django 5.2) ------------------
# Code written against Django's Tasks API (@task, .enqueue(), TaskResult) runs on Backlot's
# workers with the platform's ledger, retry policy and dead letters; see docs/tasks-api.md.
# https://docs.djangoproject.com/en/6.0/topics/tasks/
# On Django 5.2 the backport runs as an app, which adds its system checks (a bad TASKS fails
# `manage.py check`); Django 6 has django.tasks built in, with the same TASKS keys and checks.
if django.VERSION < (6, 0):
    INSTALLED_APPS += ["django_tasks"]
TASKS = {
    "default": {
        "BACKEND": "jobs.flow.backends.CeleryBackend",
        # Queues standard tasks may name; each must be one Backlot declares (jobs.tasks.E001).
        "QUEUES": list(BACKLOT_QUEUES),
    }
}
