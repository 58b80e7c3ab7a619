"""The project's settings with the benchmark URLconf (a trivial view beside an enqueue view).

Only the gunicorn process of the HTTP case uses it (DJANGO_SETTINGS_MODULE); everything else
runs on config.settings unchanged.
"""

from config.settings import *  # noqa: F403 (a settings overlay: every project setting)

ROOT_URLCONF = "benchmarks.urls"
