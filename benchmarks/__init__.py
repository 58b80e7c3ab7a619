"""Backlot's benchmark suite (`make bench`): Backlot side by side with bare Celery."""
