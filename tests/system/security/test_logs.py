"""Worker logs carry masked addresses only, and the end-of-session scan can tell the difference."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import pytest

from jobs.core.masking import mask_email
from jobs.models import Job, JobState
from tests.conftest import wait_until
from tests.support.tasks import refused
from tests.system.security import conftest as security_conftest
from tests.system.security.logscan import logs_written_since, scan_file

ADDRESS = "leak.check@example.com"


def test_a_refused_address_reaches_the_worker_log_masked_only(worker, unique):
    # given a job whose failure message names the recipient (as an SMTP 550 reply does)
    handle = refused.enqueue(unique, to=ADDRESS)

    # when it dies on the worker
    wait_until(
        lambda: Job.objects.filter(id=handle.id, state=JobState.DEAD).exists(),
        timeout=30,
        what=f"job {handle.id} to be dead",
    )

    # then its log lines show the address masked, never raw
    masked = mask_email(ADDRESS)
    lines = wait_until(
        lambda: [
            line for line in worker.output().splitlines() if handle.id in line and masked in line
        ],
        timeout=10,
        what="the job's failure in the worker log",
    )
    assert masked == "l***@example.com" and lines
    assert ADDRESS not in worker.output()
    assert not [f for f in scan_file(worker.log_path) if f.kind == "email address"]


def test_the_scan_flags_raw_addresses_and_secrets_and_passes_masked_ones(tmp_path: Path):
    log = tmp_path / "worker.log"
    log.write_text(
        "INFO job dead: 550 recipient refused: l***@example.com\n"  # masked: fine
        "INFO Message-ID <6f1c@backlot> sent to x@example.com\n"  # no TLD / one letter: fine
        "ERROR 550 recipient refused: leak.check@example.com\n"  # raw address
        "DEBUG Authorization: Bearer s3cr3t-token-value\n"  # a secret the suite used
    )

    findings = scan_file(log, secrets=["s3cr3t-token-value"])

    assert [(f.line, f.kind) for f in findings] == [(3, "email address"), (4, "secret")]
    shown = "\n".join(str(f) for f in findings)
    assert ADDRESS not in shown and "s3cr3t-token-value" not in shown
    assert f"{log}:3: email address:" in shown and "<secret>" in shown


def test_only_logs_written_since_the_session_started_are_scanned(tmp_path: Path):
    old, new = tmp_path / "old.log", tmp_path / "new.log"
    old.write_text("")
    new.write_text("")
    started = new.stat().st_mtime
    os.utime(old, (started - 3600, started - 3600))

    assert logs_written_since(tmp_path, started) == [new]


def test_a_raw_address_in_a_log_fails_a_session_whose_tests_passed(tmp_path, monkeypatch):
    (tmp_path / "worker.log").write_text("ERROR 550 recipient refused: leak.check@example.com\n")
    monkeypatch.setattr(security_conftest, "LOG_DIR", tmp_path)
    config = SimpleNamespace(stash=pytest.Stash())
    session = SimpleNamespace(config=config, exitstatus=pytest.ExitCode.OK)
    session.config.stash[security_conftest.SESSION_START] = 0.0

    # a stand-in with the two attributes the hook reads
    security_conftest.pytest_sessionfinish(cast(pytest.Session, session), exitstatus=0)

    assert session.exitstatus == pytest.ExitCode.TESTS_FAILED
    scanned, [finding] = session.config.stash[security_conftest.LOG_FINDINGS]
    assert scanned == 1 and finding.line == 1 and "l***@example.com" in finding.shown
