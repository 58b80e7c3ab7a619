"""The worker side: PlatformTask and @job (task, decorators, celery_task), the task registry,
the request and the run (execution → outcomes → redelivery), the lease and its renewer,
progress, effects-once, the ledger result backend, telemetry, Celery's signals and the app's
configuration (celery.configure).

May import: jobs.core, jobs.models, jobs.ledger, jobs.broker and jobs.enqueue; Celery.
Inner layers (bottom up): lease / progress / effects, redelivery, outcomes, execution,
celery_task, task, then decorators / registry / signals / request / results / telemetry / celery.
"""
