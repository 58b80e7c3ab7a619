"""A host's Celery settings that contradict the ledger: `manage.py check` names each (jobs.E010)
and a real worker refuses to start with them; BACKLOT['ALLOW_CELERY_SETTINGS'] lets one through."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
from django.core import checks
from django.core.management import call_command
from django.core.management.base import SystemCheckError
from kombu import Queue

from jobs.web.checks import check_conflicting_celery_settings
from tests.conftest import ROOT


def e010(problems: list[Any]) -> dict[str, str]:
    """The settings named by jobs.E010 errors, each with its message and hint."""
    return {
        problem.obj: f"{problem.msg} {problem.hint}"
        for problem in problems
        if problem.id == "jobs.E010" and isinstance(problem, checks.Error)
    }


def test_the_reference_settings_have_no_conflict():
    assert check_conflicting_celery_settings() == []


@pytest.mark.parametrize(
    ("setting", "value", "says"),
    [
        ("CELERY_BROKER_URL", "sqs://key:secret@", "scheme 'sqs'"),
        ("CELERY_BROKER_URL", "redis://elsewhere.invalid:6379/4", "another Redis"),
        ("CELERY_RESULT_BACKEND", "redis://127.0.0.1:6379/1", "waits forever"),
        ("CELERY_RESULT_BACKEND", "django-db", "waits forever"),
        ("CELERY_TASK_SERIALIZER", "pickle", "JSON only"),
        ("CELERY_RESULT_SERIALIZER", "yaml", "JSON only"),
        ("CELERY_TASK_ACKS_LATE", False, "lost"),
        ("CELERY_TASK_QUEUES", [Queue("celery")], "'default'"),
        ("CELERY_TASK_DEFAULT_QUEUE", "celery", "would be ignored"),
    ],
)
def test_a_conflicting_setting_is_an_error_naming_it_and_what_to_change(
    settings, setting, value, says
):
    setattr(settings, setting, value)

    found = e010(check_conflicting_celery_settings())

    assert list(found) == [setting]
    assert setting in found[setting] and says in found[setting]
    assert f"Delete {setting}" in found[setting]
    assert "secret" not in found[setting]  # a broker URL's password is not shown


def test_settings_backlot_agrees_with_are_no_conflict(settings):
    settings.CELERY_TASK_SERIALIZER = "json"
    settings.CELERY_TASK_ACKS_LATE = True
    settings.CELERY_RESULT_BACKEND = "jobs.worker.results:LedgerResultBackend"
    settings.CELERY_TASK_QUEUES = [Queue(name) for name in settings.BACKLOT["QUEUES"]]
    settings.CELERY_TASK_DEFAULT_QUEUE = "default"

    assert check_conflicting_celery_settings() == []


def test_the_broker_and_result_backend_from_the_environment_are_checked(monkeypatch):
    # Celery reads these two from the environment before any setting
    monkeypatch.setenv("CELERY_RESULT_BACKEND", "rpc://")

    assert list(e010(check_conflicting_celery_settings())) == ["CELERY_RESULT_BACKEND"]


def test_a_deliberate_override_is_let_through(settings):
    settings.CELERY_TASK_ACKS_LATE = False
    settings.CELERY_RESULT_BACKEND = "redis://127.0.0.1:6379/1"
    settings.BACKLOT = {**settings.BACKLOT, "ALLOW_CELERY_SETTINGS": ["CELERY_TASK_ACKS_LATE"]}

    assert list(e010(check_conflicting_celery_settings())) == ["CELERY_RESULT_BACKEND"]


def test_json_only_cannot_be_let_through(settings):
    settings.CELERY_TASK_SERIALIZER = "pickle"
    settings.BACKLOT = {**settings.BACKLOT, "ALLOW_CELERY_SETTINGS": ["CELERY_TASK_SERIALIZER"]}

    problems = check_conflicting_celery_settings()

    assert list(e010(problems)) == ["CELERY_TASK_SERIALIZER"]
    assert [p.id for p in problems if p.id == "jobs.E011"] == ["jobs.E011"]


def test_a_route_to_a_queue_backlot_does_not_declare_is_an_error(settings):
    settings.CELERY_TASK_ROUTES = {"tests.*": "celery", "tests.add": {"queue": "reports"}}
    settings.BACKLOT = {**settings.BACKLOT, "ALLOW_CELERY_SETTINGS": ["CELERY_TASK_ROUTES"]}

    problems = check_conflicting_celery_settings()

    found = e010(problems)
    assert list(found) == ["CELERY_TASK_ROUTES"]
    assert (
        "'celery'" in found["CELERY_TASK_ROUTES"] and "'reports'" not in found["CELERY_TASK_ROUTES"]
    )
    assert "Add 'celery' to BACKLOT['QUEUES']" in found["CELERY_TASK_ROUTES"]
    # it cannot be let through: every enqueue of those tasks would be refused
    assert [p.id for p in problems if p.id == "jobs.E011"] == ["jobs.E011"]


def test_a_route_with_more_than_a_queue_is_an_error(settings):
    settings.CELERY_TASK_ROUTES = {
        "tests.*": {"queue": "reports", "priority": 3},
        "tests.add": {"exchange": "media", "routing_key": "media"},
    }

    found = e010(check_conflicting_celery_settings())

    assert list(found) == ["CELERY_TASK_ROUTES"]
    for key in ("'priority'", "'exchange'", "'routing_key'", "no 'queue'"):
        assert key in found["CELERY_TASK_ROUTES"]
    assert "Keep {'queue': NAME} in each route" in found["CELERY_TASK_ROUTES"]


def test_routes_to_backlots_queues_are_no_conflict(settings):
    settings.CELERY_TASK_ROUTES = [
        {"tests.*": {"queue": "reports"}, "tests.add": Queue("emails")},
        "tests.support.routing_tasks.where",  # a router's dotted path: judged when called
        lambda name, args, kwargs, options, task=None, **kw: "celery",
    ]

    assert check_conflicting_celery_settings() == []


def test_manage_py_check_fails_on_a_conflict(settings):
    settings.CELERY_RESULT_BACKEND = "redis://127.0.0.1:6379/1"

    with pytest.raises(SystemCheckError, match="CELERY_RESULT_BACKEND"):
        call_command("check")


def test_a_worker_refuses_to_start_with_a_conflicting_setting(worker_env):
    # given: a result backend that would leave every @job's AsyncResult PENDING
    env = {**worker_env, "CELERY_RESULT_BACKEND": "redis://127.0.0.1:6379/1"}

    # when: a real worker of the project starts
    done = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "config", "worker", "-P", "solo", "-l", "INFO"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )

    # then: it exits before consuming, naming the setting and what to change
    assert done.returncode != 0
    assert "CELERY_RESULT_BACKEND" in done.stderr and "Delete CELERY_RESULT_BACKEND" in done.stderr
    assert " ready." not in done.stdout + done.stderr
