"""`make bench-peers`: Backlot next to the peers a team would pick instead (issue 16).

Dramatiq (Redis), RQ, Huey (Redis), Procrastinate (PostgreSQL) and django-tasks' database
backend run the same no-op drain, single enqueue, bulk enqueue and latency cases as Backlot
ledger-off and ledger-on in the shipped worker layout, in one run, on the same Redis and
PostgreSQL (scripts/bench-peers.sh starts them). The peers live in their own virtualenv
(.data/venv-peers): their modules here are run only by that venv's Python, never imported by
pytest (it collects tests/ only) nor by `make bench`; mypy checks them with the peer libraries
missing (ignore_missing_imports: they type as Any).

Modules: common (stdlib + redis-py: processes, polling, statistics, the case protocol), peer
(one peer's cases, run in the peers venv), backlot (Backlot's, run in .venv under Django),
the peer apps (dramatiq_app, rq_app, huey_app, procrastinate_app, djtasks_app +
djtasks_settings), and __main__ (the run: each side in turn, ratios, table, JSON).
"""
