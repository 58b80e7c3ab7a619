"""The conftest of Celery's integration suite when it runs against Backlot.

The run tree's t/integration/conftest.py (written by tests.celery_compat.run) is
``from tests.celery_compat.harness import *``. It replaces Celery's conftest plumbing only:

- the app is this project's (config.celery: its Django settings, Backlot's Celery settings,
  the ledger's result backend), not Celery's test app with its own broker and backend;
- ``celery_session_worker`` is a real ``celery -A config worker`` process (prefork,
  concurrency 1, as Celery's session worker), named like Celery's in-process worker
  (``anon_nodename()``, which test_inspect.py expects), importing the same tasks module;
  on RabbitMQ (BROKER_URL=amqp://...) a ``manage.py jobs relay`` process runs beside it, as in
  a deployment: there a countdown or a retry waits in the ledger until the relay publishes it
  (jobs.broker.amqp), where Redis holds it broker-side;
- ``manager`` is Celery's ``Manager`` on that app; its teardown does what
  ``Manager.wait_until_idle`` does (purge, then wait until the worker has no active task),
  asking the one worker (an answer ends the wait, not a fixed one-second broadcast);
- the helpers the tests import from their conftest (``flaky``, ``check_for_logs``,
  ``get_redis_connection``, ``get_active_redis_channels``) are Celery's own, from its
  original conftest (kept as t/integration/celery_conftest.py); ``TEST_BROKER`` and
  ``TEST_BACKEND`` are the project's broker and result backend;
- a shard leaves out the tests CELERY_COMPAT_DESELECT names (other shards run them);
- every test gets the harness's timeout (CELERY_COMPAT_TIMEOUT seconds), which replaces the
  300 s of Celery's ``flaky`` marker; there is no rerun of flaky tests (pytest-rerunfailures
  is not installed), so one run is one outcome;
- each test's outcome is written to CELERY_COMPAT_OUTCOMES (JSON) for the comparison.

No test and no assertion of Celery's is changed.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import django
import pytest

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
django.setup()

from celery import Celery  # noqa: E402 - Django first: the tasks import jobs' models
from celery.contrib.testing.manager import Manager  # noqa: E402
from celery.utils.nodenames import anon_nodename  # noqa: E402
from django.db import connections  # noqa: E402

from config.celery import app as project_app  # noqa: E402
from jobs.broker import amqp  # noqa: E402

project_app.set_current()
project_app.set_default()

# Celery's conftest, kept beside ours; its helpers are used as they are. Importing it imports
# t.integration.tasks, which declares the tasks with the decorator picked for this run.
from t.integration import celery_conftest  # noqa: E402
from t.integration import tasks as celery_tasks  # noqa: E402

logger = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[2]
TEST_BROKER: str = str(project_app.conf.broker_url)
TEST_BACKEND: str = str(project_app.conf.result_backend)
flaky = celery_conftest.flaky
check_for_logs = celery_conftest.check_for_logs
get_redis_connection = celery_conftest.get_redis_connection
get_active_redis_channels = celery_conftest.get_active_redis_channels

NODENAME = anon_nodename()  # what Celery's in-process session worker is called
TIMEOUT = float(os.environ.get("CELERY_COMPAT_TIMEOUT", "60"))
TIMEOUT_MESSAGE = "from pytest-timeout"  # in its failure: "Timeout (>60.0s) from pytest-timeout."
CONCURRENCY = int(os.environ.get("CELERY_COMPAT_CONCURRENCY", "1"))
LOG_DIR = Path(os.environ.get("CELERY_COMPAT_LOG_DIR", ROOT / ".data" / "celery-compat"))


# `manage.py jobs relay`, once Celery's test tasks are registered: the relay publishes a job only
# of a task it knows, and the worker's `-I t.integration.tasks` is no setting it could read.
RELAY = (
    "import django; django.setup(); import t.integration.tasks; "
    "from django.core.management import call_command; call_command('jobs', 'relay')"
)


def _start(command: list[str], log_path: Path, **env: str) -> subprocess.Popen[bytes]:
    """A process of this project in a session of its own, its output in ``log_path``."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        return subprocess.Popen(
            command,
            cwd=ROOT,
            env={**os.environ, **env},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _stop(process: subprocess.Popen[bytes], grace: float) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)


