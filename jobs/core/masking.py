"""Masks personal data (email addresses) in text shown to operators or written to logs."""

from __future__ import annotations

import re
from typing import Any

_EMAIL = re.compile(r"([A-Za-z0-9._%+-])[A-Za-z0-9._%+-]*@([A-Za-z0-9.-]+\.[A-Za-z]{2,})")


def mask_email(address: str) -> str:
    """j***@example.com for jane.doe@example.com."""
    return _EMAIL.sub(r"\1***@\2", address)


def mask_text(text: str) -> str:
    """Every email address in `text`, masked."""
    if "@" not in text:  # the pattern backtracks over every run of name characters
        return text
    return _EMAIL.sub(r"\1***@\2", text)


def mask_value(value: Any) -> Any:
    """A JSON value with every string's email addresses masked (for argument summaries)."""
    if isinstance(value, str):
        return mask_text(value)
    if isinstance(value, list):
        return [mask_value(item) for item in value]
    if isinstance(value, dict):
        return {key: mask_value(item) for key, item in value.items()}
    return value


# Message headers carry a readable copy of the arguments for Flower and logs; keep it short
# (Redis holds one per queued job) and free of personal data.
REPR_LIMIT = 80


def message_repr(value: Any) -> str:
    """Short, masked repr of job arguments for the message's argsrepr/kwargsrepr headers."""
    text = mask_text(repr(value))
    return text if len(text) <= REPR_LIMIT else text[: REPR_LIMIT - 1] + "…"
