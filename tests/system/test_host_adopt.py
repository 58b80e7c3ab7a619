"""An existing Celery project adopted in one line: a fresh `django-admin startproject` whose
tasks.py is written the way Celery's documentation writes tasks, and whose settings already
have a Celery tutorial's CELERY_BROKER_URL and CELERY_RESULT_BACKEND. The README's section is
applied word for word (adopt mode on); `check` names both settings; once they are deleted,
every task has a ledger row, the failing one is a dead letter replayed from the admin (the
action, over HTTP with CSRF) and from `manage.py jobs retry`, and the opted-out task has none.

The wheel, its virtualenv and the Host helper are test_host_project.py's.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import requests

from tests.conftest import wait_until
from tests.system.test_host_project import (  # noqa: F401 (module fixtures: the wheel, its venv)
    PASSWORD,
    Host,
    clean_env,
    free_port,
    host_database,
    host_redis_url,
    job_state,
    login,
    python_files,
    recreate_database,
    run,
    shell_lines,
    venv,
    wheel,
    workdir,
)

# Celery's "First steps with Django": the tutorial's two lines, as a project already has them.
TUTORIAL_SETTINGS = """
CELERY_BROKER_URL = "redis://localhost:6379/0"
CELERY_RESULT_BACKEND = "redis://localhost:6379/0"
"""

CELERY_DOCS_TASKS = '''\
"""Tasks as Celery's documentation writes them: no Backlot import."""

from pathlib import Path

from celery import shared_task

FIXED = Path(__file__).resolve().parent.parent / "fixed"


@shared_task
def add(x, y):
    return x + y


@shared_task(bind=True, max_retries=3, default_retry_delay=0.2)
def fetch(self, n):
    if self.request.retries < 2:
        raise self.retry(exc=ConnectionError("flaky upstream"))
    return f"fetched {n} after {self.request.retries}"


@shared_task(autoretry_for=(ConnectionError,), retry_backoff=0.2, retry_jitter=False, max_retries=2)
def sync():
    raise ConnectionError("upstream down")


@shared_task(ignore_result=True)
def touch(n):
    return n


@shared_task
def always_fails():
    if not FIXED.exists():
        raise ValueError("the cause is not fixed yet")
    return "fixed"


@shared_task
def on_commit(n):
    return n * 10


@shared_task(backlot=False)
def plain(n):
    return n
