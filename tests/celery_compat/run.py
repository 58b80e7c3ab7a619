"""The two steps of scripts/celery-compat.sh around its pytest runs.

python -m tests.celery_compat.run prepare DEST
    Fetch the source distribution of the installed Celery (cached in .data/celery-sdist),
    extract its t/ into DEST/celery-<version>/ afresh and wire it to this harness: Celery's
    conftest.py and tasks.py are kept as celery_conftest.py and celery_tasks.py, and new
    ones load tests.celery_compat.harness and declare Celery's tasks through
    tests.celery_compat.tasks; pytest.ini carries Celery's own pytest options. Prints the
    tree's path.

python -m tests.celery_compat.run dburl DATABASE_URL DB_NAME
    Print the URL with its database name replaced (--reuse-services: the same server, a
    database of its own).

python -m tests.celery_compat.run createdb DATABASE_URL
    Create the URL's database (owned by its user) when it does not exist.

python -m tests.celery_compat.run clonedb DATABASE_URL TEMPLATE_DB
    (Re)create the URL's database as a copy of TEMPLATE_DB (the migrated one): a shard's own,
    on RabbitMQ, where each shard runs a relay.

python -m tests.celery_compat.run ping|flushdb|hostport REDIS_URL
    Exit 0 when a Redis answers there; empty that one database (before each shard); print
    its host and port.

python -m tests.celery_compat.run merge OUT.json PART.json...
    One half's outcomes from its shards' (one per file of Celery's, run at once).

python -m tests.celery_compat.run unlisted RESULT.json
    The tests that differ and are not listed, one a line (for the rerun).

python -m tests.celery_compat.run compare JOB.json CONTROL.json DOC.md RESULT.json
    Compare the two halves' outcomes: print both counts and every test whose outcome
    differs, write them to RESULT.json, exit 1 when a test passes in the control and
    not under @job while DOC.md (docs/celery-compat.md) does not list it. With
    --rerun RERUN.json (those tests run again under @job), one that passed then is
    reported as flaky and does not fail the comparison. With --broker amqp, the tests
    listed under "Known differences on RabbitMQ" count as listed too.

python -m tests.celery_compat.run amqp-definitions USER COUNT
    Print RabbitMQ definitions (rabbitmqctl import_definitions) of the vhosts compat-0 ..
    compat-(COUNT-1), each with every permission for USER: one vhost per shard.

python -m tests.celery_compat.run amqp-wait URL...
    Wait (up to 30 s) until an AMQP connection opens on each URL: the vhosts an import
    created, which RabbitMQ does after rabbitmqctl has returned.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import re
import shutil
import subprocess
import sys
import tarfile
import tomllib
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
SDIST_CACHE = ROOT / ".data" / "celery-sdist"
# What a test may be in either half; "good" outcomes are what a passing suite gives (an
# xpassed test is one marked xfail(strict=False) that passed).
GOOD = frozenset({"passed", "xfailed", "xpassed"})
OUTCOMES = ("passed", "failed", "error", "skipped", "xfailed", "xpassed", "not run")

CONFTEST_SHIM = '''\
"""Written by tests/celery_compat/run.py: Celery's conftest is celery_conftest.py beside this
file; the fixtures here run the suite on Backlot's app and a real worker process."""

from tests.celery_compat.harness import *  # noqa: F403
'''

TASKS_SHIM = '''\
"""Written by tests/celery_compat/run.py: Celery's tasks (celery_tasks.py beside this file),
declared with the decorator CELERY_COMPAT_DECORATOR names (job or shared_task)."""

from pathlib import Path

from tests.celery_compat.tasks import declare_celery_tasks

