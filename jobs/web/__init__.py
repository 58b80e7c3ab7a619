"""The Django surface: the JSON API (api, api_queues, api_batches), pages (views, urls,
dashboard, forms), health (monitoring), /metrics and alerts, middleware, error reporting and
system checks.

May import: every package below it. jobs.admin, jobs.management and the top level (tasks,
apps, testing) sit above it.
"""
