"""Runs one case in this process: python -m benchmarks.run_case NAME OUT.json [--full].

Called by the runner (python -m benchmarks) with DATABASE_URL and REDIS_URL set; writes the
case's figures as JSON to OUT.json.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import sys
import traceback


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("case")
    parser.add_argument("out")
    parser.add_argument("--full", action="store_true")
    opts = parser.parse_args()
    # The runner ends a case past its timeout with SIGTERM: unwind, so `with Workers()` blocks
    # stop the workers this case started.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    os.environ["DJANGO_SETTINGS_MODULE"] = "config.settings"
    import django

    django.setup()
    import benchmarks.jobs  # noqa: F401  (registers the bench.* tasks in this process)
    from benchmarks.cases import CASES, EXTRA

    target, _, _ = {**CASES, **EXTRA}[opts.case]
    module, _, func = target.partition(":")
    run = getattr(importlib.import_module(module), func)
    try:
        result = run(full=opts.full)
    except Exception:  # noqa: BLE001 (any failure becomes the case's recorded error)
        traceback.print_exc()
        with open(opts.out, "w") as fh:
            json.dump({"case": opts.case, "error": traceback.format_exc(limit=8)}, fh, indent=1)
        return 1
    with open(opts.out, "w") as fh:
        json.dump(result.as_dict(), fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
