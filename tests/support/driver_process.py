"""The tests' end of a driver process (tests.support.driver: `python -m tests.sqlite.driver`,
`python -m tests.amqp.driver`): one JSON command in, one answer out."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from typing import Any

from jobs.testing import wait_until
from tests.conftest import LOG_DIR, ROOT


class Driver:
    """The driver process of `module`, started with `env`; its stderr in a log named `label`."""

    def __init__(self, module: str, env: dict[str, str], label: str) -> None:
        LOG_DIR.mkdir(parents=True, exist_ok=True)
        self.log_path = LOG_DIR / f"{label}-driver-{uuid.uuid4().hex[:6]}.log"
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", module],
                cwd=ROOT,
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
            )

    def __call__(self, cmd: str, **arguments: Any) -> Any:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(json.dumps({"cmd": cmd, **arguments}) + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise AssertionError(f"the driver exited:\n{self.log_path.read_text()[-3000:]}")
        answer = json.loads(line)
        if "error" in answer:
            raise AssertionError(f"driver {cmd}: {answer['error']}\n{answer['traceback']}")
        return answer["ok"]

    def enqueue(self, task: str, *args: Any, kwargs: dict | None = None, **options: Any) -> str:
        """task.using(**options).enqueue(*args, **kwargs) in the driver; the job's id."""
        answer = self("enqueue", task=task, args=list(args), kwargs=kwargs or {}, options=options)
        return str(answer["id"])

    def enqueue_many(self, task: str, calls: list[tuple[list, dict]]) -> list[str]:
        """enqueue_many(task, calls) in one transaction in the driver; the jobs' ids."""
        return list(self("enqueue_many", task=task, calls=[[a, k] for a, k in calls])["ids"])

    def jobs(self, ids: list[str]) -> list[dict[str, Any]]:
        return list(self("jobs", ids=ids)["jobs"])

    def wait_states(
        self, ids: list[str], states: set[str], timeout: float = 60, what: str = "jobs"
    ) -> list[dict[str, Any]]:
        """Poll until every job is in one of `states`; returns their rows."""

        def settled() -> list[dict[str, Any]] | None:
            rows = self.jobs(ids)
            return rows if all(r and r["state"] in states for r in rows) else None

        return list(wait_until(settled, timeout=timeout, interval=0.25, what=what))

    def stop(self) -> None:
        if self.process.poll() is None:
            assert self.process.stdin is not None
            self.process.stdin.close()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