'''

ENQUEUE_COMMAND = """\
import json

from django.db import transaction
from django.core.management.base import BaseCommand

from hostapp import tasks
from jobs.models import Job


class Command(BaseCommand):
    def handle(self, *args, **options):
        ids = {
            "add": tasks.add.delay(2, 3).id,
            "fetch": tasks.fetch.delay(7).id,
            "sync": tasks.sync.delay().id,
            "touch": tasks.touch.apply_async((1,)).id,
            "always_fails": tasks.always_fails.delay().id,
            "plain": tasks.plain.delay(1).id,
        }
        with transaction.atomic():
            tasks.on_commit.delay_on_commit(4)
        rows = Job.objects.filter(task_name="hostapp.tasks.on_commit")
        ids["on_commit"] = str(rows.get().id)  # one row, written in that transaction
        self.stdout.write(json.dumps(ids))
"""


WRITER = """\
import sqlite3, sys, time
db = sqlite3.connect(sys.argv[1], timeout=30, isolation_level=None)
db.execute("CREATE TABLE IF NOT EXISTS other_writes (at REAL)")
print("writing", flush=True)
while True:  # another process taking SQLite's one write lock every few ms
    db.execute("BEGIN IMMEDIATE")
    db.execute("INSERT INTO other_writes VALUES (?)", (time.time(),))
    time.sleep(0.003)
    db.execute("COMMIT")
    time.sleep(0.002)
"""


@pytest.fixture(scope="module", params=["postgresql", "sqlite"])
def adopted(
    request: pytest.FixtureRequest,
    workdir: Path,  # noqa: F811
    venv: Path,  # noqa: F811
    clean_env: dict[str, str],  # noqa: F811
) -> Iterator[Host]:
    bin_dir = venv / "bin"
    env = {
        **clean_env,
        "PATH": f"{bin_dir}:{clean_env.get('PATH', '')}",
        "PYTHONUNBUFFERED": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    site = workdir / f"adopt-site-{request.param}"
    site.mkdir()
    run([str(bin_dir / "django-admin"), "startproject", "host", str(site)], cwd=workdir, env=env)
    box = Host(site=site, env=env, python=str(bin_dir / "python"), bin=bin_dir)
    settings_file = site / "host" / "settings.py"
    # the existing Celery project: its tutorial settings and its tasks
    settings_file.write_text(settings_file.read_text() + TUTORIAL_SETTINGS)
    box.manage("startapp", "hostapp")
    (site / "hostapp" / "tasks.py").write_text(CELERY_DOCS_TASKS)
    commands = site / "hostapp" / "management" / "commands"
    commands.mkdir(parents=True)
    for package in (commands.parent, commands):
        (package / "__init__.py").write_text("")
    (commands / "enqueue_celery_tasks.py").write_text(ENQUEUE_COMMAND)
    # the README's lines, as written
    for path, code, append in python_files():
        target = site / path
        target.write_text((target.read_text() + "\n" + code) if append else code)
    db = {**host_database(), "NAME": f"{host_database()['NAME']}_adopt"}
    redis_url = host_redis_url(host=1)  # not the other host file's database
    # sqlite: startproject's own DATABASES, as generated (no OPTIONS)
    databases = f"DATABASES = {{'default': {db!r}}}\n" if request.param == "postgresql" else ""
    settings_file.write_text(
        settings_file.read_text()
        + "\n# The test environment.\n"
        + 'INSTALLED_APPS += ["hostapp"]\n'
        + databases
        + f'BACKLOT = {{**BACKLOT, "REDIS_URL": {redis_url!r}}}\n'
    )
    (site / "other_writer.py").write_text(WRITER)
    if request.param == "postgresql":
        recreate_database(db)
    redis.Redis.from_url(redis_url).flushdb()
    try:
        yield box
    finally:
        box.stop()
        redis.Redis.from_url(redis_url).flushdb()
        if request.param == "postgresql":
            recreate_database(db, drop_only=True)


def test_an_existing_celery_project_is_adopted_by_the_readme_lines(adopted: Host) -> None:
    # given: the tutorial's settings: check names both, and says what to change
    failed = subprocess.run(
        [adopted.python, "manage.py", "check"],
        cwd=adopted.site,
        env=adopted.env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert failed.returncode != 0
    for setting in ("CELERY_BROKER_URL", "CELERY_RESULT_BACKEND"):
        assert f"{setting}: (jobs.E010)" in failed.stderr and f"Delete {setting}" in failed.stderr

    # when: the two lines are deleted, as the hint says
    settings_file = adopted.site / "host" / "settings.py"
    settings_file.write_text(settings_file.read_text().replace(TUTORIAL_SETTINGS, "\n"))
    adopted.manage("check")
    for line in shell_lines()[1:]:
        args = shlex.split(line)
        program = str(adopted.bin / args[0])
        if args[:2] == ["python", "manage.py"] and args[2:] != ["jobs", "relay"]:
            run([program, *args[1:]], cwd=adopted.site, env=adopted.env)
        elif args[0] == "celery" and "worker" in args:
            name = f"adopt-{uuid.uuid4().hex[:6]}@%h"
            adopted.start("worker", [program, *args[1:], "-c", "2", "-n", name])
        elif args[2:] == ["jobs", "relay"]:
            adopted.start("relay", [program, *args[1:]])
    adopted.env.update(
        DJANGO_SUPERUSER_USERNAME="admin",
        DJANGO_SUPERUSER_EMAIL="admin@example.com",
        DJANGO_SUPERUSER_PASSWORD=PASSWORD,
    )
    adopted.manage("createsuperuser", "--noinput")
    port = free_port()
    adopted.start(
        "web", [adopted.python, "manage.py", "runserver", "--noreload", f"127.0.0.1:{port}"]
    )
    base = f"http://127.0.0.1:{port}"

    def web_up() -> bool:
        try:
            return requests.get(f"{base}/admin/login/", timeout=2).status_code == 200
        except requests.ConnectionError:
            return False

    wait_until(web_up, timeout=30, interval=0.2, what=f"the host's runserver\n{adopted.logs()}")
    session = login(base)
    ids = json.loads(adopted.manage("enqueue_celery_tasks").strip().splitlines()[-1])

    # then: every adopted task has a row, read through the host's API, with its outcome
    def outcome(name: str, state: str) -> dict:
        found = wait_until(
            lambda: job_state(session, base, ids[name], state),
            timeout=90,
            interval=0.2,
            what=f"{name} to be {state}\n{adopted.logs()}",
        )
        assert isinstance(found, dict)
        return found

    assert outcome("add", "succeeded")["result"] == 5
    fetched = outcome("fetch", "succeeded")
    assert fetched["result"] == "fetched 7 after 2" and fetched["attempts"] == 3
    assert fetched["max_attempts"] == 4  # max_retries=3
    synced = outcome("sync", "dead")
    assert synced["attempts"] == synced["max_attempts"] == 3  # autoretry_for, max_retries=2
    outcome("touch", "succeeded")
    assert outcome("on_commit", "succeeded")["result"] == 40
    outcome("always_fails", "dead")
    # the opted-out task keeps no row
    assert session.get(f"{base}/api/jobs/{ids['plain']}/", timeout=10).status_code == 404

    # when: the cause is fixed and the admin replays the dead letter (on SQLite while another
    # process writes every few ms)
    if (adopted.site / "db.sqlite3").exists():
        writer = adopted.start(
            "writer", [adopted.python, "other_writer.py", str(adopted.site / "db.sqlite3")]
        )
        wait_until(
            lambda: "writing" in (adopted.site / "writer.log").read_text(),
            timeout=30,
            what="the other writer",
        )
        assert writer.poll() is None
    (adopted.site / "fixed").write_text("yes\n")
    listing = session.get(f"{base}/admin/jobs/deadletter/?q={ids['always_fails']}", timeout=10)
    pk = re.search(r'name="_selected_action" value="(\d+)"', listing.text)
    assert pk, listing.text[:2000]
    replayed = session.post(
        f"{base}/admin/jobs/deadletter/",
        data={
            "csrfmiddlewaretoken": session.cookies["csrftoken"],
            "action": "replay_selected",
            "_selected_action": pk[1],
            "index": "0",
        },
        timeout=30,
    )
    assert replayed.status_code == 200 and "1 dead letter replayed as <a href=" in replayed.text
    letter = session.get(f"{base}/admin/jobs/deadletter/{pk[1]}/change/", timeout=10).text
    linked = set(re.findall(r"/admin/jobs/job/([0-9a-f-]{36})/change/", letter))
    (new_id,) = linked - {ids["always_fails"]}
    assert wait_until(lambda: job_state(session, base, new_id, "succeeded"), timeout=90)

    # and the other dead one (sync) is replayed from the command
    said = adopted.manage("jobs", "retry", "--task", "hostapp.tasks.sync")
    assert "Replayed 1 dead letter" in said, said
