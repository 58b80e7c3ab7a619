"""docker-compose.yml, the Procfile and .env.example agree with each other and with the settings.

Parsed, not run (no Docker engine here): every queue has exactly one worker service, long-job
workers take one message at a time and outlast their jobs, exactly one beat, every long-lived
service has a healthcheck and a restart policy, secrets have no defaults.
"""

from __future__ import annotations

import re
import shlex
from functools import cache
from typing import Any

import pytest
import yaml
from django.conf import settings
from django.urls import resolve
from honcho.environ import parse_procfile

from config.celery import app as celery_app
from tests.conftest import ROOT

# ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?message}, ${VAR?message}
VARIABLE = re.compile(r"(?<!\$)\$\{(\w+)(?:(:?[-?])([^}]*))?\}")
# A name that holds a credential: it must never have a default.
SECRET_NAME = re.compile(r"PASSWORD|SECRET|TOKEN|BASIC_AUTH")
# Queues whose jobs run for minutes: prefetch 1, explicit long time limits.
LONG_JOB_QUEUES = ("reports", "media")


@cache
def compose_text() -> str:
    return (ROOT / "docker-compose.yml").read_text()


@cache
def services() -> dict[str, dict[str, Any]]:
    return yaml.safe_load(compose_text())["services"]


def procfile_text() -> str:
    return (ROOT / "Procfile").read_text()


def procfile() -> dict[str, str]:
    return dict(parse_procfile(procfile_text()).processes)


def command_text(command: str | list[str]) -> str:
    """A command as one line, single-spaced; compose's `$$` escape read as the `$` it means."""
    text = command if isinstance(command, str) else shlex.join(command)
    return " ".join(text.split()).replace("$$", "$")


def argv(command: str | list[str]) -> list[str]:
    return command if isinstance(command, list) else shlex.split(command_text(command))


def option(args: list[str], *names: str) -> str | None:
    """The value of `--name value` / `--name=value` / `-n value` in args, else None."""
    for i, arg in enumerate(args):
        for name in names:
            if arg == name and i + 1 < len(args):
                return args[i + 1]
            if name.startswith("--") and arg.startswith(name + "="):
                return arg.split("=", 1)[1]
    return None


def default_of(value: str) -> str:
    """`${VAR:-default}` -> default; a literal stays as it is; a variable without one fails."""
    match = VARIABLE.fullmatch(value)
    if match is None:
        return value
    assert match[2] in (":-", "-"), f"{value} has no default"
    return match[3]


def celery_role(command: str | list[str]) -> str | None:
    """'worker', 'beat', 'flower'... for a `celery -A config <role>` command, else None."""
    args = argv(command)
    if not args or args[0] != "celery":
        return None
    rest = args[1:]
    if "-A" in rest:
        del rest[rest.index("-A") : rest.index("-A") + 2]
    return rest[0] if rest else None


def workers() -> dict[str, list[str]]:
    """Compose worker services -> their argv."""
    return {
        name: argv(service["command"])
        for name, service in services().items()
        if "command" in service and celery_role(service["command"]) == "worker"
    }


def consumed_queues(args: list[str]) -> list[str]:
    queues = option(args, "-Q", "--queues")
    assert queues, f"worker {shlex.join(args)} names no queue (-Q): it would consume only celery"
    return queues.split(",")


def worker_for(queue: str) -> tuple[str, list[str]]:
    found = [(name, args) for name, args in workers().items() if queue in consumed_queues(args)]
    assert len(found) == 1, f"queue {queue} is consumed by {[name for name, _ in found]}"
    return found[0]


def one_shot_services() -> set[str]:
    """Services others wait for to *finish* (migrate): no healthcheck, restart on failure."""
    return {
        dependency
        for service in services().values()
        for dependency, condition in (service.get("depends_on") or {}).items()
        if isinstance(condition, dict)
        and condition.get("condition") == "service_completed_successfully"
    }


def declared_variables(path: str) -> set[str]:
    """Names set (or shown commented out, for optional ones) in an env file."""
    return set(re.findall(r"^#?\s*([A-Z][A-Z0-9_]*)=", (ROOT / path).read_text(), re.M))


@cache
def longest_time_limit(queue: str) -> float:
    """The longest hard time limit among the jobs routed to `queue`."""
    celery_app.loader.import_default_modules()
    limits = [
        float(task.time_limit or 0)
        for task in celery_app.tasks.values()
        if (getattr(task, "queue_name", None) or celery_app.conf.task_default_queue) == queue
    ]
    assert limits, f"no job is routed to the {queue} queue"
    return max(limits)


