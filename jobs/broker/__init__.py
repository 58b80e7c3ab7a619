"""The broker layer: the only package that knows kombu and Redis' layout. Publishing (broker),
the atomic fetch and its reservation records, the restore sweep, timers, counters, rate limits,
concurrency gates and their slots, and the pause flags.

May import: jobs.core, jobs.models and jobs.ledger (slots moves a job's row when its slot
frees), kombu and redis-py. Never the worker, enqueue or anything above.
"""
