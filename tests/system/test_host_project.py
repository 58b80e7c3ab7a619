"""Backlot installed into a fresh `django-admin startproject`, set up by the README's own lines.

The wheel is built from this checkout and installed with its dependencies into a new virtualenv
that has no path to this repository (the demo project's packages must not import there). The
README's section "Add Backlot to an existing Django project" is applied block by block to a new
project `host`; then a real worker, the relay and `runserver` of that project run on the test
PostgreSQL (a database of its own) and Redis (a database number of its own, so the suite's
session worker never sees its messages). Through HTTP, as an operator would: one job succeeds
and its status is read from the host's `/api/jobs/{id}/`; another gives up, its dead letter is
found in the host's admin, its cause is fixed and the admin action replays it to success.

The dependencies' wheels are kept in .data/host-wheelhouse/ after the first run, so later runs
install offline (about 10 s; the first one downloads them).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import uuid
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest
import requests

from tests.conftest import ROOT, wait_until

HEADING = "## Add Backlot to an existing Django project"
WHEELHOUSE = ROOT / ".data" / "host-wheelhouse"
# The demo project's packages: none may be importable where only the wheel is installed.
PROJECT_PACKAGES = ("config", "emails", "reports", "media_pipeline", "web")
# The database driver is the host project's choice, not a dependency of the platform.
HOST_EXTRAS = ("psycopg[binary]>=3.1,<4",)
PASSWORD = "host-admin-password"

HOSTAPP_TASKS = '''\
"""Two jobs: one succeeds; one gives up at once until the file `fixed` exists."""

from pathlib import Path

from jobs import Permanent, job

FIXED = Path(__file__).resolve().parent.parent / "fixed"


@job
def add(a: int, b: int) -> int:
    return a + b


@job
def flaky() -> str:
    if not FIXED.exists():
        raise Permanent("the cause is not fixed yet")
    return "fixed"
'''

HOSTAPP_COMMAND = """\
import json

from django.core.management.base import BaseCommand

from hostapp.tasks import add, flaky


class Command(BaseCommand):
    def handle(self, *args, **options):
        ok = add.enqueue(2, 3)
        bad = flaky.enqueue()
        self.stdout.write(
            json.dumps({"ok": str(ok.id), "ok_status_url": ok.status_url, "bad": str(bad.id)})
        )
"""


def readme_blocks() -> list[tuple[str, str]]:
    """(language, code) of each fenced block in the README's section on adding Backlot."""
    text = (ROOT / "README.md").read_text()
    assert HEADING in text, f"README.md has no section {HEADING!r}"
    section = text.split(HEADING, 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^```(\w+)\n(.*?)^```", section, re.S | re.M)


def python_files(broker: str = "redis") -> list[tuple[str, str, bool]]:
    """(path, code, append) for each Python block: its first line `# path` or `# path: append`;
    a block marked `, on RabbitMQ` only where the broker is "amqp"."""
    out = []
    for language, code in readme_blocks():
        if language != "python":
            continue
        first = code.splitlines()[0]
        match = re.fullmatch(r"# (\S+\.py)(: append)?(, on RabbitMQ)?", first)
        assert match, f"a README block's first line must name its file: {first!r}"
        if match[3] and broker != "amqp":
            continue
        out.append((match[1], code, bool(match[2])))
    return out


def shell_lines() -> list[str]:
    return [
        line.strip()
        for language, code in readme_blocks()
        if language == "sh"
        for line in code.splitlines()
        if line.strip() and not line.startswith("#")
    ]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run(args: list[str], cwd: Path, env: dict[str, str], timeout: float = 180) -> str:
    done = subprocess.run(
        args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert done.returncode == 0, f"{shlex.join(args)} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


# --- the wheel and a virtualenv with only it ---------------------------------------------------


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("host-project")


@pytest.fixture(scope="module")
def wheel(workdir: Path) -> Path:
    """The wheel `pip wheel` builds, from a copy of what the build reads (no stale build/)."""
    source = workdir / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "jobs", source / "jobs", ignore=shutil.ignore_patterns("__pycache__"))
    dist = workdir / "dist"
    run(
        [sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "-w", str(dist)],
        cwd=workdir,
        env=dict(os.environ),
    )
    (built,) = dist.glob("backlot-*.whl")
    return built


@pytest.fixture(scope="module")
def clean_env() -> dict[str, str]:
    """The environment minus what would point a process at this repository or its services."""
    dropped = ("PYTHONPATH", "VIRTUAL_ENV", "DJANGO_SETTINGS_MODULE", "DATABASE_URL", "REDIS_URL")
    return {
        key: value
        for key, value in os.environ.items()
        if key not in dropped and not key.startswith(("CELERY_", "BACKLOT_", "PYTEST_"))
    }


@pytest.fixture(scope="module")
def venv(workdir: Path, wheel: Path, clean_env: dict[str, str]) -> Path:
    """A new virtualenv holding the wheel, its dependencies and a PostgreSQL driver only."""
    path = workdir / "venv"
    run([sys.executable, "-m", "venv", str(path)], cwd=workdir, env=clean_env)
    pip = [str(path / "bin" / "python"), "-m", "pip", "install", "-q"]
    offline = [*pip, "--no-index", "--find-links", str(WHEELHOUSE), str(wheel), *HOST_EXTRAS]
    installed = subprocess.run(
        offline, cwd=workdir, env=clean_env, capture_output=True, check=False
    )
    if installed.returncode != 0:  # first run, or the dependencies changed: fetch them once
        WHEELHOUSE.mkdir(parents=True, exist_ok=True)
        run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "-q",
                "-d",
                str(WHEELHOUSE),
                str(wheel),
                *HOST_EXTRAS,
            ],
            cwd=workdir,
            env=clean_env,
            timeout=300,
        )
        for stale in WHEELHOUSE.glob("backlot-*.whl"):
            stale.unlink()
        run(offline, cwd=workdir, env=clean_env)
    return path


