"""Time limits in a `-P solo` worker (the default queue's shipped layout: jobs run in the
worker's own process, no hop to a pool process), where Celery enforces none and Backlot does
(jobs.worker.watchdog): the soft limit raises in the job; past the hard limit the worker process
restarts in place and the job counts a worker crash, dead-lettered at the third."""

from __future__ import annotations

from jobs.core.conf import backlot_settings
from jobs.models import DeadLetter, Job, JobState
from tests.system.faults.conftest import runs, wait_finished


def test_a_solo_worker_raises_the_soft_time_limit_in_the_job(
    private_redis, start_fault_worker, client_procs, run_id
):
    start_fault_worker("solo-soft", pool="solo")

    (job_id,) = client_procs.enqueue("soft_stop", run_id, 1)  # sleeps 30 s; soft limit 1 s
    wait_finished([job_id], timeout=60, what="the soft-limited job")

    job = Job.objects.get(id=job_id)
    assert job.state == JobState.SUCCEEDED
    assert job.result == "stopped at the soft limit"  # the job caught SoftTimeLimitExceeded
    assert runs(run_id) == {0: 1}


def test_past_its_hard_limit_a_solo_worker_restarts_in_place_and_the_job_counts_a_crash(
    private_redis, start_fault_worker, client_procs, run_id
):
    worker = start_fault_worker("solo-hard", pool="solo")
    pid = worker.process.pid
    client_procs.start_relay()

    # given a job that swallows its soft limit (1 s) and never ends on its own (hard limit 2 s)
    (job_id,) = client_procs.enqueue("stubborn", run_id, 1)

    # then each run ends at the hard limit with the worker's restart, counted as a crash,
    # until the MAX_WORKER_CRASHES-th sends it to the dead letters
    wait_finished([job_id], timeout=150, what="the stubborn job")
    crashes = backlot_settings().MAX_WORKER_CRASHES
    job = Job.objects.get(id=job_id)
    assert job.state == JobState.DEAD and job.crashes == crashes
    assert runs(run_id) == {0: crashes}
    letter = DeadLetter.objects.get(job_id_value=job_id)
    assert f"worker lost {crashes} times" in letter.exception_message

    # the worker restarted in place (same pid, as a supervisor sees it) and still runs jobs
    log = worker.log_path.read_text(errors="replace")
    assert log.count("ran past its hard time limit") == crashes, log[-3000:]
    assert worker.process.poll() is None and worker.process.pid == pid
    ids = client_procs.enqueue("effect", run_id, 3, start=1)
    wait_finished(ids, timeout=60, what="jobs after the restarts")
    assert Job.objects.filter(id__in=ids, state=JobState.SUCCEEDED).count() == 3
