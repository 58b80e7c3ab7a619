"""Security suite fixtures, and the end-of-session scan of worker logs for personal data.

Every worker log written during the session (tests.conftest.LOG_DIR, any test's workers, not
only this folder's) is scanned when the session ends for raw email addresses and for the
tokens, passwords and names this suite used (logscan.remember_secret). A hit prints the file
and line (masked) and fails the session even when every test passed.
"""

from __future__ import annotations

import secrets
import time
from typing import Any

import pytest
from django.contrib.auth.models import Permission

from tests.conftest import LOG_DIR
from tests.system.security.logscan import (
    Finding,
    logs_written_since,
    remember_secret,
    remembered_secrets,
    scan_file,
)
from web.models import ApiToken

# When this conftest is not an initial one (`pytest tests`), pytest_sessionstart is not called
# for it; it is imported at collection, still before any test starts a worker.
_IMPORTED_AT = time.time()
SESSION_START = pytest.StashKey[float]()
LOG_FINDINGS = pytest.StashKey[tuple[int, list[Finding]]]()
# A log last written up to this long before the session started is scanned too (mtime rounding).
MTIME_SLACK = 1.0


def pytest_sessionstart(session: pytest.Session) -> None:
    session.config.stash[SESSION_START] = time.time()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    manager = getattr(session.config, "pluginmanager", None)  # a test's stand-in has none
    if manager is not None and manager.has_plugin("dsession"):
        return  # pytest-xdist's main process: its processes scan their logs (tests/conftest.py)
    since = session.config.stash.get(SESSION_START, _IMPORTED_AT) - MTIME_SLACK
    logs = logs_written_since(LOG_DIR, since)
    secrets_used = remembered_secrets()
    findings = [finding for path in logs for finding in scan_file(path, secrets_used)]
    session.config.stash[LOG_FINDINGS] = (len(logs), findings)
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # a pytest-xdist process: tests/conftest.py reports them
        workeroutput["logs_scanned"] = [len(logs)]
        workeroutput["log_findings"] = [str(finding) for finding in findings]
    if findings and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    if LOG_FINDINGS not in config.stash:
        return  # no scan here (pytest-xdist's main process prints its processes' scans)
    scanned, findings = config.stash[LOG_FINDINGS]
    if findings:
        terminalreporter.section("personal data or secrets in worker logs", red=True)
        for finding in findings:
            terminalreporter.write_line(str(finding))
    terminalreporter.write_line(
        f"security: log scan of {scanned} worker log(s) written this session: "
        f"{len(findings)} finding(s)"
    )


@pytest.fixture
def api_user(django_user_model: Any) -> Any:
    """A fresh, non-staff user whose password and surname the log scan looks for; it may request
    the operations report (the report this suite posts: reports.access)."""
    user = django_user_model.objects.create_user(
        f"security-{secrets.token_hex(4)}",
        password=remember_secret(secrets.token_urlsafe(18)),
        first_name="Ingrid",
        last_name=remember_secret("Sikkerhetsen"),
    )
    user.user_permissions.add(Permission.objects.get(codename="request_operations_report"))
    return user


@pytest.fixture
def api_token(api_user: Any) -> str:
    """A bearer token of `api_user` (the plain key, which the log scan looks for)."""
    _, key = ApiToken.issue(user=api_user, name="security suite")
    return remember_secret(key)
