"""Issue 17, item 6: Redis failover through Sentinel, under load, on the multi-host cluster.

    bl-svc-<pid>  10.231.0.1   PostgreSQL, three Sentinels (:26379-26381, quorum 2), the load
    bl-pri-<pid>  10.231.0.2   the Redis primary
    bl-rep-<pid>  10.231.0.3   its replica
    bl-h1-<pid>   10.231.0.11  a worker, and `manage.py jobs relay`
    bl-h2-<pid>   10.231.0.12  a worker

Every process of the platform is given only the Sentinels (REDIS_SENTINELS, REDIS_SENTINEL_MASTER)
and a REDIS_URL whose host nothing listens on: the broker, the relay, the heartbeats, the locks
and the counters find the primary through the Sentinels, or not at all.

Under a steady load the replica falls behind (its link is cut, so it receives nothing more),
a burst of delayed jobs is accepted and published to the primary alone, then the primary's host
is lost: kill -9 of its redis-server, then its link cut for good. The replica's link comes back,
the Sentinels promote it, and it holds none of the messages of its last second and a half. The
test checks that every accepted job ended succeeded (or dead-lettered) with its effect once, that
the jobs whose messages the promoted replica never had were among them, finished within 60 s of
the kill (the relay's reconcile re-sends them), and that both workers ran jobs on the new primary.

Size: FAILOVER_JOBS (240) steady jobs at FAILOVER_RATE (20/s) and FAILOVER_BURST (40) delayed
ones; 1-1.5 minutes on 2 loaded cores (1,400 jobs: about 2 minutes).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import wait_until
from tests.scale.cluster import (
    REDIS_HOST_ADDRESSES,
    REDIS_PORT,
    SENTINEL_PORTS,
    CeleryWorker,
    ClusterError,
    Network,
    Postgres,
    Process,
    Redis,
    Sentinel,
    remove_stale_namespaces,
    require_privileges,
)
from tests.scale.conftest import Driver, figures

pytestmark = pytest.mark.timeout(600)

JOBS = int(os.environ.get("FAILOVER_JOBS", "240"))
RATE = float(os.environ.get("FAILOVER_RATE", "20"))
BURST = int(os.environ.get("FAILOVER_BURST", "40"))
# The burst's jobs are due this long after they are accepted: countdown messages a worker holds
# (in `unacked`) until then, published while the replica receives nothing.
BURST_DELAY = 6.0
# The primary is killed once this many steady jobs were accepted.
KILL_AT = max(40, int(JOBS * 0.4))
# Steady jobs accepted after the burst, before the kill (published to the primary alone).
AFTER_BURST = 10
CONCURRENCY = 3
# Jobs whose messages the promoted replica never had must have finished this soon after the kill.
RECOVERY_BOUND = 60.0
# Bound on the wait for every accepted job to end.
DRAIN_TIMEOUT = 240
PRIMARY = f"{REDIS_HOST_ADDRESSES['pri']}:{REDIS_PORT}"
REPLICA = f"{REDIS_HOST_ADDRESSES['rep']}:{REDIS_PORT}"


@dataclass
class FailoverRun:
    run: str
    hosts: dict[str, str]  # h1/h2 -> the worker's nodename
    load: dict[str, Any]
    missing: dict[str, Any]
    drain: dict[str, Any]
    report: dict[str, Any]
    moments: dict[str, float]  # time.time() of cut, kill, promoted
    masters: list[str]  # the master each Sentinel named at the end
    timings: dict[str, float] = field(default_factory=dict)


def replica_online(primary: Redis) -> bool:
    info = primary.cli("info", "replication")
    return "connected_slaves:1" in info and "state=online" in info


@pytest.fixture(scope="module")
def failover_run() -> Iterator[FailoverRun]:
    """Build the cluster, run the load through the failover, read the results back, and tear
    everything down (by PID, then the namespaces) before any assertion runs."""
    try:
        require_privileges()
    except ClusterError as exc:
        pytest.fail(str(exc), pytrace=False)
    remove_stale_namespaces()
    tag = str(os.getpid())
    began = time.monotonic()
    network = Network(tag, extra=REDIS_HOST_ADDRESSES)
    workdir = Path(tempfile.mkdtemp(prefix=f"backlot-failover-{tag}-", dir="/tmp"))
    workdir.chmod(0o755)
    primary = Redis(
        network.extra["pri"], workdir / "pri", tag, address=REDIS_HOST_ADDRESSES["pri"],
        role="primary",
    )  # fmt: skip
    replica = Redis(
        network.extra["rep"], workdir / "rep", tag, address=REDIS_HOST_ADDRESSES["rep"],
        replicaof=PRIMARY, role="replica",
    )  # fmt: skip
    sentinels = [
        Sentinel(network.services, workdir / f"sentinel-{port}", tag, port, PRIMARY)
        for port in SENTINEL_PORTS
    ]
    postgres = Postgres(network.services, workdir / "pg", tag)
    workers: list[CeleryWorker] = []
    others: list[Process] = []
    moments: dict[str, float] = {}
    timings: dict[str, float] = {}
    try:
        network.create()
        primary.start()
        replica.start()
        wait_until(lambda: replica_online(primary), timeout=60, what="the replica to sync")
        for sentinel in sentinels:
            sentinel.start()
        # Each Sentinel must know the replica and the other two before the primary can fail.
        wait_until(
            lambda: all(sentinel.known() == (1, 2) for sentinel in sentinels),
            timeout=90,
            interval=0.5,
            what="the Sentinels to find the replica and each other",
        )
        postgres.start()
        timings["services"] = time.monotonic() - began
        env = {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "config.settings",
            "DATABASE_URL": postgres.url,
            # Only the Sentinels lead to Redis: nothing listens at this URL's host and port,
            # which gives the database (and would give a password) only.
            "REDIS_URL": "redis://127.0.0.1:1/0",
            "REDIS_SENTINELS": ",".join(sentinel.address for sentinel in sentinels),
            "REDIS_SENTINEL_MASTER": Sentinel.MASTER_NAME,
            "PYTHONUNBUFFERED": "1",
            "CELERY_WORKER_SOFT_SHUTDOWN_TIMEOUT": "2",
        }
        driver = Driver(network.services, env, module="tests.scale.failover_driver")
        timings["migrate"] = driver("setup", timeout=300)["seconds"]
        for namespace in network.hosts.values():
            worker = CeleryWorker(
                namespace, env, CONCURRENCY, imports="tests.scale.failover_jobs", queues="default"
            )
            workers.append(worker)
            worker.start()
        relay = Process(
            network.hosts["h1"], "relay", env, sys.executable, "-m", "tests.scale.failover_driver",
            "relay", "{}",
        )  # fmt: skip
        others.append(relay)
        relay.start()
        driver("ping", timeout=90, names=[worker.nodename for worker in workers], within=60)
        timings["ready"] = time.monotonic() - began

        run = uuid.uuid4().hex[:10]
        burst_file = workdir / "burst"
        spec = {
            "run": run, "jobs": JOBS, "rate": RATE, "burst": BURST, "burst_delay": BURST_DELAY,
            "burst_file": str(burst_file),
        }  # fmt: skip
        load = Process(
            network.services, "load", env, sys.executable, "-m", "tests.scale.failover_driver",
            "load", json.dumps(spec),
        )  # fmt: skip
        others.append(load)
        load.start()
        wait_until(lambda: load.alive() and load.accepted() >= KILL_AT, timeout=120,
                   what=f"{KILL_AT} jobs accepted")  # fmt: skip

        # The replica falls behind: from here on it receives nothing from the primary.
        network.set_link("rep", up=False)
        moments["cut"] = time.time()
        burst_file.touch()
        wait_until(
            lambda: load.alive() and any("burst" in line for line in load.json_lines()),
            timeout=60,
            what="the burst accepted",
        )
        after = load.accepted() + AFTER_BURST
        wait_until(lambda: load.alive() and load.accepted() >= min(after, JOBS + BURST),
                   timeout=60, what="more jobs accepted after the burst")  # fmt: skip

        # The primary's host is lost: its server killed, then its link cut for good (what the
        # kernel still had to send the replica never arrives).
        primary.kill()
        network.set_link("pri", up=False)
        moments["kill"] = time.time()
        network.set_link("rep", up=True)
        wait_until(
            lambda: all(sentinel.master_address() == REPLICA for sentinel in sentinels),
            timeout=60,
            interval=0.2,
            what="the Sentinels to promote the replica",
        )
        moments["promoted"] = time.time()
        missing = driver("missing", timeout=120)
        moments["missing_read"] = time.time()
        assert load.process is not None
        load.process.wait(timeout=JOBS / RATE + 180)
        load_result = load.json_lines()[-1]
        drain = driver(
            "wait",
            timeout=DRAIN_TIMEOUT + 30,
            total=load_result["accepted"],
            within=DRAIN_TIMEOUT,
        )
        moments["drained"] = time.time()
        report = driver("report", timeout=120, run=run, after=moments["promoted"])
        for worker in workers:
            worker.alive()
        relay.alive()
        masters = [sentinel.master_address() for sentinel in sentinels]
        result = FailoverRun(
            run=run,
            hosts={host: f"scale@{namespace}" for host, namespace in network.hosts.items()},
            load=load_result,
            missing=missing,
            drain=drain,
            report=report,
            moments=moments,
            masters=masters,
            timings=timings,
        )
    except BaseException:
        for service in [*workers, *others, *sentinels, primary, replica]:
            print(f"--- {service.name} (last lines) ---\n{service.tail()}", file=sys.stderr)
        raise
    finally:
        for worker in workers:
            worker.signal_stop()
        for service in [*workers, *others, postgres, *sentinels, replica, primary]:
            try:
                service.stop()
            except Exception as exc:  # noqa: BLE001 (stop the rest, delete the namespaces)
                print(f"stopping {service.name}: {exc}", file=sys.stderr)
        leftovers = network.delete()
        shutil.rmtree(workdir, ignore_errors=True)
        timings["total"] = time.monotonic() - began
    assert not leftovers, leftovers
    yield result


def recovered_at(run: FailoverRun) -> float:
    """When the last job whose message the promoted replica lacked finished (Unix time)."""
    finished = run.report["finished"]
    return max(finished[job_id] for job_id in run.missing["missing"])


def test_report_figures(failover_run: FailoverRun) -> None:
    """Not a check: one line of measured figures for docs/reliability.md and the CI log."""
    run = failover_run
    at = run.moments
    counters = run.report["counters"]
    missing = run.missing["missing"]
    figures(
        f"failover: {run.load['accepted']} jobs accepted ({JOBS} at {RATE:.0f}/s + {BURST} "
        f"delayed {BURST_DELAY:.0f} s), states {run.report['states']}; replica behind for "
        f"{at['kill'] - at['cut']:.1f} s; kill -9 -> promoted {at['promoted'] - at['kill']:.1f} s; "
        f"{len(missing)} jobs the promoted replica had no message of (of "
        f"{run.missing['waiting']} waiting), last of them done "
        f"{recovered_at(run) - at['kill']:.1f} s after the kill"
        if missing
        else "none missing"
    )
    figures(
        f"failover: all done {at['drained'] - at['kill']:.1f} s after the kill (last finish "
        f"{max(run.report['finished'].values()) - at['kill']:.1f} s); attempts "
        f"{run.report['attempts']}, deliveries {run.report['deliveries']}, body runs "
        f"{sum(run.report['runs'].values())}; relay re-sent {counters['missing_resent']}, "
        f"lease lapses {counters['lease_lapses']}, reservations restored "
        f"{counters['reservations_restored']} / dropped {counters['reservations_dropped']}, "
        f"fencing {counters['fencing']}; load failed calls {run.load['failed']}; cluster up "
        f"{run.timings['ready']:.1f} s, whole run {run.timings['total']:.1f} s"
    )


def test_the_sentinels_promoted_the_replica(failover_run: FailoverRun) -> None:
    assert failover_run.masters == [REPLICA] * len(SENTINEL_PORTS)
    assert failover_run.moments["promoted"] - failover_run.moments["kill"] < 30


def test_every_accepted_job_ended_with_its_effect_once(failover_run: FailoverRun) -> None:
    report, load = failover_run.report, failover_run.load
    assert load["accepted"] == load["distinct"] == JOBS + BURST
    # The ledger holds exactly the accepted jobs, each succeeded or dead-lettered.
    assert sorted(load["ids"]) == report["ids"]
    assert set(report["states"]) <= {"succeeded", "dead"}, report["states"]
    assert report["dead"] == [], f"dead-lettered: {report['dead']}"
    marks = {int(item): n for item, n in report["marks"].items()}
    items = set(range(JOBS + BURST))
    lost = sorted(items - set(marks))
    twice = sorted(item for item, n in marks.items() if n > 1)
    assert not lost, f"{len(lost)} jobs without their effect: {lost[:20]}"
    assert not twice, f"{len(twice)} effects applied twice: {twice[:20]}"
    assert set(marks) == items


def test_jobs_the_promoted_replica_never_received_were_resent_within_60s(
    failover_run: FailoverRun,
) -> None:
    missing = failover_run.missing["missing"]
    # The test's point: the replica did miss messages (published while it was cut off).
    assert missing, failover_run.missing
    assert set(missing) <= set(failover_run.report["ids"])
    finished = failover_run.report["finished"]
    assert all(job_id in finished for job_id in missing)
    assert recovered_at(failover_run) - failover_run.moments["kill"] < RECOVERY_BOUND
    # The relay (through the Sentinels, on the new primary) is who sent them again.
    assert failover_run.report["counters"]["missing_resent"] > 0


def test_both_workers_ran_jobs_on_the_new_primary(failover_run: FailoverRun) -> None:
    after = failover_run.report["hosts_after_promotion"]
    for node in failover_run.hosts.values():
        assert after.get(node, 0) > 0, (node, after)
