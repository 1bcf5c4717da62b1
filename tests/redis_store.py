"""The Redis-backed session store on a flushed database of a real Redis (embedded and external:
the ``redis_url`` fixture's two), for the store's tests (``test_cache_store``, ``test_cache_waits``,
``test_cache_store_inbox``, ``test_cache_store_faults``); its fixture is imported into them."""

import pytest

from cache_service.redis_conn import RedisHandle
from cache_service.store import RedisSessionStore


@pytest.fixture()
def store(redis_url):
    handle = RedisHandle(redis_url)
    handle.client.flushdb()
    st = RedisSessionStore(handle.client, prefix="t:", ttl_s=30)
    yield st
    st.shutdown()  # its waker and recorder threads end with the test
    handle.close()


def attach(store, device="dev1"):
    """``device`` registered with the store, live, with room for 4 sessions."""
    store.devices.register(device, {"max_sessions": 4})
    return device