def seconds(duration: str | int) -> float:
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
    return sum(
        float(number) * units[unit]
        for number, unit in re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h)", str(duration))
    ) or float(duration)


# --- Procfile and compose --------------------------------------------------------------------


def test_every_procfile_process_is_a_compose_service_with_the_same_command() -> None:
    processes = procfile()

    for name, command in processes.items():
        assert name in services(), f"Procfile process {name} has no compose service"
        assert command_text(services()[name]["command"]) == command_text(command), name


def test_every_long_lived_compose_app_service_is_in_the_procfile() -> None:
    infrastructure = {"redis", "postgres"}
    app_services = set(services()) - infrastructure - one_shot_services()

    assert app_services == set(procfile())


# --- queues and workers ----------------------------------------------------------------------


def test_every_declared_queue_is_consumed_by_exactly_one_worker_service() -> None:
    declared = [queue.name for queue in celery_app.conf.task_queues]
    consumers: dict[str, list[str]] = {queue: [] for queue in declared}
    for name, args in workers().items():
        for queue in consumed_queues(args):
            assert queue in consumers, f"{name} consumes {queue}, which settings do not declare"
            consumers[queue].append(name)

    assert {queue: len(names) for queue, names in consumers.items()} == dict.fromkeys(declared, 1)


def test_workers_have_distinct_node_names_and_their_healthcheck_pings_them() -> None:
    names = {}
    for service, args in workers().items():
        node = option(args, "-n", "--hostname")
        assert node and node.endswith("@%h"), f"{service}: name the node <queue>@%h, got {node}"
        # worker-default's name comes from honcho's HONCHO_PROCESS_NAME under make run (one
        # process per core); in compose the variable is unset and each replica has its host.
        names[service] = default_of(node.split("@")[0])
        probe = command_text(services()[service]["healthcheck"]["test"])
        assert f"inspect ping -d {names[service]}@$HOSTNAME" in probe, service

    assert len(set(names.values())) == len(names), names


def test_worker_concurrency_comes_from_the_environment_with_a_default() -> None:
    for service, args in workers().items():
        concurrency = option(args, "-c", "--concurrency")
        assert concurrency and VARIABLE.fullmatch(concurrency), f"{service}: {concurrency}"
        assert int(default_of(concurrency)) >= 1, service

    _, default_worker = worker_for("default")
    assert option(default_worker, "-c", "--concurrency") == "${WORKER_DEFAULT_CONCURRENCY:-1}"


def test_short_jobs_get_one_worker_process_per_core_in_compose_and_make_run() -> None:
    # A short job's ceiling is its worker's main process (make bench, case "layout"), so the
    # default queue runs several single-process workers rather than one wider pool.
    service, args = worker_for("default")
    replicas = str(services()[service]["deploy"]["replicas"])
    assert replicas == "${WORKER_DEFAULT_REPLICAS:-2}"
    assert option(args, "-n", "--hostname") == "${HONCHO_PROCESS_NAME:-default}@%h"
    run_sh = (ROOT / "scripts" / "run.sh").read_text()
    assert f'-c "{service}=$WORKER_DEFAULT_REPLICAS"' in run_sh
    assert 'WORKER_DEFAULT_REPLICAS="${WORKER_DEFAULT_REPLICAS:-2}"' in run_sh


def test_short_jobs_run_in_the_workers_own_process_by_default() -> None:
    # -P solo: no hop to a pool process (issue 26 item 5); jobs.worker.watchdog enforces the
    # time limits there (tests/system/faults/test_solo_limits.py). The long-job queues keep
    # prefork: their hard limit ends only the pool process, not a whole worker's prefetch.
    _, args = worker_for("default")
    assert option(args, "-P", "--pool") == "${WORKER_DEFAULT_POOL:-solo}"
    for queue in LONG_JOB_QUEUES:
        name, args = worker_for(queue)
        assert option(args, "-P", "--pool") is None, f"{name} should keep the prefork pool"


@pytest.mark.parametrize("queue", LONG_JOB_QUEUES)
def test_long_job_workers_take_one_message_at_a_time_and_outlast_their_jobs(queue: str) -> None:
    name, args = worker_for(queue)
    hard = float(default_of(option(args, "--time-limit") or "0"))
    soft = float(default_of(option(args, "--soft-time-limit") or "0"))

    assert consumed_queues(args) == [queue], f"{name} should serve {queue} alone"
    assert default_of(option(args, "--prefetch-multiplier") or "") == "1", name
    assert option(args, "-O") == "fair", name
    assert hard >= longest_time_limit(queue), f"{name}: --time-limit {hard} < its longest job"
    assert 0 < soft < hard, name


