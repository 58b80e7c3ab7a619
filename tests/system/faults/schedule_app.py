"""The fault schedule's jobs, its test-only enqueue endpoint, and its relay entry point.

The load of tests/system/faults/test_fault_schedule.py goes through a real web process
(runserver with tests.system.faults.schedule_settings, whose ROOT_URLCONF is this module: the
project's own URLs plus one test-only endpoint) with bearer-token auth, because the fault
suite's jobs (effects counted in `faults_applied`) have no endpoint of the product's API.
`POST /faults-schedule/enqueue/` is what a domain app's view does: validate, enqueue (inside a
batch for kind "batch"), answer 202 with the job ids.

Workers import this module (-I) for the long job and the batch callback; the relay runs here
(`python -m tests.system.faults.schedule_app relay`), so that it knows every job the workers
know, as a project's `manage.py jobs relay` does.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import django
from django.apps import apps

if not apps.ready:  # run as the relay command; workers and the web process are set up already
    django.setup()

from django.core.management import call_command
from django.db import transaction
from django.http import HttpRequest, JsonResponse
from django.urls import path
from django.views.decorators.csrf import csrf_exempt

import jobs
from config.urls import urlpatterns as project_urlpatterns
from jobs.worker.decorators import job
from tests.system.faults import jobs as fault_jobs
from web.auth import TokenAuth

LONG_STEPS = 8
LONG_STEP_SECONDS = 0.75  # a long job runs 6 s, reporting progress at each step


@job(name="faults.schedule_long", bind=True, time_limit=60, retry=fault_jobs.QUICK_RETRY)
def long_job(self: Any, run: str, item: int) -> int:
    """A long job: reports progress at each of its steps, then applies its effect once."""
    fault_jobs.count_run(run, item)
    for step in range(LONG_STEPS):
        time.sleep(LONG_STEP_SECONDS)
        self.progress(step + 1, LONG_STEPS, f"step {step + 1}")
    fault_jobs.apply_effect(run, item, self.request.id)
    return item


@job(name="faults.schedule_batch_done", bind=True, time_limit=10, retry=fault_jobs.QUICK_RETRY)
def batch_done(self: Any, batch_id: str, run: str, item: int) -> int:
    """A batch's on_complete callback: its effect, once (item: the batch's callback item)."""
    fault_jobs.apply_effect(run, item, self.request.id)
    return item


def enqueue_call(*, run: str, seed: int, call: dict[str, Any], owner: Any) -> dict[str, Any]:
    """One call of the plan (tests.system.faults.schedule.Call) as the jobs it enqueues."""
    kind, item = call["kind"], call["item"]
    if kind == "effect":
        handle = fault_jobs.effect.using(owner=owner).enqueue(run=run, item=item, seconds=0.2)
    elif kind == "flaky":
        handle = fault_jobs.flaky.using(owner=owner).enqueue(
            run=run, item=item, seed=seed, seconds=0.2
        )
    elif kind == "delayed":
        handle = fault_jobs.effect.using(owner=owner, delay=call["delay"]).enqueue(
            run=run, item=item, seconds=0.1
        )
    elif kind == "long":
        handle = long_job.using(owner=owner).enqueue(run=run, item=item)
    elif kind == "batch":
        members = call["members"]
        done = batch_done.s(run, item + members)
        with transaction.atomic(), jobs.batch(description="fault schedule", on_complete=done,
                                              owner=owner) as opened:  # fmt: skip
            ids = [
                (fault_jobs.flaky if n % 3 == 2 else fault_jobs.effect)
                .using(owner=owner)
                .enqueue(run=run, item=item + n, **({"seed": seed} if n % 3 == 2 else {}))
                .id
                for n in range(members)
            ]
        return {"job_ids": ids, "batch_id": str(opened.id), "callback_item": item + members}
    else:
        raise ValueError(f"unknown kind {kind!r}")
    return {"job_ids": [handle.id]}


@csrf_exempt
def enqueue_view(request: HttpRequest) -> JsonResponse:
    """POST {"run", "seed", "call"}: 202 {"job_ids", ["batch_id"]}; 401 without a token."""
    user = TokenAuth()(request)
    if user is None:
        return JsonResponse({"detail": "Unauthorized"}, status=401)
    if request.method != "POST":
        return JsonResponse({"detail": "POST only"}, status=405)
    try:
        body = json.loads(request.body)
        answer = enqueue_call(run=body["run"], seed=body["seed"], call=body["call"], owner=user)
    except (KeyError, ValueError) as exc:
        return JsonResponse({"detail": f"bad request: {exc}"}, status=400)
    return JsonResponse(answer, status=202)


urlpatterns = [path("faults-schedule/enqueue/", enqueue_view), *project_urlpatterns]


def relay(spec: dict[str, Any]) -> None:
    """`manage.py jobs relay`, in a process that knows the schedule's jobs."""
    call_command("jobs", "relay", "--interval", str(spec.get("interval", 1.0)))


def token(spec: dict[str, Any]) -> None:
    """A user of the API and its bearer token (printed once, as `ApiToken.issue` returns it)."""
    from django.contrib.auth import get_user_model

    from web.models import ApiToken

    user = get_user_model().objects.create_user(spec["username"], password=None)
    print(json.dumps({"token": ApiToken.issue(user=user, name="fault schedule")[1]}), flush=True)


if __name__ == "__main__":
    command, spec = sys.argv[1], json.loads(sys.argv[2])
    {"relay": relay, "token": token}[command](spec)
