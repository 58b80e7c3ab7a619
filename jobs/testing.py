"""What a host project's own tests need from Backlot.

- ``run_job(handle)``: run one enqueued job in this process through the real path a worker
  takes — claim (queued → running, with a lease), run, decide with the retry policy, finish
  (succeeded / retrying / dead with its dead letter) — against the ledger. Not eager mode: the
  job's arguments come back from the ledger row as JSON, and a job that is not claimable (not
  due, already finished) is not run.
- ``wait_until(predicate)``: bounded polling, for tests that wait on a real worker.
- ``Worker`` and ``worker_fixture(...)``: a real ``celery worker`` process of the project, as a
  pytest fixture that starts it, waits until it answers a ping and stops it by its PID.

    # conftest.py of a host project
    from jobs.testing import worker_fixture
    celery_worker = worker_fixture("myproject", queues="default")

    def test_report_is_built(celery_worker, transactional_db):
        handle = build_report.enqueue(report.pk)
        wait_until(lambda: handle.job().state == "succeeded", what="the report")
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from celery import current_app
from celery.exceptions import Ignore, Reject, Retry

from jobs.enqueue.submit import JobHandle
from jobs.models import Job
from jobs.worker.registry import task_by_name


def wait_until(
    predicate: Callable[[], Any],
    timeout: float = 20,
    interval: float = 0.05,
    what: str = "condition",
) -> Any:
    """Poll `predicate` until it returns something truthy (and return it); fail with an
    AssertionError naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def run_job(handle: JobHandle | str) -> Job:
    """Run one enqueued job here, the way a worker runs its message; returns its ledger row
    afterwards (succeeded, retrying, dead — or unchanged when it was not claimable).

    The job's own exception is not raised: read the row (``state``, ``error``, the dead
    letter). Retries are not followed: run it again once it is due.
    """
    job_id = handle.id if isinstance(handle, JobHandle) else str(handle)
    job = Job.objects.get(id=job_id)
    task = task_by_name(job.task_name)
    task.push_request(
        id=str(job.id),
        called_directly=False,
        is_eager=False,
        retries=max(0, job.attempts),
        delivery_info={"routing_key": job.queue, "priority": job.priority},
        args=list(job.args),
        kwargs=dict(job.kwargs),
    )
    try:
        task(*job.args, **job.kwargs)
    except (Retry, Ignore, Reject):
        pass  # a retry was scheduled, or the delivery was dropped: the row says which
    except Exception:  # noqa: BLE001 - the job gave up; its dead letter holds the exception
        pass
    finally:
        task.pop_request()
    job.refresh_from_db()
    return job


class Worker:
    """A real `celery worker` process; `stop()` ends it by its PID (SIGTERM, then SIGKILL)."""

    def __init__(
        self,
        app: str,
        *,
        queues: str = "default",
        concurrency: int = 1,
        name: str = "worker",
        env: dict[str, str] | None = None,
        cwd: str | Path | None = None,
        extra_args: Sequence[str] = (),
        log_dir: str | Path | None = None,
        ready_timeout: float = 60,
    ) -> None:
        self.name = f"{name}-{uuid.uuid4().hex[:6]}@localhost"
        folder = Path(log_dir or tempfile.gettempdir())
        folder.mkdir(parents=True, exist_ok=True)
        self.log_path = folder / f"{self.name.split('@')[0]}.log"
        command = [
            sys.executable, "-m", "celery", "-A", app, "worker", "-Q", queues,
            "-c", str(concurrency), "-n", self.name, *extra_args,
        ]  # fmt: skip
        # The worker writes to its own copy of the descriptor; ours is closed once it started.
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                command,
                cwd=cwd,
                env={**os.environ, **(env or {})},
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        try:
            wait_until(self.ready, timeout=ready_timeout, interval=0.25, what=f"{self.name}")
        except BaseException:
            self.stop()
            raise

    def ready(self) -> bool:
        if self.process.poll() is not None:
            raise AssertionError(f"worker {self.name} exited:\n{self.output()[-3000:]}")
        return bool(current_app.control.ping(destination=[self.name], timeout=0.5))

    def pool_pids(self) -> list[int]:
        out = subprocess.run(
            ["ps", "-o", "pid=", "--ppid", str(self.process.pid)],
            capture_output=True,
            text=True,
            check=False,  # ps exits 1 when the worker has no children
        ).stdout
        return [int(p) for p in out.split()]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")


def worker_fixture(
    app: str, *, scope: str = "session", **options: Any
) -> Callable[..., Iterator[Worker]]:
    """A pytest fixture running one real worker of `app` (options as for Worker) while the
    tests that use it run. Needs a database the worker process can see: PostgreSQL (or a file
    SQLite) and `transactional_db` in the tests that enqueue for it."""
    import pytest  # only a test run has pytest, and only it calls this

    def fixture() -> Iterator[Worker]:
        worker = Worker(app, **options)
        try:
            yield worker
        finally:
            worker.stop()

    made: Callable[..., Iterator[Worker]] = pytest.fixture(scope=scope)(fixture)  # type: ignore[call-overload]
    return made
