"""tests.support.import_skips: a test skipped because a package is missing fails the run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

SKIPPING = """
import pytest

def test_inside():
    pytest.importorskip("backlot_no_such_package")

def test_other_skip():
    pytest.skip("not for this platform")
"""
SKIPPING_MODULE = """
import pytest

pytest.importorskip("backlot_no_such_package")

def test_never_collected():
    pass
"""


def run(tmp_path: Path, source: str, **env: str) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "test_skipping.py"
    path.write_text(source)
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "tests.support.import_skips",
            "-p",
            "no:django",
            "-p",
            "no:cacheprovider",
            "-q",
            "-rA",
            "--rootdir",
            str(tmp_path),
            str(path),
        ],
        check=False,
        cwd=ROOT,
        env={**os.environ, "BACKLOT_ALLOW_IMPORT_SKIPS": "", **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_skip_for_a_missing_package_fails_and_names_it(tmp_path: Path) -> None:
    result = run(tmp_path, SKIPPING)

    assert result.returncode == 1, result.stdout + result.stderr
    assert "1 failed, 1 skipped" in result.stdout
    assert "backlot_no_such_package" in result.stdout and "dev extra" in result.stdout


def test_a_module_skipped_for_a_missing_package_fails(tmp_path: Path) -> None:
    result = run(tmp_path, SKIPPING_MODULE)

    assert result.returncode != 0, result.stdout
    assert "backlot_no_such_package" in result.stdout and "dev extra" in result.stdout


@pytest.mark.parametrize("source", [SKIPPING, SKIPPING_MODULE])
def test_the_skip_is_allowed_when_asked(tmp_path: Path, source: str) -> None:
    result = run(tmp_path, source, BACKLOT_ALLOW_IMPORT_SKIPS="1")

    # 0: the tests passed or skipped; 5: the skipped module left no test to run
    assert result.returncode in (0, 5), result.stdout + result.stderr
    assert "failed" not in result.stdout