class SessionWorker:
    """A real ``celery -A config worker`` process consuming the default queue, and on RabbitMQ
    the relay that publishes its delayed and retried jobs."""

    def __init__(self, app: Celery, nodename: str, log_path: Path) -> None:
        self.app = app
        self.hostname = nodename
        self.log_path = log_path
        self.relay: subprocess.Popen[bytes] | None = None
        if amqp.enabled():
            relay_log = log_path.with_name(log_path.name.replace("worker-", "relay-", 1))
            self.relay = _start([sys.executable, "-c", RELAY], relay_log)
        queue = str(app.conf.task_default_queue)
        command = [
            sys.executable, "-m", "celery", "-A", "config", "worker",
            "-Q", queue, "-P", "prefork", "-c", str(CONCURRENCY), "-n", nodename,
            "-I", "t.integration.tasks", "-l", "INFO",
            "--without-gossip", "--without-mingle", "--without-heartbeat",
        ]  # fmt: skip
        self.process = _start(command, log_path, CELERY_COMPAT_WORKER="1")
        deadline = time.monotonic() + 120
        try:
            while not self.ready():
                if time.monotonic() > deadline:
                    raise RuntimeError(f"worker {nodename} did not answer a ping in 120 s")
                time.sleep(0.25)
        except BaseException:  # the worker, and the relay started before it, are stopped
            self.stop()
            raise

    def ready(self) -> bool:
        if self.process.poll() is not None:
            tail = self.log_path.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"worker {self.hostname} exited:\n{tail}")
        return bool(self.app.control.ping(destination=[self.hostname], timeout=0.5))

    def stop(self) -> None:
        _stop(self.process, grace=40)
        if self.relay is not None:
            _stop(self.relay, grace=10)


_started = time.monotonic()
_workers: list[SessionWorker] = []  # the session's one worker, once started
_outcomes: dict[str, dict[str, Any]] = {}


def _session_worker() -> SessionWorker:
    if not _workers:
        # worker-job.log for outcomes-job.json, worker-control.log, worker-job-rerun.log...
        outcomes = Path(os.environ.get("CELERY_COMPAT_OUTCOMES", "outcomes-run.json"))
        name = outcomes.stem.removeprefix("outcomes-")
        _workers.append(SessionWorker(project_app, NODENAME, LOG_DIR / f"worker-{name}.log"))
    return _workers[0]


# ------------------------------------------------------------------------------ hooks


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # The tests another shard runs (CELERY_COMPAT_DESELECT, space-separated ids): a test whose
    # id is one of them, or one of them plus its parameters. pytest's --deselect takes any id
    # it is a prefix of: test_retry would take test_retry_with_unpickleable_exception too.
    deselect = set(os.environ.get("CELERY_COMPAT_DESELECT", "").split())
    if deselect:
        dropped = [item for item in items if item.nodeid.split("[")[0] in deselect]
        if dropped:
            config.hook.pytest_deselected(items=dropped)
            items[:] = [item for item in items if item not in dropped]
    # First in the list: the closest timeout marker, ahead of Celery's flaky(300 s).
    for item in items:
        item.add_marker(pytest.mark.timeout(TIMEOUT), append=False)


