"""Issue 28 item 5: bare Celery and Backlot on RabbitMQ beside the same on Redis, in one run.

(a) Enqueue, one call per job from one process: bare `delay()` and Backlot's ledger-on
`enqueue()`, as the enqueue case does. (b) Drain: a backlog of jobs that each INCR one Redis
counter (the same INCR, bare and ledger-on), queued while the worker's consumer is cancelled,
timed from the first message taken until the counter reaches the backlog and, ledger on, every
row succeeded: RabbitMQ shows its ready messages (a passive declare), not the unacknowledged
ones, so the broker alone cannot say when a drain is done. One worker -c 2 prefork per broker,
the project's settings as shipped.

Celery and Backlot pick their broker at start-up, so each broker's side is a process of its own
(benchmarks.broker_agent, BROKER_URL in its environment) that this case drives; each broker's
worker gets the same BROKER_URL. Within a round every variant on both brokers runs once, the
order flips every round, and every ratio is the median of the per-round ratios.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from typing import Any
from urllib.parse import urlparse

from benchmarks.contention import server_pids
from benchmarks.harness import LOG_DIR, ROOT, CaseResult, CpuMeter, Worker, Workers, cpu_seconds
from benchmarks.sizes import SIZES

BROKERS = ("redis", "rabbitmq")
VARIANTS = ("bare", "ledger_on")
NAMES = {"redis": "Redis", "rabbitmq": "RabbitMQ"}
WHAT = {
    "enqueue_bare": "bare Celery task.delay()",
    "enqueue_ledger_on": "Backlot enqueue(), ledger on",
    "drain_bare": "bare Celery @shared_task, no result backend, one Redis INCR",
    "drain_ledger_on": "Backlot @job (ledger), the same INCR",
}

Plan = tuple[str, str]  # (broker, variant)


class Agent:
    """A benchmarks.broker_agent process on one broker; call() sends a request and returns
    the reply (its stderr is .data/bench-logs/agent-BROKER.log)."""

    def __init__(self, broker: str, broker_url: str) -> None:
        LOG_DIR.mkdir(parents=True, exist_ok=True)
        self.log_path = LOG_DIR / f"agent-{broker}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 (the agent's lifetime; stop() closes it)
        env = {
            **os.environ,
            "BROKER_URL": broker_url,
            "DJANGO_SETTINGS_MODULE": "config.settings",
            "PYTHONUNBUFFERED": "1",
        }
        # In this case's process group: the runner's kill of a timed-out case ends it too.
        self.process = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.broker_agent"],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
        )

    def call(self, op: str, **fields: Any) -> dict[str, Any]:
        stdin, stdout = self.process.stdin, self.process.stdout
        assert stdin is not None and stdout is not None
        stdin.write(json.dumps({"op": op, **fields}) + "\n")
        stdin.flush()
        line = stdout.readline()
        if not line:
            code = self.process.wait()
            tail = self.log_path.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"{self.log_path.stem} exited {code} during {op}:\n{tail}")
        reply: dict[str, Any] = json.loads(line)
        if not reply.pop("ok"):
            raise RuntimeError(f"{self.log_path.stem}: {op} failed:\n{reply['error']}")
        return reply

    def stop(self) -> None:
        if self.process.poll() is None:
            with contextlib.suppress(OSError, RuntimeError, ValueError):
                self.call("quit")
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        self._log.close()


def run(*, full: bool = False) -> CaseResult:
    amqp_url = os.environ.get("BENCH_AMQP_URL", "")
    if not amqp_url:
        raise RuntimeError("BENCH_AMQP_URL is not set: run it with make bench (it starts RabbitMQ)")
    urls = {"redis": "", "rabbitmq": amqp_url}
    enqueue_size, drain_size = SIZES["amqp_enqueue"], SIZES["amqp_drain"]
    enqueue_count, drain_count = enqueue_size.count(full), drain_size.count(full)
    result = CaseResult(
        case="amqp",
        title="Brokers: bare Celery and Backlot on RabbitMQ beside Redis, enqueue and drain",
        params={
            "jobs_enqueued_per_round": enqueue_count,
            "enqueue_rounds": enqueue_size.repeats,
            "jobs_per_drain": drain_count,
            "drain_rounds": drain_size.repeats,
            "worker": "celery -A config worker -c 2 -P prefork, one per broker",
        },
        notes=[
            "RabbitMQ as Backlot declares it: durable quorum queues, every publish confirmed "
            "(the project's transport options, so bare delay() waits for its confirm too); a "
            "ledger-on enqueue marks its row published after the confirm (one UPDATE more "
            "than on Redis, where the row goes in marked)",
            "drain: first message taken to the counter reaching the backlog (ledger on: and "
            "every row succeeded), each job one Redis INCR",
        ],
    )
    for name, size, count in (
        ("enqueue", enqueue_size, enqueue_count),
        ("drain", drain_size, drain_count),
    ):
        if count != size.issue:
            result.notes.append(f"scaled: {count:,} jobs per {name} instead of {size.issue:,}")
    agents: dict[str, Agent] = {}
    try:
        for broker in BROKERS:
            agents[broker] = Agent(broker, urls[broker])
        for broker, agent in agents.items():
            result.params[f"{broker}_server"] = agent.call("hello")["version"]
        enqueue_rates = enqueue_rounds(agents, enqueue_count, enqueue_size.repeats)
        drain_rates, broker_cpu = drains(result, agents, urls, drain_count, drain_size.repeats)
    finally:
        for agent in agents.values():
            agent.stop()
    for phase, rates in (("enqueue", enqueue_rates), ("drain", drain_rates)):
        report(result, phase, rates)
    for plan, values in broker_cpu.items():
        result.figure(
            f"{label('drain', plan)} broker CPU",
            values,
            "us/job",
            higher_is_better=False,
            what=f"CPU of the {NAMES[plan[0]]} server per job over the drain (/proc, 10 ms ticks)",
        )
    return result


def plans() -> list[Plan]:
    return [(broker, variant) for broker in BROKERS for variant in VARIANTS]


def label(phase: str, plan: Plan) -> str:
    broker, variant = plan
    return f"{phase}_{variant}_{broker}"


def enqueue_rounds(agents: dict[str, Agent], count: int, repeats: int) -> dict[Plan, list[float]]:
    """jobs/s per (broker, variant), one enqueue loop each per round; round 0 warms up."""
    rates: dict[Plan, list[float]] = {plan: [] for plan in plans()}
    for round_no in range(repeats + 1):
        order = plans() if round_no % 2 == 0 else plans()[::-1]
        for broker, variant in order:
            seconds = agents[broker].call("enqueue", variant=variant, count=count)["seconds"]
            if round_no:
                rates[(broker, variant)].append(count / seconds)
    return rates


def drains(
    result: CaseResult, agents: dict[str, Agent], urls: dict[str, str], count: int, repeats: int
) -> tuple[dict[Plan, list[float]], dict[Plan, list[float]]]:
    """A worker per broker, a warm-up drain of 100 jobs per variant, then `repeats` rounds:
    drain_rounds' figures."""
    servers = {
        "redis": server_pids(redis_port=urlparse(os.environ.get("REDIS_URL", "")).port),
        "rabbitmq": server_pids(amqp_port=urlparse(urls["rabbitmq"]).port),
    }
    for agent in agents.values():
        agent.call("purge")  # what an interrupted run may have left in RabbitMQ's durable queue
    with Workers() as workers:
        started = {
            broker: workers.start(f"amqp-{broker}", concurrency=2, env={"BROKER_URL": url})
            for broker, url in urls.items()
        }
        for broker, worker in started.items():
            wait_ready(agents[broker], worker)
            agents[broker].call("pause", workers=[worker.name])
        drain_rounds(CaseResult("warmup", ""), agents, started, servers, 100, 1)
        return drain_rounds(result, agents, started, servers, count, repeats)