def test_worker_time_limits_stay_below_the_visibility_timeout() -> None:
    # Redis hands an unacknowledged message to another worker after the visibility timeout:
    # a job still running then would run twice at once (the claim drops the copy, but late).
    visibility = settings.CELERY_BROKER_TRANSPORT_OPTIONS["visibility_timeout"]
    assert isinstance(visibility, int)
    for name, args in workers().items():
        limit = option(args, "--time-limit")
        if limit is not None:
            assert float(default_of(limit)) < visibility, name


def test_workers_drain_before_docker_kills_them() -> None:
    for name in workers():
        grace = seconds(services()[name].get("stop_grace_period", "10s"))
        assert grace > settings.CELERY_WORKER_SOFT_SHUTDOWN_TIMEOUT + 30, name


def test_exactly_one_beat() -> None:
    beats = [name for name, s in services().items() if celery_role(s.get("command", "")) == "beat"]

    assert beats == ["beat"]
    assert services()["beat"].get("deploy", {}).get("replicas", 1) == 1
    assert [name for name, cmd in procfile().items() if celery_role(cmd) == "beat"] == ["beat"]


def test_the_outbox_relay_runs() -> None:
    assert command_text(services()["relay"]["command"]) == "python manage.py jobs relay"
    # Alive means sweeping, not merely reachable: the relay records each finished sweep.
    assert command_text(services()["relay"]["healthcheck"]["test"]).endswith(
        "manage.py jobs relay --alive 30"
    )


# --- health, restarts, infrastructure ---------------------------------------------------------


def test_every_service_has_a_healthcheck_and_a_restart_policy() -> None:
    one_shots = one_shot_services()
    for name, service in services().items():
        if name in one_shots:
            assert service.get("restart") == "on-failure", name
            continue
        healthcheck = service.get("healthcheck") or {}
        assert healthcheck.get("test") and not healthcheck.get("disable"), name
        assert service.get("restart") in ("always", "unless-stopped"), name


def test_web_healthcheck_asks_the_health_endpoint() -> None:
    assert resolve("/health/").url_name == "health"
    assert "/health/" in command_text(services()["web"]["healthcheck"]["test"])


def test_redis_and_postgres_are_durable_and_checked_with_credentials() -> None:
    redis = services()["redis"]
    redis_command = command_text(redis["command"])
    assert "--appendonly yes" in redis_command and "--requirepass" in redis_command
    assert "--maxmemory-policy noeviction" in redis_command
    assert "redisdata:/data" in redis["volumes"]
    probe = command_text(redis["healthcheck"]["test"])
    assert "redis-cli" in probe and "ping" in probe
    assert "-a " in probe or "REDISCLI_AUTH" in redis.get("environment", {})

    postgres = services()["postgres"]
    assert any(v.endswith(":/var/lib/postgresql/data") for v in postgres["volumes"])
    assert "pg_isready" in command_text(postgres["healthcheck"]["test"])


def test_flower_requires_a_login_and_listens_on_loopback() -> None:
    flower = command_text(services()["flower"]["command"])

    assert "--basic-auth=${FLOWER_BASIC_AUTH:?" in flower
    assert all(port.startswith("127.0.0.1:") for port in services()["flower"]["ports"])


# --- variables -----------------------------------------------------------------------------


def test_secrets_have_no_defaults() -> None:
    for path, text in (("docker-compose.yml", compose_text()), ("Procfile", procfile_text())):
        for name, operator, _ in VARIABLE.findall(text):
            if SECRET_NAME.search(name):
                assert operator == ":?", f"{path}: ${{{name}}} must be ${{{name}:?message}}"

    for required in ("SECRET_KEY", "POSTGRES_PASSWORD", "REDIS_PASSWORD", "FLOWER_BASIC_AUTH"):
        assert f"${{{required}:?" in compose_text(), required


def test_env_example_leaves_the_secrets_empty() -> None:
    # A placeholder such as "change-me" would satisfy ${VAR:?} and start production with it.
    values = dict(re.findall(r"^(\w+)=(.*)$", (ROOT / ".env.example").read_text(), re.M))
    for name, value in values.items():
        if SECRET_NAME.search(name) and name not in ("DJANGO_SUPERUSER_PASSWORD",):
            assert value == "", f".env.example gives {name} a value"


def test_every_variable_compose_or_the_procfile_uses_is_in_env_example() -> None:
    documented = declared_variables(".env.example")
    used = {name for name, _, _ in VARIABLE.findall(compose_text() + procfile_text())}

    assert used - documented == set()
