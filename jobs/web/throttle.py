"""Sign-in throttling: failed sign-ins and bearer tokens, per account and per client address.

Failures take a token from a bucket of the platform's limiter (jobs.broker.ratelimit, GCRA in
Redis: the limit holds across every web process); while a bucket is empty, the next attempt is
refused before its password or token is checked: 429 with Retry-After. The buckets are:

- ``signin:account:<hash>``: the login page and the admin's login share it (one account), at
  ``SIGNIN_FAILURES_PER_ACCOUNT``; a successful sign-in empties it again;
- ``signin:address:<ip>``: ``SIGNIN_FAILURES_PER_ADDRESS``;
- ``token:address:<ip>``: unknown bearer tokens, ``TOKEN_FAILURES_PER_ADDRESS`` (a token that
  is guessed names no account).

Redis unreachable: the throttle lets attempts through (logged), as enqueue goes on without
Redis; sign-in and the API keep working while it is away.

Account names are kept as a hash (no personal data in Redis keys or metrics). An operator lifts a
lockout with ``manage.py jobs_signin_unlock --account NAME | --address IP``. What was refused and
failed is counted for /metrics (``backlot_signin_failures``, ``backlot_signin_refused``).
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import hiredis
from django.http import HttpRequest
from redis.exceptions import RedisError, ResponseError

from jobs.broker.ratelimit import RateLimiter
from jobs.broker.redis import redis_client, redis_text
from jobs.core.conf import backlot_settings

logger = logging.getLogger(__name__)

COUNTS = "backlot:signin:counts"
PREFIX = "backlot:rate:"
SIGNIN = "signin"
TOKEN = "token"


@dataclass(frozen=True)
class Lockout:
    """An attempt refused: by which bucket (``account`` or ``address``) and for how long."""

    by: str
    wait: float

    @property
    def retry_after(self) -> int:
        """Whole seconds, as Retry-After takes them (RFC 9110), never 0."""
        return max(1, math.ceil(self.wait))

    def message(self) -> str:
        whom = "this account" if self.by == "account" else "this address"
        return (
            f"Too many failed sign-ins for {whom}; try again in {self.retry_after} s "
            "(an operator can lift the lockout)."
        )


def client_address(request: HttpRequest) -> str:
    """The client's address as the server saw it (REMOTE_ADDR; a proxy in front must set it)."""
    return str(request.META.get("REMOTE_ADDR") or "unknown")


def account_key(account: str) -> str:
    return hashlib.sha256(account.strip().lower().encode()).hexdigest()[:32]


def _rate_count(rate: str) -> int:
    """The count of "5/15m": the burst of failures the bucket lets through."""
    return max(1, int(float(rate.split("/", 1)[0])))


def _buckets(surface: str, address: str, account: str | None) -> list[tuple[str, str, str]]:
    """(by, bucket name, rate) of one attempt."""
    conf = backlot_settings()
    if surface == TOKEN:
        return [("address", f"token:address:{address}", conf.TOKEN_FAILURES_PER_ADDRESS)]
    buckets = [("address", f"signin:address:{address}", conf.SIGNIN_FAILURES_PER_ADDRESS)]
    if account:
        buckets.append(
            ("account", f"signin:account:{account_key(account)}", conf.SIGNIN_FAILURES_PER_ACCOUNT)
        )
    return buckets


def locked_out(surface: str, *, address: str, account: str | None = None) -> Lockout | None:
    """The lockout this attempt meets, the longest of its buckets'; None if it may go on.

    A refusal is counted (``refused``, by surface and bucket)."""
    with lockout_asked(surface, address=address, account=account) as answer:
        return answer()


