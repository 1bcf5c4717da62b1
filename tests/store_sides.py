"""The two stores the session protocol is held against (``test_store_contract``,
``test_store_contract_branches``), each with its drafter side: the in-process
``LocalSessionStore`` and the ``RedisSessionStore`` (Lua in a real Redis, embedded and external);
the ``side`` fixture gives each in turn, and the helpers drive its verifier side."""

from __future__ import annotations

import pytest

from edgespec.config import SamplingParams
from edgespec.protocol.contract import DraftWant, StaleChunkError
from edgespec.protocol.local_store import LocalSessionStore

PROMPT = [1, 2, 3]


class Refused(Exception):
    """A chunk the store refused (either store's own error)."""


class LocalSide:
    """The in-process store and its drafter side (``LocalSessionStore.push_draft``)."""

    def __init__(self):
        self.store = LocalSessionStore()

    def push(self, sid, epoch, start, tokens, window=8, branches=(), idle=False) -> int:
        try:
            return self.store.push_draft(sid, epoch, start, tokens, idle=idle, window=window,
                                         branches=branches)
        except StaleChunkError as e:
            raise Refused(str(e)) from None

    def tokens(self, sid) -> list[int]:
        return self.store.sessions[sid].tokens

    def fixes(self, sid) -> list[tuple]:
        return [(f.epoch, f.position, f.tokens) for f in self.store.sessions[sid].fixes_after(0)]

    def forget(self, sid) -> None:
        self.store.sessions.pop(sid)


class RedisSide:
    """The Redis store and its drafter side (``push``, as the cache service calls it); fixes
    are read from the device's inbox stream."""

    def __init__(self, store):
        self.store = store
        store.devices.register("dev", {"max_sessions": 8})

    def push(self, sid, epoch, start, tokens, window=8, branches=(), idle=False) -> int:
        from cache_service.store import StoreError

        try:
            return self.store.push(sid, epoch, start, tokens, idle, window, branches).kept
        except StoreError as e:
            raise Refused(str(e)) from None

    def tokens(self, sid) -> list[int]:
        rec = self.store.load(sid)
        return rec.prompt + rec.committed

    def fixes(self, sid) -> list[tuple]:
        out = []
        for _, ev in self.store.read_events("dev", "0-0", 0):
            if ev is not None and ev.kind == "commit" and ev.session_id == sid and ev.fix:
                out.append((ev.epoch, ev.position, (ev.token, *ev.more)))
        return out

    def forget(self, sid) -> None:
        self.store.redis.delete(*self.store.keys.session(sid))


@pytest.fixture(params=["local", "redis-embedded", "redis-external"])
def side(request):
    if request.param == "local":
        yield LocalSide()
        return
    from cache_service.redis_conn import RedisHandle
    from cache_service.store import RedisSessionStore

    url = None if request.param == "redis-embedded" else request.getfixturevalue("external_redis")
    handle = RedisHandle(url)
    handle.client.flushdb()
    store = RedisSessionStore(handle.client, prefix="c:", ttl_s=30)
    yield RedisSide(store)
    store.shutdown()
    handle.close()


def new(side, sid="s", prompt=PROMPT, params=SamplingParams()):
    """A session of ``side``'s store, assigned to its drafter side's device."""
    side.store.create(sid, list(prompt), params, "dev", 64)


def take(side, sid="s", k=8, budget=0):
    """The session's draft as a step takes it: up to k tokens, branches within ``budget``."""
    [taken] = side.store.take_when_ready([DraftWant(sid, k, budget)], 0.0)
    return taken


def commit(side, *verdicts):
    """The verdicts committed in one call: each one's outcome, in their order."""
    return side.store.commit_many(list(verdicts))
