"""deploy/: the Prometheus alert rules pass promtool and their unit tests, and every series the
rules and the Grafana dashboard read is one that /metrics really exports (after real jobs ran,
a real relay swept and a real beat ticked)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from django.contrib.auth.models import User
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from jobs.models import DeadLetter, Job, JobState
from tests.conftest import LOG_DIR, ROOT, wait_until
from tests.support import tasks

RULES = ROOT / "deploy/prometheus/alerts.yml"
RULE_TESTS = ROOT / "deploy/prometheus/alerts_test.yml"
DASHBOARD = ROOT / "deploy/grafana/backlot.json"
RUNBOOK = ROOT / "docs/operations.md"

# PromQL words that look like names: keywords, and the operators spelled as words.
PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool"} | {
    "and",
    "or",
    "unless",
    "offset",
    "inf",
    "nan",
}
# Grafana's own variables, as they would be substituted when a panel asks Prometheus.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__interval": "1m", "$__range": "1h"}


def promtool(*args: str | Path) -> subprocess.CompletedProcess[str]:
    if shutil.which("promtool") is None:
        pytest.fail("promtool is missing: `make test` installs it (Debian's `prometheus` package)")
    return subprocess.run(
        ["promtool", *map(str, args)], capture_output=True, text=True, timeout=60, check=False
    )


def alert_rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def dashboard_exprs() -> list[str]:
    def walk(panels: list[dict[str, Any]]) -> Iterator[str]:
        for panel in panels:
            yield from (t["expr"] for t in panel.get("targets", []))
            yield from walk(panel.get("panels", []))

    return list(walk(json.loads(DASHBOARD.read_text())["panels"]))


def series_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: not its functions, label names (in
    matchers, by/without/on/ignoring lists), keywords, numbers, durations or variables."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # label values and other strings
    expr = re.sub(r"\{[^}]*\}", " ", expr)  # matchers
    expr = re.sub(r"\[[^\]]*\]", " ", expr)  # ranges and subqueries
    expr = re.sub(r"\$\{?\w+\}?", " ", expr)  # Grafana variables
    expr = re.sub(
        r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr
    )  # label lists
    expr = re.sub(r"\boffset\s+\S+", " ", expr)
    names = set()
    for match in re.finditer(r"(?<![\w.:])([a-zA-Z_:][\w:]*)(\s*\()?", expr):
        name, called = match.groups()
        if not called and name.lower() not in PROMQL_WORDS:
            names.add(name)
    return names


def selectors(expr: str) -> Iterator[tuple[str, set[str]]]:
    """(metric name, label names its matchers use) for each `name{...}` in the expression."""
    for name, matchers in re.findall(r"([a-zA-Z_:][\w:]*)\s*\{([^}]*)\}", expr):
        labels = set(re.findall(r"([a-zA-Z_]\w*)\s*(?:=~|!~|!=|=)", matchers))
        yield name, labels


def test_series_names_skips_functions_labels_and_keywords():
    assert series_names(
        'max by (queue) (rate(backlot_jobs_finished_total{state="dead", queue=~"$queue"}[5m]))'
        " > 0 unless on (queue) max by (queue) (backlot_queue_paused) == 1"
    ) == {"backlot_jobs_finished_total", "backlot_queue_paused"}
    assert series_names(
        "histogram_quantile(0.95, sum without (instance) (rate(x_bucket[$__rate_interval])))"
        " / ignoring(le) group_left(queue) y_total offset 5m > bool 1e3"
    ) == {"x_bucket", "y_total"}
    assert series_names("time() - max(backlot_beat_last_tick_timestamp_seconds) > 60") == {
        "backlot_beat_last_tick_timestamp_seconds"
    }


def test_alert_rules_pass_promtool_check():
    result = promtool("check", "rules", RULES)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in result.stdout


def test_alert_rules_pass_their_unit_tests():
    result = promtool("test", "rules", RULE_TESTS)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_every_alert_is_tested_firing_and_quiet_and_links_a_runbook_section():
    cases = [
        case
        for test in yaml.safe_load(RULE_TESTS.read_text())["tests"]
        for case in test.get("alert_rule_test", [])
    ]
    names = {rule["alert"] for rule in alert_rules()}
    # promtool passes a case for an alert that does not exist if it expects none: a typo'd
    # name would make a quiet case prove nothing.
    assert {case["alertname"] for case in cases} == names
    anchors = {
        re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        for heading in re.findall(r"^#+ (.+)$", RUNBOOK.read_text(), flags=re.M)
    }
    for rule in alert_rules():
        name = rule["alert"]
        fired = [c for c in cases if c["alertname"] == name and c.get("exp_alerts")]
        quiet = [c for c in cases if c["alertname"] == name and not c.get("exp_alerts")]
        assert fired and quiet, f"{name}: needs a firing and a quiet case"
        assert rule.get("for"), name
        assert rule["labels"]["severity"] in {"warning", "critical"}, name
        assert {"summary", "description", "runbook_url"} <= rule["annotations"].keys(), name
        page, _, anchor = rule["annotations"]["runbook_url"].partition("#")
        assert page == "docs/operations.md" and anchor in anchors, (name, anchor)
        if "by (queue)" in rule["expr"]:
            assert "$labels.queue" in rule["annotations"]["description"], name


def test_dashboard_is_a_grafana_dashboard_of_valid_promql(tmp_path):
    board = json.loads(DASHBOARD.read_text())
    assert board["schemaVersion"] >= 39
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    assert variables["queue"]["query"]["query"] == "label_values(backlot_queue_depth, queue)"
    for panel in board["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${DS_PROMETHEUS}", panel["title"]
            assert panel["targets"], panel["title"]
    # promtool parses every panel query, variables substituted as Grafana would.
    rules = []
    for n, expr in enumerate(dashboard_exprs()):
        query = expr
        for variable, value in GRAFANA_VARIABLES.items():
            query = query.replace(variable, value)
        rules.append({"record": f"dashboard:panel_{n}", "expr": re.sub(r"\$\w+", ".*", query)})
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = promtool("check", "rules", path)
    assert result.returncode == 0, result.stdout + result.stderr


def start_beat(env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(
            [
                *(sys.executable, "-m", "celery", "-A", "config", "beat", "--pidfile="),
                *("-l", "INFO", "--scheduler", "jobs.flow.beat:LeaderDatabaseScheduler"),
            ],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def scrape(client: Any) -> dict[str, list[Any]]:
    """Sample name -> its samples, from the real /metrics text."""
    response = client.get("/metrics")
    assert response.status_code == 200
    samples: dict[str, list[Any]] = {}
    for family in text_string_to_metric_families(response.content.decode()):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
    return samples


def test_rules_and_dashboard_read_only_series_that_metrics_exports(
    worker, worker_env, client, unique
):
    # given: a finished job, a dead one, rate-limit waits, a lapsed lease, a relay sweep and a
    # beat tick, each through the real process that produces it
    lapsed = Job.objects.create(
        id=uuid.uuid4(),
        task_name="tests.add",
        args=[1, 2],
        queue="default",
        state=JobState.RUNNING,
        attempts=1,
        max_attempts=5,
        enqueued_at=timezone.now() - timedelta(minutes=5),
        published_at=timezone.now() - timedelta(minutes=5),
        lease_expires_at=timezone.now() - timedelta(minutes=1),
    )
    handles = [tasks.add.enqueue(n, n) for n in range(3)]
    handles += [tasks.rate_limited.enqueue(f"{unique}-{n}") for n in range(40)]  # 20/s
    dead = tasks.refused.enqueue(unique, to="x@example.com")
    relay = subprocess.run(
        [sys.executable, "manage.py", "jobs", "relay", "--once"],
        cwd=ROOT,
        env=worker_env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert relay.returncode == 0, relay.stdout + relay.stderr
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    beat = start_beat(worker_env, LOG_DIR / f"beat-metrics-{unique}.log")
    try:
        wait_until(
            lambda: (
                Job.objects.filter(
                    id__in=[h.id for h in handles] + [lapsed.id], state=JobState.SUCCEEDED
                ).count()
                == len(handles) + 1
                and Job.objects.filter(id=dead.id, state=JobState.DEAD).exists()
            ),
            timeout=60,
            what="the jobs to finish",
        )
        client.force_login(User.objects.create_user(f"ops-{unique}", is_staff=True))
        exported = wait_until(
            lambda: (
                (s := scrape(client))
                and s["backlot_beat_last_tick_timestamp_seconds"][0].value > 0
                and s
            ),
            timeout=60,
            interval=0.5,
            what="beat's first tick",
        )
    finally:
        beat.terminate()
        beat.wait(timeout=30)

    # then: what /metrics says is what happened
    def value(name: str, **labels: str) -> float:
        return sum(s.value for s in exported[name] if labels.items() <= dict(s.labels).items())

    now = time.time()
    assert now - 60 < value("backlot_beat_last_tick_timestamp_seconds") <= now
    assert now - 60 < value("backlot_relay_last_sweep_timestamp_seconds") <= now
    assert value("backlot_lease_lapses_total") == 1
    assert value("backlot_workers", queue="default") == 1  # the session worker
    assert value("backlot_workers", queue="reports") == 0
    assert value("backlot_jobs_finished_total", task="tests.refused", state="dead") == 1
    assert value("backlot_queue_jobs_finished_total", queue="default", state="dead") == 1
    assert value("backlot_queue_jobs_finished_total", queue="default", state="succeeded") >= 44
    assert value("backlot_queue_job_run_seconds_count", queue="default") >= 45
    assert value("backlot_rate_limit_waits_total", task="tests.rate_limited") > 0
    assert value("backlot_redis_memory_used_bytes") > 0
    assert "backlot_redis_memory_max_bytes" in exported
    assert DeadLetter.objects.filter(job_id_value=dead.id).exists()

    # and: every series (and every label matched on) in the rules and the panels is among them
    board = json.loads(DASHBOARD.read_text())
    exprs = [rule["expr"] for rule in alert_rules()] + dashboard_exprs()
    exprs += [
        re.sub(r"label_values\((\w+),\s*\w+\)", r"\1", v["query"]["query"])
        for v in board["templating"]["list"]
        if v["type"] == "query"
    ]
    used = set().union(*map(series_names, exprs))
    assert used, "no series found in the expressions"
    assert used - exported.keys() == set(), f"not exported by /metrics: {used - exported.keys()}"
    for expr in exprs:
        for name, labels in selectors(expr):
            have = set().union(*(s.labels.keys() for s in exported[name]))
            assert labels <= have, f"{name} has no label {labels - have} (in {expr!r})"