def wait_ready(agent: Agent, worker: Worker, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while worker.name not in agent.call("ping", workers=[worker.name])["answered"]:
        if worker.process.poll() is not None:
            raise RuntimeError(f"worker {worker.name} exited:\n{worker.log_tail()}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"worker {worker.name} did not answer within {timeout:.0f} s")
        time.sleep(0.2)


def drain_rounds(
    result: CaseResult,
    agents: dict[str, Agent],
    started: dict[str, Worker],
    servers: dict[str, list[int]],
    count: int,
    repeats: int,
) -> tuple[dict[Plan, list[float]], dict[Plan, list[float]]]:
    """Per (broker, variant) and round: jobs/s, and CPU microseconds per job of that broker's
    server. The medians of the workers' CPU shares and of both servers' CPU per job go to
    result.extra."""
    rates: dict[Plan, list[float]] = {plan: [] for plan in plans()}
    cpu: dict[Plan, list[dict[str, float]]] = {plan: [] for plan in plans()}
    for round_no in range(repeats):
        order = plans() if round_no % 2 == 0 else plans()[::-1]
        for broker, variant in order:
            agent, worker = agents[broker], started[broker]
            key = f"{broker}-{variant}-{round_no}"
            agent.call("backlog", variant=variant, count=count, key=key)
            meter = CpuMeter([worker])
            before = {name: cpu_seconds(pids) for name, pids in servers.items()}
            done = agent.call(
                "drain", variant=variant, workers=[worker.name], count=count, key=key, timeout=300
            )
            shares = meter.stop()
            for name, pids in servers.items():
                used = cpu_seconds(pids) - before[name]
                shares[f"{name}_server_us_per_job"] = round(used / count * 1e6, 1)
            cpu[(broker, variant)].append(shares)
            rates[(broker, variant)].append(count / done["seconds"])
            if done["ran"] != count or done["depth_after"]:
                result.notes.append(
                    f"{label('drain', (broker, variant))} round {round_no + 1}: {done['ran']} "
                    f"runs of {count} jobs, {done['depth_after']} messages left"
                )
    for plan, measured in cpu.items():
        result.extra.setdefault("cpu", {})[label("drain", plan)] = {
            key: sorted(m[key] for m in measured)[len(measured) // 2] for key in measured[0]
        }
    own = {plan: [m[f"{plan[0]}_server_us_per_job"] for m in cpu[plan]] for plan in cpu}
    return rates, own


def report(result: CaseResult, phase: str, rates: dict[Plan, list[float]]) -> None:
    for plan, values in rates.items():
        broker, variant = plan
        result.figure(
            label(phase, plan),
            values,
            "jobs/s",
            what=f"{WHAT[f'{phase}_{variant}']}, on {NAMES[broker]}",
        )
    # Each broker's platform cost, then broker against broker: bare, ledger on, and Backlot on
    # RabbitMQ against bare Celery on Redis (both choices at once).
    for numerator, denominator in (
        (("rabbitmq", "ledger_on"), ("rabbitmq", "bare")),
        (("redis", "ledger_on"), ("redis", "bare")),
        (("rabbitmq", "bare"), ("redis", "bare")),
        (("rabbitmq", "ledger_on"), ("redis", "ledger_on")),
        (("rabbitmq", "ledger_on"), ("redis", "bare")),
    ):
        result.ratio(
            f"{label(phase, numerator)} / {label(phase, denominator)}",
            rates[numerator],
            rates[denominator],
        )
