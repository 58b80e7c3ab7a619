"""Log formatting: personal data masked in every line, JSON lines when LOG_FORMAT=json."""

from __future__ import annotations

import json
import logging

from jobs import mask_text

# Fields job log lines carry (see jobs.worker.telemetry.job_event), emitted as JSON keys.
JOB_FIELDS = (
    "event",
    "job_id",
    "task",
    "queue",
    "attempt",
    "duration",
    "outcome",
    "exception_class",
    "trace_id",
)


class MaskingFormatter(logging.Formatter):
    """The standard formatter with every email address in the line (and traceback) masked."""

    def format(self, record: logging.LogRecord) -> str:
        return mask_text(super().format(record))


class JsonFormatter(MaskingFormatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": self.formatTime(record),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        entry.update({key: getattr(record, key) for key in JOB_FIELDS if hasattr(record, key)})
        if record.exc_info:
            entry["traceback"] = self.formatException(record.exc_info)
        return mask_text(json.dumps(entry, default=str))
