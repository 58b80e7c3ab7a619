"""The project's settings with worker database connections kept between jobs.

Celery's Django fixup closes every database connection before and after each task unless
CELERY_DB_REUSE_MAX is set, whatever CONN_MAX_AGE says; the drain case runs a second worker
on these settings to measure django-celery-results (and the ledger) with reused connections,
the baseline issue 6 names.
"""

from config.settings import *  # noqa: F403 (a settings overlay: every project setting)

# Close the worker's connections every this many tasks (Celery counts prerun and postrun).
CELERY_DB_REUSE_MAX = 1000
