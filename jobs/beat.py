"""A beat scheduler that fires only while it holds the leader lock in Redis.

Two beats (an overlapping deploy, a second replica by mistake) would fire every schedule
twice. Each beat tries to take or renew a Redis key with an expiry on every tick; only the
holder fires. A dead leader's key expires and another beat takes over within the TTL.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from typing import Any

from django_celery_beat.schedulers import DatabaseScheduler

from .conf import backlot_settings
from .redis import redis_client, redis_text

logger = logging.getLogger(__name__)

LOCK_KEY = "backlot:beat:leader"
# When the leader last finished a tick (a Unix time): /metrics' beat heartbeat.
LAST_TICK_KEY = "backlot:beat:last_tick"
# Take the lock if free, or renew it if it is ours; 1 = we lead.
_LEAD = """
local holder = redis.call('GET', KEYS[1])
if holder == false or holder == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[1], 'EX', tonumber(ARGV[2]))
  return 1
end
return 0
"""


class LeaderDatabaseScheduler(DatabaseScheduler):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.identity = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.lock_ttl = int(backlot_settings().BEAT_LOCK_TTL)
        self.leading = False
        super().__init__(*args, **kwargs)

    def lead(self) -> bool:
        try:
            leading = bool(redis_client().eval(_LEAD, 1, LOCK_KEY, self.identity, self.lock_ttl))
        except Exception as exc:  # noqa: BLE001 - no Redis, no way to know who leads: do not fire
            logger.warning("Beat cannot reach Redis for the leader lock: %s", exc)
            leading = False
        if leading != self.leading:
            logger.warning(
                "Beat %s %s the leader", self.identity, "is now" if leading else "is no longer"
            )
            self.leading = leading
        return leading

    def tick(self, *args: Any, **kwargs: Any) -> float:
        # Renew well inside the TTL; a follower looks again as often.
        check_again = self.lock_ttl / 3
        if not self.lead():
            return check_again
        next_tick = min(super().tick(*args, **kwargs), check_again)
        try:
            redis_client().set(LAST_TICK_KEY, repr(time.time()))
        except Exception as exc:  # noqa: BLE001 - a missed heartbeat must not stop the schedules
            logger.warning("Beat could not record its tick: %s", exc)
        return next_tick

    def close(self) -> None:
        if self.leading:
            try:
                holder = redis_client().get(LOCK_KEY)
                if holder and redis_text(holder) == self.identity:
                    redis_client().delete(LOCK_KEY)  # hand over at once on a clean stop
            except Exception:  # noqa: BLE001 - best effort: the lock expires anyway, close goes on
                pass
        super().close()