def _interrupted(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def pytest_configure(config: pytest.Config) -> None:
    # SIGTERM (scripts/celery-compat.sh interrupted) ends the session the way Ctrl-C does, so
    # pytest_sessionfinish still stops the worker (it runs in a session of its own).
    signal.signal(signal.SIGTERM, _interrupted)


def pytest_collection_finish(session: pytest.Session) -> None:
    # The worker starts before the first test, so its start-up is not in a test's timeout.
    if session.items and not session.config.option.collectonly:
        _session_worker()


def _message(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    if longrepr is None:
        return ""
    if isinstance(longrepr, tuple):  # a skip: (path, line, reason)
        return str(longrepr[2])
    crash = getattr(longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(longrepr)
    lines = [line for line in text.splitlines() if line.strip()]
    return (lines[0] if lines else "")[:300]


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    entry = _outcomes.setdefault(report.nodeid, {"outcome": "passed", "message": "", "seconds": 0})
    if type(report).__name__ == "SubtestReport":
        if report.failed:
            message = _message(report)
            entry.setdefault("subtest_message", message)
            if TIMEOUT_MESSAGE in message:
                # The subtest caught pytest-timeout's exception and the test goes on with no
                # timer left: fire it again, so each remaining subtest fails at once too.
                signal.setitimer(signal.ITIMER_REAL, 0.05)
        return
    entry["seconds"] = round(entry["seconds"] + report.duration, 2)
    wasxfail = hasattr(report, "wasxfail")
    if report.when == "call":
        if report.passed:
            entry["outcome"] = "xpassed" if wasxfail else "passed"
        elif report.skipped:
            entry["outcome"] = "xfailed" if wasxfail else "skipped"
        else:
            entry["outcome"] = "failed"
        if not report.passed:
            entry["message"] = _message(report)
            if entry["message"].startswith("contains") and "subtest_message" in entry:
                entry["message"] = f"{entry['message']}; first: {entry['subtest_message']}"
    elif report.failed:  # setup or teardown
        if entry["outcome"] in ("passed", "xpassed"):
            entry["outcome"] = "error"
            entry["message"] = f"{report.when}: {_message(report)}"
    elif report.skipped:  # skipped in setup (skip marker, a fixture's pytest.skip)
        entry["outcome"] = "xfailed" if wasxfail else "skipped"
        entry["message"] = _message(report)


def pytest_runtest_logfinish(nodeid: str, location: tuple[str, int | None, str]) -> None:
    # A fresh database connection for each test: a timeout that fires inside a query leaves
    # the test process's connection mid-command, and every later query would fail on it.
    for connection in connections.all(initialized_only=True):
        try:
            connection.close()
        except Exception:  # Django forgets the connection either way
            logger.debug("closing %s after %s failed", connection.alias, nodeid, exc_info=True)


def pytest_collectreport(report: pytest.CollectReport) -> None:
    # A module that fails to import under one decorator has no test ids: say so under its own.
    if report.failed:
        _outcomes[report.nodeid] = {
            "outcome": "error",
            "message": f"collection: {_message(report)}",  # type: ignore[arg-type]
            "seconds": 0,
        }


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    while _workers:
        _workers.pop().stop()
    path = os.environ.get("CELERY_COMPAT_OUTCOMES")
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(
            json.dumps(
                {
                    "decorator": os.environ.get("CELERY_COMPAT_DECORATOR", "job"),
                    "exitstatus": int(exitstatus),
                    "seconds": round(time.monotonic() - _started, 1),
                    "refused_declarations": dict(celery_tasks.CELERY_COMPAT_REFUSED),
                    "tests": _outcomes,
                },
                indent=1,
                sort_keys=True,
            )
        )


# ---------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="session")
def celery_session_app() -> Celery:
    return project_app


@pytest.fixture(scope="session")
def celery_session_worker() -> SessionWorker:
    return _session_worker()


@pytest.fixture
def celery_app() -> Celery:
    return project_app


@pytest.fixture
def app(celery_app: Celery) -> Iterator[Celery]:
    yield celery_app


@pytest.fixture
def celery_worker() -> None:
    """As in Celery's conftest: the suite shares one session worker."""
    pytest.fail(
        "The integration suite runs against a single shared session worker "
        "(celery_session_worker); spawning per-test workers is not supported."
    )


def _wait_until_idle(app: Celery, worker: SessionWorker) -> None:
    """Manager.wait_until_idle, asking our one worker instead of waiting out a broadcast."""
    with app.connection_for_write() as connection:
        while app.control.purge(connection=connection):
            pass
        inspect = app.control.inspect(
            destination=[worker.hostname], limit=1, timeout=5.0, connection=connection
        )
        while True:
            active = inspect.active()
            if active is None:  # no answer: Celery's own loop gives up here too
                raise RuntimeError(f"{worker.hostname} did not answer inspect().active()")
            if sum(len(tasks) for tasks in active.values()) == 0:
                return
            time.sleep(0.05)


@pytest.fixture
def manager(app: Celery, celery_session_worker: SessionWorker) -> Iterator[Manager]:
    manager = Manager(app)
    yield manager
    try:
        _wait_until_idle(app, celery_session_worker)
    except Exception as e:  # noqa: BLE001 - as Celery's fixture: logged, not failed
        logger.warning("Failed to stop Celery test manager cleanly: %s", e)


@pytest.fixture(autouse=True)
def ZZZZ_set_app_current(app: Celery, celery_session_app: Celery) -> Iterator[None]:
    # Celery's also fails a test that declared queues besides `celery`; this app's queues are
    # Backlot's (default, emails, reports, media), declared by jobs.worker.celery, not by a test.
    app.set_current()
    app.set_default()
    yield


__all__ = [
    "NODENAME",
    "TEST_BACKEND",
    "TEST_BROKER",
    "ZZZZ_set_app_current",
    "app",
    "celery_app",
    "celery_session_app",
    "celery_session_worker",
    "celery_worker",
    "check_for_logs",
    "flaky",
    "get_active_redis_channels",
    "get_redis_connection",
    "manager",
    "pytest_collection_finish",
    "pytest_collection_modifyitems",
    "pytest_collectreport",
    "pytest_configure",
    "pytest_runtest_logfinish",
    "pytest_runtest_logreport",
    "pytest_sessionfinish",
]
