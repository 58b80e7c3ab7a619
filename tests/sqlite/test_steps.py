"""Durable steps (jobs.worker.steps) on SQLite, with the suite's four worker processes on one
file: a failing third step retried without its first two, the same job dead at its third step
replayed without them, and a durable sleep that resumes once."""

from __future__ import annotations

from jobs.testing import wait_until
from tests.sqlite.conftest import SQLiteSite

FINISHED = {"succeeded", "dead", "cancelled"}


def runs(site: SQLiteSite, unique: str) -> tuple[int, int, int]:
    one, two, three = (len(site.marks(f"{unique}:{step}")) for step in ("one", "two", "three"))
    return one, two, three


def test_steps_run_once_across_retries_and_a_replay_on_sqlite(site: SQLiteSite, unique):
    # given: a 3-step job whose third step fails twice, and one that dies at its third step
    retried = site.driver.enqueue("steps.three", unique, 2)
    dying = site.driver.enqueue("steps.three_dies", f"{unique}-d", 2)

    # when they end
    done, dead = site.driver.wait_states([retried, dying], FINISHED, timeout=90)

    # then: the first succeeded on its third attempt, steps 1 and 2 ran once
    assert (done["state"], done["attempts"]) == ("succeeded", 3), done["error"]
    assert done["result"] == [{"rows": [1, 2, 3]}, 6, "total 6"]
    assert runs(site, unique) == (1, 1, 3)
    assert site.driver("steps", job_id=retried)["steps"] == [
        ["fetch", "succeeded", 1, None],
        ["sum", "succeeded", 1, None],
        ["post", "succeeded", 3, None],
    ]
    # and the dead one, replayed, runs only its third step again
    assert dead["state"] == "dead" and runs(site, f"{unique}-d") == (1, 1, 2)
    (letter,) = site.driver("dead_letters", ids=[dying])["dead_letters"]
    replayed = site.driver("replay", dead_letter_id=letter["id"])["id"]
    (again,) = site.driver.wait_states([replayed], FINISHED, timeout=60)
    assert again["state"] == "succeeded" and again["result"][2] == "total 6"
    assert runs(site, f"{unique}-d") == (1, 1, 3)
    assert site.driver("steps", job_id=replayed)["steps"] == [
        ["fetch", "succeeded", 1, dying],
        ["sum", "succeeded", 1, dying],
        ["post", "succeeded", 1, None],
    ]


def test_a_durable_sleep_resumes_once_on_sqlite(site: SQLiteSite, unique):
    job_id = site.driver.enqueue("steps.napper", unique, 2)

    (done,) = site.driver.wait_states([job_id], FINISHED, timeout=60)

    assert (done["state"], done["attempts"], done["result"]) == ("succeeded", 1, "rested")
    (before,), (after,) = site.marks(f"{unique}:before"), site.marks(f"{unique}:after")
    assert after[0] - before[0] >= 2
    assert [name for name, *_ in site.driver("steps", job_id=job_id)["steps"]] == [
        "before",
        "sleep-2",
        "after",
    ]


def test_a_signal_wakes_a_waiting_job_on_sqlite(site: SQLiteSite, unique):
    job_id = site.driver.enqueue("steps.waiter", unique)

    def waiting() -> bool:
        (row,) = site.driver.jobs([job_id])
        return bool(row["state"] == "scheduled" and site.marks(f"{unique}:before"))

    wait_until(waiting, timeout=60, interval=0.25, what="the job to wait")
    assert site.driver("signal", job_id=job_id, name="approved", payload={"by": 7}) == {
        "woke": True
    }

    (done,) = site.driver.wait_states([job_id], FINISHED, timeout=60)
    assert (done["state"], done["result"], done["attempts"]) == ("succeeded", {"by": 7}, 1)
    assert len(site.marks(f"{unique}:before")) == len(site.marks(f"{unique}:after")) == 1
