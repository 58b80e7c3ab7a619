"""The project's settings for the test suite (pyproject's DJANGO_SETTINGS_MODULE).

They are config/settings.py's, but for one thing: under pytest-xdist (scripts/test.sh runs the
suite in two processes, `-n 2`) each process gets a Redis database and a media folder of its own,
so that one process's `clean_redis` or files never touch the other's. pytest-django gives each its
own test database (test_backlot_gw0, ...). The choice is made once, in the pytest process, and
written to the environment: the Celery workers and other processes a test starts inherit it, and
a test that passes a REDIS_URL or MEDIA_ROOT of its own keeps it.
"""

from __future__ import annotations

import os
from urllib.parse import urlsplit, urlunsplit

_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")  # "gw0", "gw1", ... under pytest -n
if _WORKER.startswith("gw") and "BACKLOT_SUITE_REDIS_URL" not in os.environ:
    _index = int(_WORKER.removeprefix("gw"))
    _suite_url = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
    os.environ["BACKLOT_SUITE_REDIS_URL"] = _suite_url  # marks the choice as made
    _parts = urlsplit(_suite_url)
    _base = int(_parts.path.strip("/") or 0)
    # Databases base+1, base+2, ...; the host projects of tests/system take 9-11.
    os.environ["REDIS_URL"] = urlunsplit(_parts._replace(path=f"/{_base + 1 + _index}"))
    _data = os.environ.get("BACKLOT_DATA_DIR") or os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".data"
    )
    os.environ.setdefault("MEDIA_ROOT", os.path.join(_data, "media-test", _WORKER))

from config.settings import *  # noqa: E402, F403 (the project's settings, all of them)
