"""@job is typed with ParamSpec: mypy checks `.enqueue()` against the job function's signature."""

from __future__ import annotations

import textwrap
from pathlib import Path

from mypy import api

from tests.conftest import ROOT


def mypy_errors(tmp_path: Path, code: str) -> str:
    source = tmp_path / "calls.py"
    source.write_text(textwrap.dedent(code))
    out, err, _ = api.run(["--config-file", str(ROOT / "pyproject.toml"), str(source)])
    return "\n".join(line for line in (out + err).splitlines() if "calls.py" in line)


def test_mypy_checks_enqueue_against_the_job_signature(tmp_path):
    errors = mypy_errors(
        tmp_path,
        """
        from tests.support.tasks import add, progress

        add.enqueue(1, 2)
        add.using(priority=9, delay=5).enqueue(1, b=2)
        progress.enqueue("key", 3)  # bind=True: `self` is not part of the call
        add.enqueue(1, "x")
        add.enqueue(1)
        add.using(priority=9).enqueue(1, c=2)
        """,
    )

    lines = errors.splitlines()
    assert len(lines) == 3, errors
    assert (
        ':7: error: Argument 2 to "enqueue" of "PlatformTask" has incompatible type "str"' in errors
    )
    assert ":8: error: Missing positional argument" in errors
    assert ':9: error: Unexpected keyword argument "c"' in errors