def test_the_wheel_holds_the_platform_only(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    top_level = {name.split("/")[0] for name in names if not name.endswith(".dist-info/")}
    assert {name for name in top_level if not name.endswith(".dist-info")} == {"jobs"}
    for template in (
        "jobs/templates/jobs/job_detail.html",
        "jobs/templates/jobs/poll.html",
        "jobs/templates/admin/jobs/dashboard.html",
        "jobs/templates/admin/jobs/deadletter/replay_edited.html",
    ):
        assert template in names
    assert any(name.startswith("jobs/migrations/0001") for name in names)
    assert "jobs/management/commands/jobs.py" in names
    metadata = (
        zipfile.ZipFile(wheel)
        .read(next(name for name in names if name.endswith(".dist-info/METADATA")))
        .decode()
    )
    required = [
        line.split(":", 1)[1].strip()
        for line in metadata.splitlines()
        if line.startswith("Requires-Dist:") and "extra ==" not in line
    ]
    heavy = ("weasyprint", "imageio", "gunicorn", "whitenoise", "honcho", "psycopg", "flower")
    assert not [req for req in required if req.lower().startswith(heavy)], required


# --- jobs.worker.celery.configure: the host's own Celery settings win ------------------------


class HostCelerySettings:
    """A host's Django settings under the CELERY namespace: some of its own, the rest unset."""

    CELERY_TASK_ACKS_LATE = False
    CELERY_BROKER_URL = "redis://broker.invalid:6379/3"
    CELERY_BROKER_TRANSPORT_OPTIONS = {"visibility_timeout": 9000}
    CELERY_BEAT_SCHEDULE = {"host-digest": {"task": "host.digest", "schedule": 60.0}}


@pytest.mark.parametrize("configured_first", [False, True])
def test_configure_fills_in_only_what_the_host_left_unset(configured_first: bool) -> None:
    from celery import Celery

    import jobs.worker.celery

    app = Celery("host", set_as_current=False)
    app.config_from_object(HostCelerySettings, namespace="CELERY")
    if configured_first:
        assert app.conf.task_acks_late is False  # the configuration is loaded before configure()
    jobs.worker.celery.configure(app)
    conf = app.conf

    assert conf.task_acks_late is False  # the host's
    assert conf.broker_url == "redis://broker.invalid:6379/3"
    assert conf.task_reject_on_worker_lost is True  # Backlot's
    assert conf.accept_content == ["json"] and conf.result_accept_content == ["json"]
    assert conf.result_backend == "jobs.worker.results:LedgerResultBackend"
    assert conf.beat_scheduler == "jobs.flow.beat:LeaderDatabaseScheduler"
    assert conf.worker_prefetch_multiplier == 1 and conf.task_create_missing_queues is False
    assert conf.get("CELERY_DB_REUSE_MAX") == 1_000_000
    assert [queue.queue_arguments for queue in conf.task_queues] == [{"x-max-priority": 9}] * len(
        conf.task_queues
    )
    # dicts merge key by key, the host's keys winning
    assert conf.broker_transport_options["visibility_timeout"] == 9000
    assert conf.broker_transport_options["priority_steps"] == list(range(10))
    assert conf.broker_transport_options["sep"] == ":"
    assert {"host-digest", "backlot-relay", "backlot-health-watch", "backlot-retention"} <= set(
        conf.beat_schedule
    )
    assert os.environ["REMAP_SIGTERM"] == "SIGQUIT"


# --- the host project ---------------------------------------------------------------------------


@dataclass
class Host:
    site: Path
    env: dict[str, str]
    python: str
    bin: Path
    processes: list[tuple[subprocess.Popen[bytes], Path]] = field(default_factory=list)

    def manage(self, *args: str, timeout: float = 180) -> str:
        return run([self.python, "manage.py", *args], cwd=self.site, env=self.env, timeout=timeout)

    def start(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        log = self.site / f"{name}.log"
        with open(log, "wb") as out:
            process = subprocess.Popen(
                args,
                cwd=self.site,
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.processes.append((process, log))
        return process

    def logs(self) -> str:
        return "\n".join(
            f"--- {log.name} ---\n{log.read_text(errors='replace')[-3000:]}"
            for _, log in self.processes
        )

    def stop(self) -> None:
        for process, _ in self.processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process, _ in self.processes:
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=10)


def host_database() -> dict[str, Any]:
    url = os.environ.get("DATABASE_URL", "")
    parts = urlsplit(url)
    if parts.scheme not in ("postgres", "postgresql"):
        pytest.fail("the host-project test needs DATABASE_URL=postgres://... (make test sets it)")
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": f"{parts.path.lstrip('/')}_host",
        "USER": parts.username or "",
        "PASSWORD": parts.password or "",
        "HOST": parts.hostname or "127.0.0.1",
        "PORT": str(parts.port or 5432),
    }


def host_redis_url(host: int = 0) -> str:
    """The test Redis with a database number of the host's own: `host` 0 for this file's host
    project, 1 for test_host_adopt.py's. The two files run at the same time under pytest-xdist;
    sharing one database, each one's flushdb wiped the other's messages (and their relays then
    sent the "missing" jobs again)."""
    parts = urlsplit(os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
    suite_db = int(parts.path.lstrip("/") or 0)
    free = [db for db in (9, 10, 11) if db != suite_db]
    return urlunsplit(parts._replace(path=f"/{free[host]}"))


def recreate_database(db: dict[str, Any], *, drop_only: bool = False) -> None:
    import psycopg

    with psycopg.connect(
        host=db["HOST"],
        port=db["PORT"],
        user=db["USER"],
        password=db["PASSWORD"],
        dbname="postgres",
        autocommit=True,
    ) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{db["NAME"]}" WITH (FORCE)')
        if not drop_only:
            conn.execute(f'CREATE DATABASE "{db["NAME"]}"')


@pytest.fixture(scope="module")
def rabbitmq(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A private RabbitMQ node (scripts/services.sh), for the host's broker on AMQP."""
    datadir = tmp_path_factory.mktemp("host-rabbitmq")
    services = str(ROOT / "scripts" / "services.sh")
    url = f"amqp://guest:guest@127.0.0.1:{free_amqp_port()}//"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RABBITMQ")}
    subprocess.run(["bash", services, "rabbitmq-up", url, str(datadir)], env=env, check=True)
    try:
        yield url
    finally:
        subprocess.run(["bash", services, "rabbitmq-down", str(datadir)], env=env, check=False)


def free_amqp_port() -> int:
    """A free port whose epmd (port - 1300) and distribution (port + 20000) ports are free too
    (scripts/services.sh derives them), in the range it takes."""
    for _ in range(50):
        port = 7000 + int.from_bytes(os.urandom(2), "big") % 5000
        try:
            for candidate in (port, port - 1300, port + 20000):
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", candidate))
        except OSError:
            continue
        return port
    raise AssertionError("no free port for a RabbitMQ node")


@pytest.fixture(scope="module", params=["redis", "amqp"])
def broker(request: pytest.FixtureRequest) -> str:
    """The host's broker: its Redis (the README's default), or RabbitMQ (its AMQP block)."""
    return str(request.param)


@pytest.fixture(scope="module")
def host(
    workdir: Path,
    venv: Path,
    clean_env: dict[str, str],
    broker: str,
    request: pytest.FixtureRequest,
) -> Iterator[Host]:
    import redis

    bin_dir = venv / "bin"
    env = {
        **clean_env,
        "PATH": f"{bin_dir}{os.pathsep}{clean_env.get('PATH', '')}",
        "PYTHONUNBUFFERED": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    site = workdir / f"site-{broker}"
    site.mkdir()
    run([str(bin_dir / "django-admin"), "startproject", "host", str(site)], cwd=workdir, env=env)
    box = Host(site=site, env=env, python=str(bin_dir / "python"), bin=bin_dir)

    # No path to this repository: the demo project's packages do not import here.
    found = run(
        [
            box.python,
            "-c",
            "import importlib.util as u, jobs; "
            f"print([m for m in {PROJECT_PACKAGES!r} if u.find_spec(m)], jobs.__file__)",
        ],
        cwd=site,
        env=env,
    )
    assert found.startswith("[] ") and str(venv) in found, found

    # The README's lines, as written.
    for path, code, append in python_files(broker):
        target = site / path
        if append:
            target.write_text(target.read_text() + "\n" + code)
        else:
            target.write_text(code)
    # What this test's environment adds: its app, its database, its Redis.
    box.manage("startapp", "hostapp")
    (site / "hostapp" / "tasks.py").write_text(HOSTAPP_TASKS)
    commands = site / "hostapp" / "management" / "commands"
    commands.mkdir(parents=True)
    for package in (commands.parent, commands):
        (package / "__init__.py").write_text("")
    (commands / "enqueue_demo.py").write_text(HOSTAPP_COMMAND)
    db = host_database()
    redis_url = host_redis_url()
    settings_file = site / "host" / "settings.py"
    settings_file.write_text(
        settings_file.read_text()
        + "\n# The test environment (tests/system/test_host_project.py).\n"
        + 'INSTALLED_APPS += ["hostapp"]\n'
        + f"DATABASES = {{'default': {db!r}}}\n"
        + f'BACKLOT = {{**BACKLOT, "REDIS_URL": {redis_url!r}}}\n'
        + (
            f'BACKLOT["BROKER_URL"] = {request.getfixturevalue("rabbitmq")!r}\n'
            if broker == "amqp"
            else ""
        )
    )
    recreate_database(db)
    redis.Redis.from_url(redis_url).flushdb()
    try:
        yield box
    finally:
        box.stop()
        redis.Redis.from_url(redis_url).flushdb()
        recreate_database(db, drop_only=True)


def login(base: str) -> requests.Session:
    session = requests.Session()
    session.get(f"{base}/admin/login/", timeout=10).raise_for_status()
    answer = session.post(
        f"{base}/admin/login/?next=/admin/",
        data={
            "username": "admin",
            "password": PASSWORD,
            "csrfmiddlewaretoken": session.cookies["csrftoken"],
            "next": "/admin/",
        },
        timeout=10,
    )
    assert answer.status_code == 200 and answer.url.endswith("/admin/"), answer.text[:2000]
    return session


def job_state(session: requests.Session, base: str, job_id: str, state: str) -> dict | None:
    answer = session.get(f"{base}/api/jobs/{job_id}/", timeout=10)
    answer.raise_for_status()
    body = answer.json()
    return body if body["state"] == state else None


def test_readme_setup_runs_a_job_a_dead_letter_and_its_replay_in_a_fresh_project(
    host: Host, broker: str
) -> None:
    lines = shell_lines()
    assert lines[0] == "pip install backlot", lines  # done above, from the wheel just built
    host.manage("check")  # no CELERY_* and no BACKLOT_QUEUES settings needed

    for line in lines[1:]:
        args = shlex.split(line)
        program = str(host.bin / args[0])
        if args[:2] == ["python", "manage.py"] and args[2:] != ["jobs", "relay"]:
            run([program, *args[1:]], cwd=host.site, env=host.env)
        elif args[0] == "celery" and "worker" in args:
            # Its own node name: the suite's workers answer on another Redis database anyway.
            host.start(
                "worker", [program, *args[1:], "-c", "2", "-n", f"host-{uuid.uuid4().hex[:6]}@%h"]
            )
        elif args[2:] == ["jobs", "relay"]:
            host.start("relay", [program, *args[1:]])
        else:
            pytest.fail(f"the README's set-up runs a command this test does not know: {line!r}")
    assert {log.name for _, log in host.processes} == {"worker.log", "relay.log"}

    host.env.update(
        DJANGO_SUPERUSER_USERNAME="admin",
        DJANGO_SUPERUSER_EMAIL="admin@example.com",
        DJANGO_SUPERUSER_PASSWORD=PASSWORD,
    )
    host.manage("createsuperuser", "--noinput")
    port = free_port()
    host.start("web", [host.python, "manage.py", "runserver", "--noreload", f"127.0.0.1:{port}"])
    base = f"http://127.0.0.1:{port}"

    def web_up() -> bool:
        for process, _ in host.processes:
            assert process.poll() is None, f"a host process exited:\n{host.logs()}"
        try:
            return requests.get(f"{base}/admin/login/", timeout=2).status_code == 200
        except requests.ConnectionError:
            return False

    wait_until(web_up, timeout=30, interval=0.2, what="the host's runserver")
    worker_log = next(log for process, log in host.processes if log.name == "worker.log")
    wait_until(
        lambda: " ready." in worker_log.read_text(errors="replace"),
        timeout=60,
        interval=0.2,
        what=f"the host's worker\n{host.logs()}",
    )
    session = login(base)
    scheme = {"redis": "redis://", "amqp": "amqp://"}[broker]
    assert f"Connected to {scheme}" in worker_log.read_text(errors="replace"), host.logs()

    # given: one job that succeeds and one that gives up
    handles = json.loads(host.manage("enqueue_demo").strip().splitlines()[-1])
    assert handles["ok_status_url"] == f"/api/jobs/{handles['ok']}/"

    # then: the first succeeds, read through the host's API
    done = wait_until(
        lambda: job_state(session, base, handles["ok"], "succeeded"),
        timeout=60,
        interval=0.2,
        what=f"the first job to succeed\n{host.logs()}",
    )
    assert done is not None and done["result"] == 5 and done["attempts"] == 1

    # and the second's dead letter is in the host's admin
    listing = f"{base}/admin/jobs/deadletter/?q={handles['bad']}"

    def dead_letter_pk() -> str | None:
        page = session.get(listing, timeout=10)
        page.raise_for_status()
        found = re.search(r'name="_selected_action" value="(\d+)"', page.text)
        return found[1] if found and "hostapp.tasks.flaky" in page.text else None

    pk = wait_until(
        dead_letter_pk,
        timeout=60,
        interval=0.2,
        what=f"the second job's dead letter\n{host.logs()}",
    )
    assert job_state(session, base, handles["bad"], "dead")

    # when: its cause is fixed and the admin action replays it
    (host.site / "fixed").write_text("yes\n")
    replayed = session.post(
        f"{base}/admin/jobs/deadletter/",
        data={
            "csrfmiddlewaretoken": session.cookies["csrftoken"],
            "action": "replay_selected",
            "_selected_action": pk,
            "index": "0",
        },
        timeout=10,
    )
    assert replayed.status_code == 200 and "1 dead letter replayed as <a href=" in replayed.text, (
        re.findall(r"<li class=\"(?:success|error|warning|info)\">.*?</li>", replayed.text, re.S)
    )
    letter = session.get(f"{base}/admin/jobs/deadletter/{pk}/change/", timeout=10).text
    linked = set(re.findall(r"/admin/jobs/job/([0-9a-f-]{36})/change/", letter)) - {handles["bad"]}
    assert len(linked) == 1, letter[:3000]
    (new_id,) = linked

    # then: the replay, a new job, succeeds
    again = wait_until(
        lambda: job_state(session, base, new_id, "succeeded"),
        timeout=60,
        interval=0.2,
        what=f"the replayed job to succeed\n{host.logs()}",
    )
    assert again is not None and again["result"] == "fixed"

    # and jobs' own pages render from the templates inside the app
    for path, text in (
        (f"/jobs/{handles['ok']}/", handles["ok"]),
        ("/admin/jobs/", "Jobs dashboard"),
        ("/admin/jobs/job/dashboard/", "Queues"),
    ):
        page = session.get(f"{base}{path}", timeout=10)
        assert page.status_code == 200 and text in page.text, (path, page.text[:2000])