@contextmanager
def lockout_asked(
    surface: str, *, address: str, account: str | None = None
) -> Iterator[Callable[[], Lockout | None]]:
    """locked_out() in two halves: the question goes to Redis as the block starts (one packet
    on a pooled connection) and the block's ``answer()`` reads the reply, so that the caller's
    own round trip runs while Redis answers: the API's token lookup, on every request that
    sends a bearer token. The block decides nothing about the attempt before answer() says it
    may go on; leaving the block without asking drops the connection (its reply unread)."""
    buckets = _buckets(surface, address, account)
    limiter = RateLimiter(prefix=PREFIX)
    pool = limiter.client.connection_pool
    unread: Any = None  # the connection holding the replies, until answer() reads them
    try:
        connection = pool.get_connection()
        try:
            packed = b"".join(
                [
                    hiredis.pack_command(limiter.wait_command(name, rate, burst=_rate_count(rate)))
                    for _, name, rate in buckets
                ]
            )
            connection.send_packed_command([packed])  # one bytes object: one send
        except BaseException:
            connection.disconnect()
            pool.release(connection)
            raise
        unread = connection
    except (RedisError, OSError) as exc:
        _let_through(exc)

    def answer() -> Lockout | None:
        nonlocal unread
        if unread is None:
            return None  # Redis unavailable (logged)
        connection, unread = unread, None
        replies: list[Any] = []
        try:
            for _ in buckets:  # every reply read, so the connection stays in step
                try:
                    replies.append(connection.read_response())
                except ResponseError as exc:
                    replies.append(exc)
        except BaseException as exc:
            connection.disconnect()
            if not isinstance(exc, (RedisError, OSError)):
                raise
            _let_through(exc)
            return None
        finally:
            pool.release(connection)
        if any(isinstance(reply, Exception) for reply in replies):
            # NOSCRIPT (a Redis restarted or flushed since): asked again, loading the script
            return _locked_out_now(limiter, buckets, surface)
        return _refused(
            surface, [(by, float(wait)) for (by, _, _), wait in zip(buckets, replies, strict=True)]
        )

    try:
        yield answer
    finally:
        if unread is not None:
            unread.disconnect()
            pool.release(unread)


def _locked_out_now(
    limiter: RateLimiter, buckets: list[tuple[str, str, str]], surface: str
) -> Lockout | None:
    try:
        waits = [
            (by, limiter.wait_for(name, rate, burst=_rate_count(rate)))
            for by, name, rate in buckets
        ]
    except (RedisError, OSError) as exc:
        _let_through(exc)
        return None
    return _refused(surface, waits)


def _let_through(exc: BaseException) -> None:
    """Redis could not say: the attempt goes on (a sign-in throttle never locks everyone out
    while Redis is away), and the operator is told."""
    logger.warning("Sign-in throttle unavailable, letting the attempt through: %s", exc)


def _refused(surface: str, waits: list[tuple[str, float]]) -> Lockout | None:
    """The longest of the buckets' waits as the lockout, counted; None when none waits."""
    found: Lockout | None = None
    for by, wait in waits:
        if wait > 0 and (found is None or wait > found.wait):
            found = Lockout(by=by, wait=wait)
    if found is not None:
        try:
            redis_client().hincrby(COUNTS, f"refused\t{surface}\t{found.by}", 1)
        except (RedisError, OSError) as exc:
            logger.warning("Sign-in throttle's refusal not counted: %s", exc)
    return found


def failed(surface: str, *, address: str, account: str | None = None) -> None:
    """A failed sign-in or unknown token: one token from each of its buckets, counted."""
    try:
        limiter = RateLimiter(prefix=PREFIX)
        for _, name, rate in _buckets(surface, address, account):
            limiter.acquire(name, rate, burst=_rate_count(rate), max_reserve=0)
        redis_client().hincrby(COUNTS, f"failed\t{surface}", 1)
    except (RedisError, OSError) as exc:
        logger.warning("Sign-in throttle unavailable, failure not counted: %s", exc)


def succeeded(*, account: str) -> None:
    """A sign-in that passed: the account's failures are forgotten (its address's are not)."""
    try:
        RateLimiter(prefix=PREFIX).reset(f"signin:account:{account_key(account)}")
    except (RedisError, OSError) as exc:
        logger.warning("Sign-in throttle unavailable, failures not reset: %s", exc)


def lift(*, account: str | None = None, address: str | None = None) -> int:
    """An operator lifts a lockout: the account's or address's buckets emptied; how many were."""
    client = redis_client()
    names = []
    if account:
        names.append(f"{PREFIX}signin:account:{account_key(account)}")
    if address:
        names += [f"{PREFIX}signin:address:{address}", f"{PREFIX}token:address:{address}"]
    return int(client.delete(*names)) if names else 0


def counts() -> dict[tuple[str, ...], int]:
    """What was counted: ("failed", surface) and ("refused", surface, by) -> n."""
    return {
        tuple(redis_text(field).split("\t")): int(n)
        for field, n in redis_client().hgetall(COUNTS).items()
    }
