"""Shared fixtures: real Redis, the PostgreSQL test database, real Celery worker processes."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import imageio_ffmpeg
import pytest
from django.conf import settings

from jobs.broker.redis import redis_client
from jobs.testing import Worker as PlatformWorker
from jobs.testing import wait_until as wait_until  # re-exported: the tests import it from here

# tests.support.import_skips: a test skipped for a package that did not import fails the run.
pytest_plugins = ["tests.support.import_skips"]

ROOT = Path(__file__).resolve().parent.parent
# One folder per pytest-xdist process (scripts/test.sh runs two): worker logs are named by worker.
LOG_DIR = ROOT / ".data" / "test-logs" / os.environ.get("PYTEST_XDIST_WORKER", "main")
# Every ffmpeg run of a worker started here, one line each (tests/support/ffmpeg_logged).
FFMPEG_LOGGED = ROOT / "tests" / "support" / "ffmpeg_logged"
FFMPEG_LOG = LOG_DIR / "ffmpeg-runs.log"
# Test files that share something of the machine's beyond the Redis database and the test
# database (network namespaces and their addresses) run in one pytest-xdist process, in turn.
SHARED_GROUPS = {"tests/scale/": "scale"}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Under pytest-xdist's --dist loadgroup, a file's tests run in one process (its module
    fixtures, workers among them, start once), files of a SHARED_GROUPS folder together.

    First among the hooks: pytest-xdist's own (in each worker) reads the xdist_group marks
    to name each test's group, so they must be there before it runs. Without the grouping
    (on pytest 9, which pyproject therefore excludes) every test was scheduled alone: the two
    parametrized runs of one module fixture ran at once in both processes, sharing what the
    fixture took to be theirs alone (test_host_adopt's Redis database), and module fixtures
    such as tests/scale's cluster started in both."""
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        group = next((g for prefix, g in SHARED_GROUPS.items() if path.startswith(prefix)), path)
        item.add_marker(pytest.mark.xdist_group(group))


# What a pytest-xdist process reports at its end (the security suite's log findings, the fault
# tests' figures) reaches the main process through its workeroutput; printed and judged here.
_NODE_REPORTS: dict[str, list[Any]] = {"log_findings": [], "logs_scanned": [], "fault_figures": []}


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    output = getattr(node, "workeroutput", {}) or {}
    for key, values in _NODE_REPORTS.items():
        values.extend(output.get(key, []))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _NODE_REPORTS["log_findings"] and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _NODE_REPORTS["fault_figures"]:
        terminalreporter.section("fault-injection figures")
        for line in _NODE_REPORTS["fault_figures"]:
            terminalreporter.write_line(f"faults: {line}")
    if _NODE_REPORTS["logs_scanned"]:
        findings = _NODE_REPORTS["log_findings"]
        if findings:
            terminalreporter.section("personal data or secrets in worker logs", red=True)
            for finding in findings:
                terminalreporter.write_line(finding)
        terminalreporter.write_line(
            f"security: log scan of {sum(_NODE_REPORTS['logs_scanned'])} worker log(s) written "
            f"this session: {len(findings)} finding(s)"
        )


def marks(key: str) -> list[tuple[float, str]]:
    """Entries the test jobs appended with tests.support.tasks.mark, as (time, value)."""
    out = []
    for raw in redis_client().lrange(f"test:{key}", 0, -1):
        text = raw.decode() if isinstance(raw, bytes) else raw
        stamp, _, value = text.partition("|")
        out.append((float(stamp), value))
    return out


def set_flag(key: str) -> None:
    redis_client().set(f"test:flag:{key}", 1, ex=120)


class Worker(PlatformWorker):
    """A real `celery worker` process of this project against the test database and Redis."""

    def __init__(self, name: str, queues: str, concurrency: int, env: dict[str, str]) -> None:
        super().__init__(
            "config",
            queues=queues,
            concurrency=concurrency,
            name=name,
            env=env,
            cwd=ROOT,
            log_dir=LOG_DIR,
            extra_args=[
                "-I",
                "tests.support.tasks,tests.support.celery_tasks",
                "--without-gossip",
                "--without-mingle",
                "--without-heartbeat",
                "-l",
                "INFO",
            ],
        )


