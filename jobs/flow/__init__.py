"""What operators and projects do with jobs once they exist: batches, cancel, dead letters and
their replay, the outbox relay, beat's leader scheduler, retention, and the Django Tasks
backend.

May import: everything below it (jobs.core up to jobs.worker). Never jobs.web, admin or
management.
"""
