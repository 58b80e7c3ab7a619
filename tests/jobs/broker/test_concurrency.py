"""De-duplication under concurrency: 50 simultaneous enqueues from several processes."""

from __future__ import annotations

import json
import subprocess
import sys

from jobs.models import IdempotencyRecord, Job, JobState
from tests.conftest import ROOT, marks, wait_until

# Each process starts 10 threads that wait on a barrier, then enqueue with the same key.
ENQUEUER = """
import json, sys, threading, django
django.setup()
from django.db import connection
from tests.support import tasks
key, label = sys.argv[1], sys.argv[2]
barrier = threading.Barrier(10)
ids = []
def enqueue():
    barrier.wait()
    ids.append(tasks.record.enqueue(key, label=label, idempotency_key=key).id)
    connection.close()
threads = [threading.Thread(target=enqueue) for _ in range(10)]
[t.start() for t in threads]
[t.join() for t in threads]
print(json.dumps(ids))
"""


def test_fifty_concurrent_enqueues_make_one_job(worker, worker_env, unique):
    env = {**worker_env, "DJANGO_SETTINGS_MODULE": "config.settings"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", ENQUEUER, unique, f"p{n}"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for n in range(5)
    ]
    ids = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        ids += json.loads(out)

    assert len(ids) == 50 and len(set(ids)) == 1
    assert Job.objects.filter(task_name="tests.record").count() == 1
    assert IdempotencyRecord.objects.count() == 1
    wait_until(lambda: Job.objects.filter(id=ids[0], state=JobState.SUCCEEDED).exists())
    assert len(marks(unique)) == 1  # executed once