declare_celery_tasks(globals(), Path(__file__).with_name("celery_tasks.py"))
'''


def celery_version() -> str:
    return importlib.metadata.version("celery")


def fetch_sdist(version: str) -> Path:
    """The cached sdist of Celery ``version``; downloaded with pip when absent."""
    SDIST_CACHE.mkdir(parents=True, exist_ok=True)
    cached = sorted(SDIST_CACHE.glob(f"celery-{version}.tar.gz"))
    if cached:
        return cached[0]
    print(f"celery-compat: downloading the sdist of celery=={version}", file=sys.stderr)
    command = [
        sys.executable, "-m", "pip", "download", "--quiet", "--no-binary", ":all:",
        "--no-deps", f"celery=={version}", "-d", str(SDIST_CACHE),
    ]  # fmt: skip
    subprocess.run(command, check=True)
    cached = sorted(SDIST_CACHE.glob(f"celery-{version}.tar.gz"))
    if not cached:
        raise SystemExit(f"pip download left no celery-{version}.tar.gz in {SDIST_CACHE}")
    return cached[0]


def _pytest_ini(celery_pyproject: dict[str, Any]) -> str:
    options = celery_pyproject.get("tool", {}).get("pytest", {}).get("ini_options", {})
    markers = list(options.get("markers", []))
    lines = [
        "# Written by tests/celery_compat/run.py from Celery's own pytest options",
        "# (its pyproject.toml), without its testpaths (t/unit/).",
        "[pytest]",
        f"addopts = {options.get('addopts', '')}",
        f"python_classes = {options.get('python_classes', 'test_*')}",
        f"xfail_strict = {str(options.get('xfail_strict', False)).lower()}",
        "markers =",
        *(f"    {marker}" for marker in markers),
    ]
    return "\n".join(lines) + "\n"


def prepare(dest: Path) -> Path:
    version = celery_version()
    sdist = fetch_sdist(version)
    top = f"celery-{version}"
    tree = dest / top
    if tree.exists():
        shutil.rmtree(tree)
    tree.mkdir(parents=True)
    with tarfile.open(sdist) as archive:
        wanted = [
            member
            for member in archive.getmembers()
            if member.name in (f"{top}/pyproject.toml", f"{top}/t/__init__.py")
            or member.name.startswith((f"{top}/t/integration/", f"{top}/t/canvas_helpers.py"))
        ]
        archive.extractall(dest, members=wanted, filter="data")
    integration = tree / "t" / "integration"
    for name in ("conftest.py", "tasks.py", "test_tasks.py", "test_canvas.py"):
        if not (integration / name).is_file():
            raise SystemExit(f"{sdist} has no t/integration/{name}: the harness needs adapting")
    (integration / "conftest.py").rename(integration / "celery_conftest.py")
    (integration / "tasks.py").rename(integration / "celery_tasks.py")
    (integration / "conftest.py").write_text(CONFTEST_SHIM)
    (integration / "tasks.py").write_text(TASKS_SHIM)
    celery_pyproject = tomllib.loads((tree / "pyproject.toml").read_text())
    (tree / "pytest.ini").write_text(_pytest_ini(celery_pyproject))
    print(tree)
    return tree


# ----------------------------------------------------------------------------- compare


# The sections of docs/celery-compat.md that list known differences, by broker: on RabbitMQ
# the general list holds too (those are @job's by design), and a list of its own is added.
KNOWN_SECTIONS = {
    "redis": ("known differences",),
    "amqp": ("known differences", "known differences on rabbitmq"),
}


def known_differences(doc: Path, broker: str = "redis") -> dict[str, str]:
    """Test id -> reason, from the "Known differences" list of docs/celery-compat.md (and on
    RabbitMQ "Known differences on RabbitMQ"): lines
    ``- `t/integration/test_x.py::test_cls::test_name`: reason``."""
    known: dict[str, str] = {}
    in_list = False
    for line in doc.read_text().splitlines():
        if line.startswith("## "):
            in_list = line[3:].strip().lower() in KNOWN_SECTIONS[broker]
            continue
        match = re.match(r"^[-*] `([^`]+::[^`]+)`\s*[:\u2014-]?\s*(.*)$", line.strip())
        if in_list and match:
            known[match.group(1)] = match.group(2).strip()
    return known


def _load(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def _counts(tests: dict[str, dict[str, Any]]) -> dict[str, int]:
    counter = Counter(entry["outcome"] for entry in tests.values())
    return {outcome: counter[outcome] for outcome in OUTCOMES if counter[outcome]}


def _describe(counts: dict[str, int]) -> str:
    return ", ".join(f"{n} {outcome}" for outcome, n in counts.items()) or "nothing ran"


def compare(
    job_path: Path,
    control_path: Path,
    doc: Path,
    out: Path,
    rerun_path: Path | None = None,
    broker: str = "redis",
) -> int:
    job, control = _load(job_path), _load(control_path)
    rerun: dict[str, dict[str, Any]] = _load(rerun_path)["tests"] if rerun_path else {}
    job_tests: dict[str, dict[str, Any]] = job["tests"]
    control_tests: dict[str, dict[str, Any]] = control["tests"]
    missing = {"outcome": "not run", "message": "not collected in this half", "seconds": 0}
    known = known_differences(doc, broker)
    regressions, improvements, others = [], [], []
    for test in sorted(set(job_tests) | set(control_tests)):
        j = job_tests.get(test, missing)
        c = control_tests.get(test, missing)
        if j["outcome"] == c["outcome"]:
            continue
        row = {
            "test": test,
            "control": c["outcome"],
            "job": j["outcome"],
            "job_message": j["message"],
            "control_message": c["message"],
        }
        if c["outcome"] in GOOD and j["outcome"] not in GOOD:
            row["known"] = test in known
            row["reason"] = known.get(test, "")
            again = rerun.get(test)
            # Failed under @job, then passed when run again on its own: flaky, not a difference.
            row["flaky"] = again is not None and again["outcome"] in GOOD
            if again is not None:
                row["rerun"] = again["outcome"]
            regressions.append(row)
        elif j["outcome"] in GOOD and c["outcome"] not in GOOD:
            improvements.append(row)
        else:
            others.append(row)
    unlisted = [row for row in regressions if not row["known"] and not row["flaky"]]
    regressed = {row["test"] for row in regressions}
    ran = set(job_tests) & set(control_tests)
    listed_but_fine = sorted(test for test in known if test in ran and test not in regressed)
    result = {
        "celery": celery_version(),
        "broker": broker,
        "control": {
            "decorator": "shared_task",
            "counts": _counts(control_tests),
            "seconds": control.get("seconds"),
        },
        "job": {"decorator": "job", "counts": _counts(job_tests), "seconds": job.get("seconds")},
        "tests": len(set(job_tests) | set(control_tests)),
        "refused_declarations": job.get("refused_declarations", {}),
        "pass_in_control_fail_under_job": regressions,
        "fail_in_control_pass_under_job": improvements,
        "other_differences": others,
        "unlisted": [row["test"] for row in unlisted],
        "listed_but_not_differing": listed_but_fine,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))

    on = "RabbitMQ" if broker == "amqp" else "Redis"
    print(f"Celery {result['celery']} integration suite on {on}, {result['tests']} tests")
    for half, label in (("control", "control (shared_task)"), ("job", "@job")):
        data = result[half]
        print(f"  {label + ':':23}{_describe(data['counts'])} ({data['seconds']} s)")
    for name, error in result["refused_declarations"].items():
        print(f"  @job refused to declare {name}: {error}")
    print(f"Pass in the control, not under @job: {len(regressions)} ({len(unlisted)} not listed)")
    for row in regressions:
        tag = (
            "listed"
            if row["known"]
            else "flaky: passed on a rerun"
            if row["flaky"]
            else "NOT LISTED"
        )
        print(f"  [{tag}] {row['test']}: {row['job']}: {row['job_message']}")
    if improvements:
        print(f"Fail in the control, pass under @job: {len(improvements)}")
        for row in improvements:
            print(f"  {row['test']}: control {row['control']}: {row['control_message']}")
    if others:
        print(f"Other differences (neither half passes): {len(others)}")
        for row in others:
            print(f"  {row['test']}: control {row['control']}, @job {row['job']}")
    if listed_but_fine:
        print(f"Listed in {doc.name} but not differing now: {len(listed_but_fine)}")
        for test in listed_but_fine:
            print(f"  {test}")
    print(f"Written to {out}")
    for half, data in (("@job", job), ("control", control)):
        if data.get("exitstatus") not in (0, 1):
            print(f"the {half} half's pytest exited {data.get('exitstatus')} (not a test outcome)")
            return 2
    if unlisted:
        print(f"{len(unlisted)} test(s) pass in the control and not under @job, and "
              f"{doc} does not list them")  # fmt: skip
        return 1
    return 0


# ------------------------------------------------------------------------------ services


def dburl(database_url: str, db_name: str) -> str:
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(database_url)
    if parts.scheme not in ("postgres", "postgresql"):
        raise SystemExit(f"DATABASE_URL must be a postgres:// URL, got {database_url!r}")
    return urlunsplit(parts._replace(path=f"/{db_name}"))


def createdb(database_url: str) -> None:
    from urllib.parse import urlsplit, urlunsplit

    import psycopg
    from psycopg import sql

    parts = urlsplit(database_url)
    name = parts.path.lstrip("/")
    server = urlunsplit(parts._replace(path="/postgres"))
    with psycopg.connect(server, autocommit=True, connect_timeout=10) as connection:
        exists = connection.execute("select 1 from pg_database where datname = %s", [name])
        if exists.fetchone() is None:
            owner = parts.username or "backlot"
            connection.execute(
                sql.SQL("create database {} owner {}").format(
                    sql.Identifier(name), sql.Identifier(owner)
                )
            )
            print(f"celery-compat: created database {name}", file=sys.stderr)


def clonedb(database_url: str, template: str) -> None:
    from urllib.parse import urlsplit, urlunsplit

    import psycopg
    from psycopg import sql

    parts = urlsplit(database_url)
    name = parts.path.lstrip("/")
    server = urlunsplit(parts._replace(path="/postgres"))
    with psycopg.connect(server, autocommit=True, connect_timeout=10) as connection:
        # FORCE: a worker of an interrupted run may still hold a connection to the old copy.
        connection.execute(
            sql.SQL("drop database if exists {} with (force)").format(sql.Identifier(name))
        )
        connection.execute(
            sql.SQL("create database {} template {} owner {}").format(
                sql.Identifier(name),
                sql.Identifier(template),
                sql.Identifier(parts.username or "backlot"),
            )
        )


def _redis(redis_url: str) -> Any:
    import redis

    if not redis_url.startswith(("redis://", "rediss://")):
        raise SystemExit(f"not a redis:// URL: {redis_url!r}")
    return redis.Redis.from_url(redis_url, socket_connect_timeout=2, socket_timeout=5)


def ping(redis_url: str) -> bool:
    import redis

    try:
        return bool(_redis(redis_url).ping())
    except redis.RedisError:
        return False


def flushdb(redis_url: str) -> None:
    _redis(redis_url).flushdb()


def hostport(redis_url: str) -> str:
    from urllib.parse import urlsplit

    parts = urlsplit(redis_url)
    return f"{parts.hostname or '127.0.0.1'} {parts.port or 6379}"


def amqp_definitions(user: str, count: int) -> str:
    vhosts = [f"compat-{number}" for number in range(count)]
    permissions = [
        {"user": user, "vhost": vhost, "configure": ".*", "write": ".*", "read": ".*"}
        for vhost in vhosts
    ]
    return json.dumps({"vhosts": [{"name": vhost} for vhost in vhosts], "permissions": permissions})


def amqp_wait(urls: list[str], timeout: float = 30.0) -> None:
    import time
    from urllib.parse import unquote, urlsplit

    import amqp

    deadline = time.monotonic() + timeout
    for url in urls:
        parts = urlsplit(url)
        while True:
            connection = amqp.Connection(
                f"{parts.hostname}:{parts.port or 5672}",
                userid=unquote(parts.username or "guest"),
                password=unquote(parts.password or "guest"),
                virtual_host=unquote(parts.path[1:]) or "/",
                connect_timeout=2,
            )
            try:
                connection.connect()
            except (OSError, amqp.exceptions.AMQPError) as exc:
                connection.collect()  # its socket, half open
                if time.monotonic() > deadline:
                    message = f"no AMQP connection to {url} in {timeout:.0f} s: {exc}"
                    raise SystemExit(message) from None
                time.sleep(0.2)
                continue
            connection.close()
            break


def merge(out: Path, parts: list[Path]) -> None:
    """One half's outcomes from its shards': tests and refusals joined, the worst exit
    status, the longest shard's time (they ran at once)."""
    merged: dict[str, Any] = {"tests": {}, "refused_declarations": {}, "shards": {}}
    for part in parts:
        data = _load(part)
        merged["decorator"] = data["decorator"]
        merged["tests"].update(data["tests"])
        merged["refused_declarations"].update(data.get("refused_declarations", {}))
        merged["shards"][part.stem.removeprefix("outcomes-")] = data.get("seconds")
        merged["exitstatus"] = max(merged.get("exitstatus", 0), int(data["exitstatus"]))
    merged["seconds"] = max((s or 0 for s in merged["shards"].values()), default=0)
    out.write_text(json.dumps(merged, indent=1, sort_keys=True))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.celery_compat.run")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("dest", type=Path)
    for name in ("dburl", "clonedb"):
        d = sub.add_parser(name)
        d.add_argument("url")
        d.add_argument("db_name")
    for name in ("createdb", "ping", "flushdb", "hostport", "unlisted"):
        sub.add_parser(name).add_argument("url")
    m = sub.add_parser("merge")
    m.add_argument("out", type=Path)
    m.add_argument("parts", type=Path, nargs="+")
    c = sub.add_parser("compare")
    for name in ("job", "control", "doc", "out"):
        c.add_argument(name, type=Path)
    c.add_argument("--rerun", type=Path, help="outcomes of the unlisted tests run again under @job")
    c.add_argument("--broker", choices=sorted(KNOWN_SECTIONS), default="redis")
    a = sub.add_parser("amqp-definitions")
    a.add_argument("user")
    a.add_argument("count", type=int)
    sub.add_parser("amqp-wait").add_argument("urls", nargs="+")
    args = parser.parse_args(argv)
    if args.command == "prepare":
        prepare(args.dest)
        return 0
    if args.command == "dburl":
        print(dburl(args.url, args.db_name))
    elif args.command == "createdb":
        createdb(args.url)
    elif args.command == "clonedb":
        clonedb(args.url, args.db_name)
    elif args.command == "ping":
        return 0 if ping(args.url) else 1
    elif args.command == "flushdb":
        flushdb(args.url)
    elif args.command == "hostport":
        print(hostport(args.url))
    elif args.command == "unlisted":
        for test in _load(Path(args.url))["unlisted"]:
            print(test)
    elif args.command == "merge":
        merge(args.out, args.parts)
    elif args.command == "amqp-definitions":
        print(amqp_definitions(args.user, args.count))
    elif args.command == "amqp-wait":
        amqp_wait(args.urls)
    else:
        return compare(args.job, args.control, args.doc, args.out, args.rerun, args.broker)
    return 0


if __name__ == "__main__":
    sys.exit(main())
