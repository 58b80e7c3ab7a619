from django.apps import AppConfig


class JobsConfig(AppConfig):
    default_auto_field = "django.db.models.BigAutoField"
    name = "jobs"
    verbose_name = "Jobs"

    def ready(self) -> None:
        # Imported here, not at module level: they need the app registry (models).
        # cancellation: wraps the workers' revoke command so a revoke lands in the ledger;
        # pausing: the workers' pause hooks and their sync command; batches: publishes a
        # batch's callback job right after the finish that fired it; timers: a worker's event
        # loop drops its cancelled time-limit timers; middleware: failed and passed sign-ins
        # move the sign-in throttle's buckets (jobs.web.throttle).
        from jobs.broker import pausing, timers  # noqa: F401
        from jobs.flow import batches, cancellation  # noqa: F401
        from jobs.ledger import sqlite
        from jobs.web import checks, errors, middleware  # noqa: F401
        from jobs.worker import celery, signals, telemetry  # noqa: F401

        celery.adopt_if_asked()  # BACKLOT["ADOPT_CELERY_TASKS"] (jobs.flow.adopt)
        sqlite.connect()  # WAL, busy timeout, IMMEDIATE on a SQLite file (jobs.ledger.sqlite)
        telemetry.connect()
        errors.connect()  # dead jobs to Sentry, when sentry-sdk is installed and initialised
