"""The SDK's request, checked before it travels: what the wire cannot carry (ids past int32,
messages without a role, a length past int32) is the SDK's InvalidRequest, as its docs promise,
never protobuf's ValueError or a KeyError; token ids in any integer type are sent as they are."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from edgespec.client import InvalidRequest, build_request
from edgespec.sdk.request import check_timeout


@pytest.mark.parametrize("kw,needle", [
    (dict(prompt_ids=[1, 1 << 31]), "prompt_ids"),
    (dict(prompt_ids=[1, -1]), "prompt_ids"),
    (dict(prompt_ids=[1, "2"]), "prompt_ids"),
    (dict(prompt_ids=[1, 2.0]), "prompt_ids"),
    (dict(prompt_ids=[True]), "prompt_ids"),
    (dict(prompt="x", max_new_tokens=1 << 31), "max_new_tokens"),
    (dict(prompt="x", max_new_tokens=-1), "max_new_tokens"),
    (dict(prompt="x", max_new_tokens=2.5), "max_new_tokens"),
    (dict(messages=[{"content": "hi"}]), "role"),
    (dict(messages=[{"role": "user", "content": None}]), "content"),
    (dict(messages=["hi"]), "role"),
    # sampling parameters of the wrong type: named, not protobuf's TypeError
    (dict(prompt="x", top_k=5.5), "top_k must be an integer"),
    (dict(prompt="x", top_k=True), "top_k must be an integer"),
    (dict(prompt="x", seed=1.5), "seed must be an integer"),
    (dict(prompt="x", seed=True), "seed must be an integer"),
    (dict(prompt="x", temperature="0.5"), "temperature must be a number"),
    (dict(prompt="x", top_p="0.9"), "top_p must be a number"),
    # values the wire's 32-bit floats would carry as others: 0 (greedy, no top-p filter) or inf
    (dict(prompt="x", temperature=1e-46), "32-bit float"),
    (dict(prompt="x", top_p=1e-46), "32-bit float"),
    (dict(prompt="x", temperature=1e39), "32-bit float"),
    # the request's own fields of the wrong type: named (protobuf's and len()'s TypeErrors)
    (dict(prompt=5), "prompt must be a string, got int"),
    (dict(prompt="x", device_id=5), "device_id must be a string"),
    (dict(prompt="x", raw="yes"), "raw must be True or False"),
    (dict(prompt_ids=5), "prompt_ids must be a list"),
    (dict(prompt_ids=iter([1, 2])), "prompt_ids must be a list"),
    (dict(messages="hi"), "messages must be a list"),
])
def test_what_the_wire_cannot_carry_is_an_invalid_request(kw, needle):
    with pytest.raises(InvalidRequest) as e:
        build_request(**kw)
    assert needle in str(e.value)


def test_sampling_parameters_the_wire_carries_are_sent():
    req = build_request(prompt="x", temperature=1e-30, top_p=2e-38, top_k=np.int64(5),
                        seed=np.int32(3))
    s = req.sampling
    assert s.temperature > 0 and s.top_p > 0 and (s.top_k, s.seed, s.has_seed) == (5, 3, True)


def test_max_new_tokens_none_is_the_servers_default():
    assert build_request(prompt="x", max_new_tokens=None).max_new_tokens == 0


@pytest.mark.parametrize("ids", [[5, 6], np.array([5, 6]), torch.tensor([5, 6]),
                                 [np.int64(5), np.int32(6)]])
def test_token_ids_of_any_integer_type_are_sent(ids):
    req = build_request(prompt_ids=ids, max_new_tokens=np.int64(7))
    assert list(req.prompt_ids) == [5, 6] and req.max_new_tokens == 7


@pytest.mark.parametrize("timeout,needle", [
    ("10", "must be seconds (a number), got str"), (True, "a number"),
    (-1, "must be > 0 seconds"), (float("nan"), "must be > 0 seconds"),
])
def test_a_timeout_that_is_no_number_of_seconds_is_an_invalid_request(timeout, needle):
    from edgespec.client import AsyncClient, Client

    with pytest.raises(InvalidRequest, match=re.escape(needle)):
        check_timeout(timeout)
    with pytest.raises(InvalidRequest, match="the client's timeout"):
        Client("127.0.0.1:1", timeout=timeout)
    with pytest.raises(InvalidRequest, match="the client's timeout"):
        AsyncClient("127.0.0.1:1", timeout=timeout)


def test_a_timeout_of_none_or_0_is_none_and_a_far_one_is_capped():
    """gRPC took a deadline of 1e10 s or more (or inf) as one passed already: a call failed at
    once with DEADLINE_EXCEEDED. It is capped at MAX_TIMEOUT_S (years)."""
    from edgespec.sdk.request import MAX_TIMEOUT_S

    assert check_timeout(None) is None and check_timeout(0) is None
    assert check_timeout(2.5) == 2.5
    assert check_timeout(1e12) == check_timeout(float("inf")) == MAX_TIMEOUT_S


def test_a_closed_client_refuses_its_calls_at_once():
    """A closed client's call raised gRPC's ValueError, or (closed before its first call)
    waited out its whole timeout: InvalidRequest at once, before any network."""
    import asyncio

    from edgespec.client import AsyncClient, Client

    c = Client("127.0.0.1:1", timeout=600)
    c.close()
    for call in (lambda: c.generate("x"), lambda: list(c.stream("x")), c.status,
                 lambda: c.cancel("s")):
        with pytest.raises(InvalidRequest, match="this client is closed"):
            call()

    async def go():
        ac = AsyncClient("127.0.0.1:1", timeout=600)
        await ac.close()
        with pytest.raises(InvalidRequest, match="this client is closed"):
            await ac.generate("x")
        with pytest.raises(InvalidRequest, match="this client is closed"):
            await ac.cancel("s")

    loop = asyncio.new_event_loop()  # not asyncio.run: it leaves the thread no current loop,
    try:  # which later tests of this process may ask for
        loop.run_until_complete(go())
    finally:
        loop.close()
