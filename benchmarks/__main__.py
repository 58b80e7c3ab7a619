"""The benchmark runner: python -m benchmarks [--cases a,b] [--full].

Needs REDIS_URL and DATABASE_URL (PostgreSQL) of services it may wipe, and for the cases that
compare the brokers (AMQP_CASES) BENCH_AMQP_URL, a RabbitMQ whose queues it may purge: `make
bench` starts its own (Redis :6392, PostgreSQL :54332, RabbitMQ :5692) and the runner refuses
the shared or test ones. It migrates PostgreSQL and a temporary SQLite file, empties the
benchmark tables and Redis, runs each case in its own process, prints the table and writes
benchmarks/results/latest.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from benchmarks.cases import AMQP_CASES, CASES, EXTRA
from benchmarks.contention import Contention
from benchmarks.harness import LOG_DIR
from benchmarks.report import render_case, render_targets

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
# Ports of services this suite must never wipe: the shared ones, `make run`'s and `make test`'s
# (RabbitMQ: its default port and make test's).
PROTECTED_PORTS = {6379, 6390, 6399, 5432, 54329, 54399, 5672, 5682}
BUDGET_SECONDS = 15 * 60


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--cases",
        default=",".join(CASES),
        help=f"comma-separated, from: {', '.join([*CASES, *EXTRA])}",
    )
    parser.add_argument(
        "--full",
        action="store_true",
        help="the issue's sizes (hours at today's rates) instead of the 15-minute ones",
    )
    parser.add_argument(
        "--scale",
        type=float,
        default=1.0,
        help="multiply every count (e.g. 0.1 for a smoke run; figures are then noisy)",
    )
    parser.add_argument("--out", default=str(RESULTS / "latest.json"))
    parser.add_argument(
        "--needs-amqp",
        action="store_true",
        help="run nothing; exit 0 when a chosen case needs RabbitMQ (scripts/bench.sh asks)",
    )
    opts = parser.parse_args()
    names = [n.strip() for n in opts.cases.split(",") if n.strip()]
    unknown = [n for n in names if n not in CASES and n not in EXTRA]
    if unknown:
        parser.error(f"unknown case(s): {', '.join(unknown)}")
    uses_amqp = any(n in AMQP_CASES for n in names)
    if opts.needs_amqp:
        return 0 if uses_amqp else 1

    redis_url, pg_url = os.environ.get("REDIS_URL", ""), os.environ.get("DATABASE_URL", "")
    check_disposable(redis_url, "REDIS_URL", ("redis",))
    check_disposable(pg_url, "DATABASE_URL", ("postgres", "postgresql"))
    amqp_url = os.environ.get("BENCH_AMQP_URL", "")
    if uses_amqp:
        check_disposable(amqp_url, "BENCH_AMQP_URL", ("amqp",))

    began = time.monotonic()
    for old in LOG_DIR.glob("*.log"):  # worker and gunicorn logs of the previous run
        old.unlink()
    sqlite_dir = tempfile.mkdtemp(prefix="backlot-bench-")
    sqlite_url = f"sqlite:///{sqlite_dir}/bench.sqlite3"
    envs = {"pg": child_env(pg_url), "sqlite": child_env(sqlite_url)}
    for env in envs.values():
        env["BENCH_SCALE"] = str(opts.scale)
    log(f"migrating PostgreSQL ({redact(pg_url)}) and SQLite ({sqlite_url})")
    for env in envs.values():
        migrate(env)
    reset_services(envs["pg"])

    meta = machine_meta()
    results: dict[str, Any] = {}
    failed = []
    contention = Contention(
        urlparse(pg_url).port,
        urlparse(redis_url).port,
        urlparse(amqp_url).port if uses_amqp else None,
    )
    try:
        for name in names:
            _, db, timeout = {**CASES, **EXTRA}[name]
            log(f"case {name} (timeout {timeout}s)")
            case_began = time.monotonic()
            contention.foreign_pct()  # start the span here
            data = run_case(name, envs[db], timeout, opts.full)
            data["seconds"] = round(time.monotonic() - case_began, 1)
            data["foreign_cpu_pct"] = contention.foreign_pct()
            results[name] = data
            if "error" in data:
                failed.append(name)
                log(f"case {name} FAILED:\n{data['error']}")
            else:
                print(render_case(data), flush=True)
    finally:
        for path in Path(sqlite_dir).glob("*"):
            path.unlink()
        os.rmdir(sqlite_dir)

    total = time.monotonic() - began
    meta.update(
        total_seconds=round(total, 1),
        finished=now_iso(),
        within_budget=total < BUDGET_SECONDS,
        full_size=opts.full,
    )
    document = {"meta": meta, "cases": results}
    print(render_targets(results), flush=True)
    verdict = "within" if total < BUDGET_SECONDS else "OVER"
    print(
        f"\ntotal {total / 60:.1f} min ({verdict} the 15-minute budget)"
        f"; cores {meta['cores']}; results in {opts.out}",
        flush=True,
    )
    Path(opts.out).parent.mkdir(parents=True, exist_ok=True)
    Path(opts.out).write_text(json.dumps(document, indent=1) + "\n")
    return 1 if failed else 0


def check_disposable(url: str, var: str, schemes: tuple[str, ...]) -> None:
    """The suite flushes Redis, truncates tables and purges RabbitMQ queues: only ever on
    loopback services of its own."""
    parsed = urlparse(url)
    if parsed.scheme not in schemes:
        sys.exit(f"{var} must be a {schemes[0]}:// URL of the benchmark service (use `make bench`)")
    if parsed.hostname not in ("127.0.0.1", "localhost", "::1"):
        sys.exit(f"{var} must point at loopback, not {parsed.hostname}")
    if parsed.port in PROTECTED_PORTS or parsed.port is None:
        sys.exit(
            f"{var} points at port {parsed.port}, which is not the benchmarks' own service "
            "(this suite wipes it); use `make bench`"
        )


def child_env(database_url: str) -> dict[str, str]:
    return {
        **os.environ,
        "DATABASE_URL": database_url,
        # Cases run on the benchmark Redis whatever the shell exported; the amqp case hands
        # BENCH_AMQP_URL to the processes it starts on RabbitMQ.
        "BROKER_URL": "",
        "DJANGO_SETTINGS_MODULE": "config.settings",
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": str(ROOT),
    }


def migrate(env: dict[str, str]) -> None:
    subprocess.run(
        [sys.executable, "manage.py", "migrate", "--noinput", "-v", "0"],
        cwd=ROOT,
        env=env,
        check=True,
        timeout=300,
    )


def reset_services(env: dict[str, str]) -> None:
    """Empty the benchmark PostgreSQL's job tables and the benchmark Redis."""
    code = (
        "import django; django.setup()\n"
        "from django.db import connection\n"
        "from benchmarks.jobs import bench_redis\n"
        "with connection.cursor() as c:\n"
        "    c.execute(\"select tablename from pg_tables where schemaname = 'public' and \"\n"
        "              \"(tablename like 'jobs\\\\_%' \"\n"
        "              \"or tablename like 'django\\\\_celery\\\\_results\\\\_%' \"\n"
        "              \"or tablename like 'emails\\\\_%')\")\n"
        "    tables = [r[0] for r in c.fetchall()]\n"
        "    if tables:\n"
        "        c.execute('truncate ' + ', '.join(f'\"{t}\"' for t in tables) + ' cascade')\n"
        "bench_redis().flushdb()\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, check=True, timeout=120)


def run_case(name: str, env: dict[str, str], timeout: int, full: bool) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as fh:
        out = fh.name
    command = [sys.executable, "-m", "benchmarks.run_case", name, out] + (
        ["--full"] if full else []
    )
    child = subprocess.Popen(command, cwd=ROOT, env=env, start_new_session=True)
    try:
        limit = timeout * (20 if full else 1)
        child.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        # SIGTERM unwinds the case, which stops the workers and servers it started (they run
        # in sessions of their own); whatever is still registered after that is ended by PID.
        os.killpg(child.pid, signal.SIGTERM)
        try:
            child.wait(timeout=45)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
        _kill_leftovers()
        Path(out).unlink(missing_ok=True)
        return {"case": name, "error": f"timed out after {limit}s"}
    try:
        data = json.loads(Path(out).read_text() or "{}")
    except (OSError, ValueError):
        data = {}
    Path(out).unlink(missing_ok=True)
    if not data:
        data = {"case": name, "error": f"exited {child.returncode} without results"}
    return data


def _kill_leftovers() -> None:
    """A case killed for its timeout may leave workers or servers (own sessions): end them."""
    from benchmarks.harness import kill_registered

    kill_registered()


def machine_meta() -> dict[str, Any]:
    def version(dist: str) -> str:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "?"

    return {
        "started": now_iso(),
        "cores": os.cpu_count(),
        "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
        "machine": platform.machine(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "versions": {
            d: version(d)
            for d in (
                "celery",
                "Django",
                "kombu",
                "redis",
                "hiredis",
                "psycopg",
                "django-celery-results",
                "gunicorn",
                "billiard",
            )
        },
        "postgresql": server_version(),
        "redis_server": redis_version(),
        "git_commit": git_commit(),
    }


def server_version() -> str:
    import psycopg

    try:
        with psycopg.connect(os.environ["DATABASE_URL"], connect_timeout=5) as conn:
            row = conn.execute("show server_version").fetchone()
    except psycopg.Error:
        return "?"
    return str(row[0]) if row else "?"


def redis_version() -> str:
    import redis

    try:
        return str(redis.Redis.from_url(os.environ["REDIS_URL"]).info("server")["redis_version"])
    except redis.RedisError:
        return "?"


def git_commit() -> str:
    """HEAD's commit, read from .git without running git."""
    git = ROOT / ".git"
    try:
        if git.is_file():  # a worktree: "gitdir: PATH"
            git = Path(git.read_text().split(":", 1)[1].strip())
        head = (git / "HEAD").read_text().strip()
        if not head.startswith("ref:"):
            return head
        ref = head.split(":", 1)[1].strip()
        common = git / "commondir"
        base = (git / common.read_text().strip()).resolve() if common.exists() else git
        for root in (git, base):
            if (root / ref).exists():
                return (root / ref).read_text().strip()
            packed = root / "packed-refs"
            if packed.exists():
                for line in packed.read_text().splitlines():
                    if line.endswith(" " + ref):
                        return line.split()[0]
    except OSError:
        pass
    return "unknown"


def redact(url: str) -> str:
    parsed = urlparse(url)
    return url.replace(f":{parsed.password}@", ":***@") if parsed.password else url


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
