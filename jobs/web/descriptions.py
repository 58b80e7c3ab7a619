"""What a job did, in the words of the app that owns it: the hook by which a domain app names
its jobs' objects (a campaign, a video) and links their pages, for "My jobs" and GET /api/jobs/.

jobs/ never imports the apps: an app registers, per task name, a kind ("Campaign", "Video")
and a describer, from its AppConfig.ready():

    from jobs import JobDescription, describe_jobs

    def describe_fan_outs(jobs):  # every job of the page with this task name, in one call
        names = dict(Campaign.objects.filter(pk__in=[j.args[0] for j in jobs]).values_list(...))
        return {j.id: JobDescription(f"Campaign {names[j.args[0]]}", url) for j in jobs}

    describe_jobs("emails.campaign_fan_out", kind="Campaign", describe=describe_fan_outs)

A describer is called once per task name per page with all of that page's jobs of the task (so
one query of its own serves a page, not one per row) and returns a JobDescription per job id;
a job it leaves out is shown by its task name. If it raises, the error is logged and the
page shows task names for those jobs: a broken describer never breaks "My jobs".
"""

from __future__ import annotations

import logging
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jobs.models import Job

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class JobDescription:
    """A job's domain object as its owner reads it: a label and, when it has one, its page."""

    label: str
    url: str = ""


Describer = Callable[[Sequence["Job"]], Mapping[uuid.UUID, JobDescription]]


@dataclass(frozen=True)
class _Entry:
    kind: str
    describe: Describer | None


# Filled at start-up by the apps' ready(), read-only afterwards (like Django's signal receivers).
_registry: dict[str, _Entry] = {}


def describe_jobs(task_name: str, *, kind: str, describe: Describer | None = None) -> None:
    """Register the kind of `task_name`'s jobs (the "kind" filter of "My jobs" and `kind` of
    GET /api/jobs/) and the function that describes them. Registering a task again replaces
    its entry (a reloaded app config), it does not add a second one."""
    if not kind.strip():
        raise ValueError(f"describe_jobs({task_name!r}): kind must name the kind of job")
    _registry[task_name] = _Entry(kind=kind.strip(), describe=describe)


def kind_of(task_name: str) -> str:
    """The registered kind of a task's jobs; a task nobody registered is its own kind."""
    entry = _registry.get(task_name)
    return entry.kind if entry else task_name


def kinds() -> dict[str, list[str]]:
    """Each registered kind with its task names, kinds in alphabetical order."""
    by_kind: dict[str, list[str]] = defaultdict(list)
    for task_name, entry in _registry.items():
        by_kind[entry.kind].append(task_name)
    return {kind: sorted(by_kind[kind]) for kind in sorted(by_kind)}


def tasks_of_kind(kind: str) -> list[str]:
    """The task names of a kind; an unregistered kind is taken as a task name."""
    return kinds().get(kind) or [kind]


def describe(jobs: Iterable[Job]) -> dict[uuid.UUID, JobDescription]:
    """The descriptions of `jobs`, one describer call per task name among them."""
    by_task: dict[str, list[Job]] = defaultdict(list)
    for job in jobs:
        if (entry := _registry.get(job.task_name)) is not None and entry.describe is not None:
            by_task[job.task_name].append(job)
    found: dict[uuid.UUID, JobDescription] = {}
    for task_name, members in by_task.items():
        describer = _registry[task_name].describe
        assert describer is not None  # only tasks with a describer were collected
        try:
            found.update(describer(members))
        except Exception:  # a domain's bug shows task names, never a broken page
            logger.exception("The describer of %s raised; its jobs show task names", task_name)
    return found
