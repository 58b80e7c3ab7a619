"""The web process of the fault schedule: the project's settings, with the test-only enqueue
endpoint of tests/system/faults/schedule_app.py mounted beside the project's URLs."""

from config.settings import *  # noqa: F403 (the project's settings, unchanged but one)

ROOT_URLCONF = "tests.system.faults.schedule_app"
