"""docker-compose.yml is valid and runs the same commands as the Procfile."""

from __future__ import annotations

import re

import yaml

from tests.conftest import ROOT

ENV_DEFAULT = re.compile(r"\$\{(\w+)[^}]*\}")  # ${VAR:-x} / ${VAR:?msg} -> ${VAR}


def normalize(command: str | list[str]) -> str:
    text = command if isinstance(command, str) else " ".join(command)
    return ENV_DEFAULT.sub(r"${\1}", " ".join(text.split()))


def procfile() -> dict[str, str]:
    entries = {}
    for line in (ROOT / "Procfile").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, command = line.partition(":")
            entries[name.strip()] = command.strip()
    return entries


def test_compose_services_run_the_procfile_commands():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]

    for name, command in procfile().items():
        assert name in services, f"Procfile process {name} has no compose service"
        assert normalize(services[name]["command"]) == normalize(command), name


def test_compose_has_the_production_shape():
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]

    redis_command = normalize(services["redis"]["command"])
    assert "--appendonly yes" in redis_command and "--requirepass" in redis_command
    assert "--maxmemory-policy noeviction" in redis_command
    assert services["beat"].get("deploy", {}).get("replicas", 1) == 1
    assert "--basic-auth=" in normalize(services["flower"]["command"])
    for name in ("redis", "postgres", "web", "worker", "beat", "flower"):
        assert "healthcheck" in services[name], name
