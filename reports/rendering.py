"""HTML to PDF with WeasyPrint, written under MEDIA_ROOT so that a reader never sees half a file."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from django.conf import settings

REPORTS_DIR = "reports"


@dataclass(frozen=True)
class PdfFile:
    name: str  # relative to MEDIA_ROOT
    pages: int
    size_bytes: int


def pdf_file_name(*, token: uuid.UUID, year: int, month: int) -> str:
    """reports/YYYY/MM/<token>.pdf: the name comes from a random token, never from input."""
    return f"{REPORTS_DIR}/{year:04d}/{month:02d}/{token.hex}.pdf"


def pdf_write(*, html: str, name: str, on_step: Callable[[str], None] | None = None) -> PdfFile:
    """Lay out `html` and store the PDF as MEDIA_ROOT/`name`.

    The bytes go to a temporary file in the same directory, are flushed to disk, and are then
    renamed over the final name (atomic on one file system): a worker killed half-way leaves
    at most a stray temporary file, never a truncated PDF under the real name.
    """
    from weasyprint import HTML  # heavy (~0.5 s): loaded by the workers that render, not by web

    target = Path(settings.MEDIA_ROOT) / name
    target.parent.mkdir(parents=True, exist_ok=True)
    document = HTML(string=html, base_url=str(settings.BASE_DIR)).render()
    if on_step:
        on_step("laid out pages")
    data = document.write_pdf()
    temporary = target.with_name(f".{target.stem}.{uuid.uuid4().hex}.tmp")
    try:
        with open(temporary, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, target)
    finally:
        temporary.unlink(missing_ok=True)
    if on_step:
        on_step("wrote PDF")
    return PdfFile(name=name, pages=len(document.pages), size_bytes=len(data))
