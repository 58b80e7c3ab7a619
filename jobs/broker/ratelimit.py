"""Cluster-wide rate limits: a GCRA token bucket in Redis, decided by one atomic Lua script.

Every worker process on every host asks the same Redis key, and the script reads Redis's own
clock, so the limit holds across hosts with skewed clocks. A caller that finds no token gets
the time its turn comes; within `max_reserve` seconds it also holds that turn (the bucket
advances), so waiting jobs run in order at the limit instead of stampeding again.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import redis

from jobs.broker.redis import redis_client
from jobs.core.conf import backlot_settings

_RATE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*/\s*(\d*)\s*([smh])\s*$")
_UNIT_SECONDS = {"s": 1.0, "m": 60.0, "h": 3600.0}

# KEYS[1]: bucket; ARGV: interval seconds, burst, max_reserve seconds.
# Returns {verdict, wait}: verdict "go" (run now), "reserved" (run after wait), "full" (no slot
# within max_reserve; ask again after wait).
_ACQUIRE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local interval = tonumber(ARGV[1])
local burst = tonumber(ARGV[2])
local max_reserve = tonumber(ARGV[3])
local tat = tonumber(redis.call('GET', KEYS[1]) or '0')
if tat < now then tat = now end
local wait = tat - interval * (burst - 1) - now
local verdict = 'go'
if wait > max_reserve then
  return {'full', tostring(wait)}
elseif wait > 0 then
  verdict = 'reserved'
else
  wait = 0
end
local new_tat = tat + interval
redis.call('SET', KEYS[1], string.format('%.6f', new_tat),
  'PX', math.ceil((new_tat - now) * 1000) + 1000)
return {verdict, tostring(wait)}
"""


# KEYS[1]: bucket; ARGV: interval seconds, burst. The wait an acquire would get now (0: a
# token is free), without taking one.
_WAIT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local tat = tonumber(redis.call('GET', KEYS[1]) or '0')
if tat < now then tat = now end
local wait = tat - tonumber(ARGV[1]) * (tonumber(ARGV[2]) - 1) - now
if wait < 0 then wait = 0 end
return tostring(wait)
"""


def parse_rate(rate: str) -> float:
    """Seconds between tokens for a rate like "50/s", "100/m", "1000/h" or "3/10s"."""
    match = _RATE_RE.match(rate or "")
    if not match:
        raise ValueError(f"Invalid rate limit {rate!r}: expected e.g. '50/s', '100/m', '1000/h'")
    count, span, unit = float(match[1]), float(match[2] or 1), match[3]
    if count <= 0 or span <= 0:
        raise ValueError(f"Invalid rate limit {rate!r}: count and period must be positive")
    return span * _UNIT_SECONDS[unit] / count


@dataclass(frozen=True)
class Decision:
    """What the bucket said: run now, run after `wait` holding a slot, or ask again later."""

    verdict: str
    wait: float

    @property
    def allowed(self) -> bool:
        return self.verdict == "go"

    @property
    def reserved(self) -> bool:
        return self.verdict == "reserved"


class RateLimiter:
    """Token buckets named `backlot:rate:<name>` in one Redis."""

    def __init__(self, client: redis.Redis | None = None, prefix: str = "backlot:rate:") -> None:
        self.client = client or redis_client()
        self.prefix = prefix
        self._script = self.client.register_script(_ACQUIRE)
        self._wait = self.client.register_script(_WAIT)

    def acquire(
        self, name: str, rate: str, *, burst: int = 1, max_reserve: float | None = None
    ) -> Decision:
        interval = parse_rate(rate)
        if max_reserve is None:
            max_reserve = backlot_settings().RATE_LIMIT_MAX_RESERVE
        verdict, wait = self._script(
            keys=[self.prefix + name], args=[repr(interval), int(burst), repr(float(max_reserve))]
        )
        return Decision(verdict.decode() if isinstance(verdict, bytes) else verdict, float(wait))

    def wait_for(self, name: str, rate: str, *, burst: int = 1) -> float:
        """Seconds until the bucket has a token (0: one is free now); takes none."""
        key, args = self._wait_arguments(name, rate, burst)
        return float(self._wait(keys=[key], args=args))

    def wait_command(self, name: str, rate: str, *, burst: int = 1) -> tuple[Any, ...]:
        """wait_for()'s command, for a caller that sends it and reads its reply (the seconds)
        itself; Redis answers NOSCRIPT until the script is loaded (wait_for() loads it)."""
        key, args = self._wait_arguments(name, rate, burst)
        return ("EVALSHA", self._wait.sha, 1, key, *args)

    def _wait_arguments(self, name: str, rate: str, burst: int) -> tuple[str, list[Any]]:
        return self.prefix + name, [repr(parse_rate(rate)), burst]

    def reset(self, name: str) -> None:
        self.client.delete(self.prefix + name)
