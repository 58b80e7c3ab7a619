"""Finds raw email addresses and the suite's own secrets in worker logs."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from jobs.core.masking import mask_text

# An address with at least two local-part characters right before the "@": jobs.core.masking turns
# every address into "j***@example.com", whose only character before the "@" is "*", so a
# match here is an address that reached the log unmasked. One-letter local parts ("x@host.com")
# look the same masked or not and are not personal; Message-IDs ("<uuid@backlot>") have no TLD.
RAW_EMAIL = re.compile(r"[A-Za-z0-9._%+-]{2,}@[A-Za-z0-9.-]+\.[A-Za-z]{2,}")

# Tokens, passwords and names this suite hands out; none may ever reach a log.
_SECRETS: set[str] = set()


def remember_secret(value: str) -> str:
    """Register a secret the suite uses (the log scan looks for it); returns it unchanged."""
    if len(value) < 8:
        raise ValueError("a secret shorter than 8 characters would match by chance")
    _SECRETS.add(value)
    return value


def remembered_secrets() -> frozenset[str]:
    return frozenset(_SECRETS)


@dataclass(frozen=True)
class Finding:
    path: Path
    line: int
    kind: str  # "email address" or "secret"
    shown: str  # the line with addresses masked and secrets blanked: safe to print

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.kind}: {self.shown}"


def _shown(line: str, secrets: Iterable[str]) -> str:
    for secret in secrets:
        line = line.replace(secret, "<secret>")
    return mask_text(line.rstrip())[:300]


def scan_file(path: Path, secrets: Iterable[str] = ()) -> list[Finding]:
    """Every line of `path` that holds a raw email address or one of `secrets`."""
    secrets = tuple(secrets)
    findings = []
    with path.open(errors="replace") as lines:
        for number, line in enumerate(lines, start=1):
            if RAW_EMAIL.search(line):
                findings.append(Finding(path, number, "email address", _shown(line, secrets)))
            if any(secret in line for secret in secrets):
                findings.append(Finding(path, number, "secret", _shown(line, secrets)))
    return findings


def logs_written_since(directory: Path, since: float) -> list[Path]:
    """Files in `directory` modified at or after `since` (a time.time() value)."""
    if not directory.is_dir():
        return []
    return sorted(
        path for path in directory.iterdir() if path.is_file() and path.stat().st_mtime >= since
    )
