"""The fleet-wide Cacheback table, held in Redis next to the sessions.

Keys (under the store's prefix): ``cb:f``, a hash from a leader n-gram ("12,7,9") to its
followers ("5,88": most recent first); ``cb:lru``, a sorted set of the leaders scored by the
version of their last update; ``cb:v``, the version counter. Every (leader, follower)
observation takes the next version, so a drafter pulls exactly what changed since its last pull
(``ZRANGEBYSCORE``), in pieces, without missing an entry at a piece's edge.

Bounded: at most ``max_leaders`` leaders of ``MAX_FOLLOWERS`` followers each; the least recently
updated leaders are evicted in the same script that adds new ones. At the default 131072
leaders the table took 27.8 MB of Redis memory here (random token ids, mostly one follower each;
recording a 512-token session took ~28 ms, pulling 8192 entries ~0.2 s).

The verifier's store records each session when it closes (``RedisSessionStore.close``): the
source of the table is committed tokens only, never what a drafter claims.
"""

from __future__ import annotations

import logging
from typing import cast

import redis

from edgespec.protocol.fleet_table import MAX_FOLLOWERS, FleetEntry, FleetPull, ngram_pairs

log = logging.getLogger("edgespec.cache")

RECORD_LUA = """
local maxl = tonumber(ARGV[1])
local maxf = tonumber(ARGV[2])
local v = tonumber(redis.call('GET', KEYS[3]) or '0')
for i = 3, #ARGV, 2 do
  local leader, f = ARGV[i], ARGV[i + 1]
  local cur = redis.call('HGET', KEYS[1], leader)
  local list = {f}
  if cur then
    for tok in string.gmatch(cur, '[^,]+') do
      if tok ~= f and #list < maxf then list[#list + 1] = tok end
    end
  end
  local new = table.concat(list, ',')
  if new ~= cur then redis.call('HSET', KEYS[1], leader, new) end
  v = v + 1
  redis.call('ZADD', KEYS[2], v, leader)
end
redis.call('SET', KEYS[3], v)
local extra = redis.call('ZCARD', KEYS[2]) - maxl
while extra > 0 do
  local n = math.min(extra, 1000)
  local victims = redis.call('ZRANGE', KEYS[2], 0, n - 1)
  redis.call('ZREMRANGEBYRANK', KEYS[2], 0, n - 1)
  redis.call('HDEL', KEYS[1], unpack(victims))
  extra = extra - n
end
return v
"""

# pairs per script call: Redis runs a script alone, so each call stays short (~1.5 ms)
MAX_PAIRS_PER_CALL = 128
MAX_PULL = 8192


def _key(leader) -> str:
    return ",".join(str(int(t)) for t in leader)


def _ids(text: bytes | str) -> tuple[int, ...]:
    text = text.decode() if isinstance(text, bytes) else text
    return tuple(int(t) for t in text.split(",") if t)


class RedisFleetTable:
    """A ``FleetTable`` in Redis (see the module docstring)."""

    def __init__(self, client: redis.Redis, prefix: str = "es:", max_leaders: int = 1 << 17,
                 max_followers: int = MAX_FOLLOWERS):
        if max_leaders < 1 or max_followers < 1:
            raise ValueError("the fleet table needs room for one leader and one follower")
        self.redis = client
        self.max_leaders, self.max_followers = max_leaders, max_followers
        self.keys = [f"{prefix}cb:f", f"{prefix}cb:lru", f"{prefix}cb:v"]
        self._record = client.register_script(RECORD_LUA)

    def record(self, tokens: list[int], start: int = 0) -> None:
        pairs = [(_key(leader), str(int(f))) for leader, f in ngram_pairs(tokens, start)]
        try:
            for i in range(0, len(pairs), MAX_PAIRS_PER_CALL):
                args: list[int | str] = [self.max_leaders, self.max_followers]
                for leader, follower in pairs[i:i + MAX_PAIRS_PER_CALL]:
                    args += [leader, follower]
                self._record(keys=self.keys, args=args)
        except redis.RedisError as e:
            log.warning("the fleet table lost an update: %s", e)

    def pull(self, since: int, limit: int = 2048) -> FleetPull:
        limit = max(1, min(int(limit), MAX_PULL))
        f, lru, ver = self.keys
        # the version is read first: whatever is recorded after it gets a later one, so an
        # empty answer never skips an update made meanwhile
        current = int(self.redis.get(ver) or 0)
        # withscores: (member, score) pairs (redis-py's return type covers every variant)
        rows = cast("list[tuple[bytes | str, float]]", self.redis.zrangebyscore(
            lru, f"({int(since)}", "+inf", start=0, num=limit, withscores=True))
        if not rows:
            # current < since: the table started over (cleared, or a Redis without
            # persistence restarted); the puller then starts over too
            return FleetPull([], current, False)
        leaders = [r[0] for r in rows]
        followers = self.redis.hmget(f, leaders)
        entries = [FleetEntry(_ids(leader), _ids(fl))
                   for leader, fl in zip(leaders, followers) if fl]  # evicted meanwhile: skip
        return FleetPull(entries, int(rows[-1][1]), len(rows) == limit)

    def size(self) -> int:
        return int(self.redis.zcard(self.keys[1]))

    def clear(self) -> None:
        self.redis.delete(*self.keys)
