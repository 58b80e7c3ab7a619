"""An HTTP answer turned into the retry policy's terms: retry later, with backoff, or give up.

`raise_for_status(response)` reads a requests or httpx response (anything with `.status_code`,
`.headers` and `.text`): 429 and 503 retry after the server's Retry-After (capped by the job's
`max_delay`), other 5xx and 408 retry with backoff, other 4xx are Permanent. Neither library is
imported here.
"""

from __future__ import annotations

import email.utils
import math
import time
from collections.abc import Mapping
from datetime import UTC, datetime
from http import HTTPStatus
from typing import Any, Protocol, TypeVar
from urllib.parse import urlsplit

from jobs.core.masking import mask_text
from jobs.core.policies import Permanent, Retryable

# Statuses whose Retry-After says when to come back (RFC 9110 §10.2.3).
HONOURS_RETRY_AFTER = frozenset({429, 503})
# A 4xx that is about this moment, not the request: retried like a 5xx.
RETRYABLE_CLIENT_ERRORS = frozenset({408})
# Enough of an error body to tell "rate limited" from "invalid key" in the dead-letter list,
# short enough that a 1 MB HTML error page does not land in it.
BODY_EXCERPT_CHARS = 200


class Response(Protocol):
    """The part of a requests or httpx response that raise_for_status reads."""

    @property
    def status_code(self) -> int: ...

    @property
    def headers(self) -> Mapping[str, str]: ...

    @property
    def text(self) -> str: ...


R = TypeVar("R", bound=Response)


def raise_for_status(response: R) -> R:
    """The response when it is not an error (status below 400); otherwise raises.

    Retryable(retry_after=seconds) for 429/503 with a Retry-After, Retryable for those without
    one, for 408 and for every other 5xx; Permanent for the other 4xx. The message names the
    status, the URL without its query string, and the start of the body, masked.
    """
    status = int(response.status_code)
    if status < 400:
        return response
    message = _describe(response, status)
    if status in HONOURS_RETRY_AFTER:
        raise Retryable(message, retry_after=retry_after_seconds(response.headers))
    if status >= 500 or status in RETRYABLE_CLIENT_ERRORS:
        raise Retryable(message)
    raise Permanent(message)


def retry_after_seconds(headers: Mapping[str, str], *, now: float | None = None) -> float | None:
    """The Retry-After header as seconds from now (delta-seconds or an HTTP date), or None.

    A date in the past means 0; a value that is neither form is ignored (None), which leaves
    the delay to the policy's backoff.
    """
    value = headers.get("Retry-After") or headers.get("retry-after")
    if value is None:
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        pass
    else:
        return max(0.0, seconds) if math.isfinite(seconds) else None
    try:
        when: datetime = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:  # HTTP dates are GMT; parsedate leaves "-0000" naive
        when = when.replace(tzinfo=UTC)
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


def _describe(response: Response, status: int) -> str:
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        phrase = "Unknown Status"
    message = f"HTTP {status} {phrase}"
    if where := _url(response):
        message += f" from {where}"
    if body := _excerpt(response):
        message += f": {body}"
    return message


def _url(response: Any) -> str:
    try:  # httpx raises RuntimeError for a response built without a request
        url = response.url
    except (AttributeError, RuntimeError):
        return ""
    # The query string often carries an API key or a person's address: leave it out.
    parts = urlsplit(str(url))
    return f"{parts.scheme}://{parts.netloc}{parts.path}" if parts.netloc else ""


def _excerpt(response: Response) -> str:
    try:
        text = response.text
    except (UnicodeDecodeError, LookupError):  # an undecodable body or unknown charset
        return ""
    # Bound the work on a large body. Where the bound cuts through a word, drop the cut part (an
    # address is at most 254 characters): half an address no longer matches the mask. Mask
    # before the final cut for the same reason.
    bound = BODY_EXCERPT_CHARS * 10
    head = text[:bound]
    if len(text) > bound and not text[bound].isspace():
        end, stop = len(head), max(0, len(head) - 254)
        while end > stop and not head[end - 1].isspace():
            end -= 1
        head = head[:end]
    masked = mask_text(" ".join(head.split()))
    return masked if len(masked) <= BODY_EXCERPT_CHARS else masked[: BODY_EXCERPT_CHARS - 1] + "…"
