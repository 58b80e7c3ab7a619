"""The pure core of the platform: typed settings (conf), job states and their transitions
(states), retry policies and exceptions, payload and enqueue-option checks, masking, the HTTP
error mapping, fire times, tracing, the events a job emits, the acting context and the owner
queryset.

May import: the standard library, Django's settings and utilities, and itself (conf at the
bottom; events, context and ownership above the rest). Never jobs.models, Celery, kombu or Redis.
"""
