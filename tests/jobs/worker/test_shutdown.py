"""SIGTERM: an idle worker stops at once; the soft shutdown waits only while a job runs."""

from __future__ import annotations

import signal
import time

from config.celery import app


def test_an_idle_worker_stops_at_once_on_sigterm(start_worker):
    # given: an idle worker with the platform's 30 s soft shutdown
    assert app.conf.worker_soft_shutdown_timeout == 30.0
    worker = start_worker("idle-stop", queues="default", concurrency=1)

    # when
    worker.process.send_signal(signal.SIGTERM)
    termed = time.monotonic()
    code = worker.process.wait(timeout=25)

    # then: it exits cleanly well before the soft shutdown's timeout
    took = time.monotonic() - termed
    assert code == 0
    assert took < 10, f"an idle worker took {took:.1f} s to stop"
    assert "Initiating Soft Shutdown" not in worker.output()
