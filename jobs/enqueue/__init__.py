"""The way a job comes in: the ledger row and its message (submit: enqueue one job, enqueue
many, publish after commit). Below the worker, which enqueues retries, children and
redeliveries through it.

May import: jobs.core, jobs.models, jobs.ledger and jobs.broker.
"""
