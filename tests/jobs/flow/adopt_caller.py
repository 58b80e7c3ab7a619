"""A caller process in adopt mode (as a host's web process is): `python -m
tests.jobs.flow.adopt_caller <key>` sends the plain tasks of tests/support/adopt_tasks.py and
prints their ids as JSON. DATABASE_URL, REDIS_URL and BACKLOT_ADOPT_CELERY_TASKS=1 come from
the test."""

from __future__ import annotations

import json
import sys
from typing import cast

import django

django.setup()

from celery import chain, group  # noqa: E402
from celery.result import GroupResult  # noqa: E402
from django.db import transaction  # noqa: E402 (after django.setup())

from config.celery import app  # noqa: E402
from tests.support import adopt_tasks as t  # noqa: E402

key = sys.argv[1]
# celery-types types a group's apply_async as AsyncResult; Celery returns a GroupResult.
members = cast(GroupResult, group(t.add.s(i, i) for i in range(3)).apply_async())
app.loader.import_default_modules()
with transaction.atomic():
    # celery-types does not declare DjangoTask's delay_on_commit (Celery's Django task class)
    t.add.delay_on_commit(2, 3, key=f"{key}-commit")  # type: ignore[attr-defined]
ids = {
    "add": t.add.delay(2, 3).id,
    "retrying": t.retrying.delay(key).id,
    "auto_retrying": t.auto_retrying.delay(key).id,
    "ignored": t.ignored.delay(key).id,
    "always_fails": t.always_fails.delay(key).id,
    "opted_out": t.opted_out.delay(key).id,
    # canvas: each member is an adopted task's apply_async
    "chain": chain(t.add.s(1, 2), t.add.s(10)).apply_async().id,
    "group": [r.id for r in members.results or ()],
}
print(json.dumps(ids))