@pytest.fixture(scope="session", autouse=True)
def _flush_outlasts_a_deadlock() -> Iterator[None]:
    """A transactional test's teardown TRUNCATEs every table, locking them in Django's order;
    a session worker still finishing an earlier test's job (UPDATE jobs_job, then INSERT
    jobs_deadletter) locks two of them in the other order. PostgreSQL breaks that deadlock by
    failing one side: when it is the TRUNCATE (its transaction rolled back whole), try again.
    Seen once in CI (stop 35) at the teardown of test_keys_are_scoped_per_task."""
    from django.db import OperationalError
    from django.db.backends.base.operations import BaseDatabaseOperations

    flush = BaseDatabaseOperations.execute_sql_flush

    def execute_sql_flush(self: BaseDatabaseOperations, sql_list: list[str]) -> None:
        for attempt in range(1, 6):
            try:
                return flush(self, sql_list)
            except OperationalError as error:
                if "deadlock detected" not in str(error) or attempt == 5:
                    raise

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(BaseDatabaseOperations, "execute_sql_flush", execute_sql_flush)
        yield


@pytest.fixture(scope="session")
def smtp_server() -> Iterator[Any]:
    """A real SMTP server (aiosmtpd) in this process; every worker sends to it."""
    from tests.support.smtp import SMTPServer

    server = SMTPServer()
    server.start()
    yield server
    server.stop()


@pytest.fixture
def mailbox(smtp_server: Any) -> Any:
    """The SMTP server's mailbox, emptied, with no refusals or holds set."""
    smtp_server.mailbox.reset()
    yield smtp_server.mailbox
    smtp_server.mailbox.reset()


@pytest.fixture(scope="session")
def worker_env(django_db_setup: Any, django_db_blocker: Any, smtp_server: Any) -> dict[str, str]:
    db = settings.DATABASES["default"]
    if db["ENGINE"] != "django.db.backends.postgresql":
        raise pytest.UsageError(
            "Worker tests need PostgreSQL shared with worker processes: run them via `make test`, "
            "which starts PostgreSQL and sets DATABASE_URL (tests/sqlite runs real workers on a "
            "SQLite file of its own, whatever DATABASE_URL says)."
        )
    url = f"postgres://{db['USER']}:{db['PASSWORD']}@{db['HOST']}:{db['PORT']}/{db['NAME']}"
    return {
        **os.environ,
        "DATABASE_URL": url,
        "REDIS_URL": settings.REDIS_URL,
        "BACKLOT_PROGRESS_INTERVAL": "0.1",
        # The session worker serves test after test: counts its pool processes held past a
        # test's end would land in the next test's Redis. Each finish writes them, as before
        # jobs.broker.counters.hold (whose timer tests/system/faults/test_counts_with_the_ack.py
        # runs in a worker of its own).
        "BACKLOT_METRICS_HOLD_SECONDS": "0",
        "PYTHONUNBUFFERED": "1",
        "EMAIL_HOST": "127.0.0.1",
        "EMAIL_PORT": str(smtp_server.port),
        "MEDIA_ROOT": str(settings.MEDIA_ROOT),
        # Test workers run --without-heartbeat --without-gossip, which leaves their event
        # dispatcher off altogether unless task events are on: Flower (tests/system) needs them.
        "CELERY_EVENTS": "1",
        # ffmpeg through a wrapper that logs each run before it execs the real binary: a test
        # counts the runs from the log (tests/media_pipeline/test_rendition_steps.py).
        "IMAGEIO_FFMPEG_EXE": str(FFMPEG_LOGGED),
        "BACKLOT_TEST_FFMPEG_REAL": imageio_ffmpeg.get_ffmpeg_exe(),
        "BACKLOT_TEST_FFMPEG_LOG": str(FFMPEG_LOG),
    }


@pytest.fixture(scope="session")
def start_worker(worker_env: dict[str, str]) -> Iterator[Callable[..., Worker]]:
    started: list[Worker] = []

    def start(
        name: str = "worker", queues: str = "default,emails,media", concurrency: int = 2, **env: str
    ) -> Worker:
        worker = Worker(name, queues, concurrency, {**worker_env, **env})
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.stop()


@pytest.fixture(scope="session")
def session_worker(start_worker: Callable[..., Worker]) -> Worker:
    """One worker for default, emails and media; the `reports` queue is left to tests' own."""
    return start_worker("session")


@pytest.fixture
def clean_redis() -> None:
    """Empty queues, buckets and test marks; keep kombu's exchange bindings."""
    client = redis_client()
    doomed = [key for key in client.scan_iter(count=1000) if not key.startswith(b"_kombu.binding.")]
    if doomed:
        client.delete(*doomed)


@pytest.fixture
def worker(session_worker: Worker, clean_redis: None, transactional_db: None) -> Worker:
    """A running worker, an empty broker, and committed (transactional) test data."""
    return session_worker


@pytest.fixture
def unique() -> str:
    return uuid.uuid4().hex[:12]
