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
    # text UTF-8 cannot carry (a lone surrogate, as json.loads("\"\\ud800\"") gives): named,
    # not protobuf's UnicodeEncodeError
    (dict(prompt="a\ud800b"), "prompt holds '\\ud800' at 1"),
    (dict(prompt="x", device_id="d\udfff"), "device_id holds"),
    (dict(messages=[{"role": "user", "content": "\ud800"}]), "messages[0]['content'] holds"),
    (dict(messages=[{"role": "us\ud800er", "content": "hi"}]), "messages[0]['role'] holds"),
    (dict(messages=[{"role": "user", "content": "hi"}], raw=True), "raw=True sends a prompt"),
    # a key the wire would drop (HTTP refuses it too: it would change the prompt); None is none
    (dict(messages=[{"role": "user", "content": "hi", "name": "b"}]), "holds 'name'"),
    (dict(prompt="x", images="photo.png"), "images must be a list"),
    (dict(prompt="x", images=b"\x89PNG"), "images must be a list"),
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


@pytest.mark.parametrize("address,token,needle", [
    ("http://127.0.0.1:50051", None, "without a scheme"),
    ("127.0.0.1", None, "the port included"),
    ("127.0.0.1:122847", None, "the port must be in 0-65535"),  # gRPC: port 57311
    (50051, None, "address must be a string"),
    ("127.0.0.1:50051", "tökén", "printable ASCII"),
    ("127.0.0.1:50051", "a\nb", "printable ASCII"),
    ("127.0.0.1:50051", "", "printable ASCII"),
])
def test_a_client_with_an_address_or_token_grpc_would_misread_is_refused_at_once(
        address, token, needle):
    """Before any channel is made, both clients, whatever is listening (nothing here): gRPC would
    take a port past 65535 modulo 65536 (another server's), wait out the deadline for an address
    with a scheme or without a port, or fail a token in its headers with a bare INTERNAL."""
    from edgespec.client import AsyncClient, Client

    for make in (Client, AsyncClient):
        with pytest.raises(InvalidRequest) as e:
            make(address, token=token)
        assert needle in str(e.value)


@pytest.mark.parametrize("kw,needle", [
    (dict(address="127.0.0.1:0"), "port 0 is a listener's"),
    (dict(max_resumes=-1), "max_resumes must be an integer >= 0"),
    (dict(max_resumes=1.5), "max_resumes must be an integer >= 0"),
    (dict(max_resumes=True), "max_resumes must be an integer >= 0"),
    (dict(channel_options=[("grpc.keepalive_time_ms",)]), "(name, value) pairs"),
    (dict(channel_options=5), "(name, value) pairs"),
    (dict(tls_ca="/nonexistent/ca.pem"), "cannot read /nonexistent/ca.pem"),
])
def test_a_clients_other_settings_are_refused_as_the_sdks_errors(kw, needle):
    """(A newcomer's probe's: a negative max_resumes and port 0 were taken, a malformed option
    raised a bare ValueError, an unreadable CA file the command line's ConfigError: every
    refusal the SDK makes is an EdgespecError.)"""
    from edgespec.client import AsyncClient, Client

    kw = {"address": "127.0.0.1:50051", **kw}
    for make in (Client, AsyncClient):
        with pytest.raises(InvalidRequest) as e:
            make(**kw)
        assert needle in str(e.value)
    Client("127.0.0.1:50051", max_resumes=0,
           channel_options=[("grpc.keepalive_time_ms", 30000)]).close()


def test_channel_options_are_read_once_whatever_their_kind():
    """An iterator of pairs is read by the check and what it read is what the channel gets
    (a review's find: the check used it up, and the channel got none); a mapping's items as
    pairs (it was taken before the check)."""
    from edgespec.sdk.request import check_client_args

    want = [("grpc.keepalive_time_ms", 30000), ("grpc.enable_retries", 0)]
    assert check_client_args("127.0.0.1:50051", None, 8, iter(want)) == want
    assert check_client_args("127.0.0.1:50051", None, 8, dict(want)) == want
    assert check_client_args("127.0.0.1:50051", None, 8, ()) == []


@pytest.mark.parametrize("session_id,needle", [(5, "session_id must be a string"),
                                               ("s\ud800", "session_id holds")])
def test_cancelling_an_id_the_wire_cannot_carry_is_an_invalid_request(session_id, needle):
    import asyncio

    from edgespec.client import AsyncClient, Client

    with Client("127.0.0.1:1") as c:  # refused before any contact: nothing listens there
        with pytest.raises(InvalidRequest) as e:
            c.cancel(session_id)
        assert needle in str(e.value)

    async def cancel_async():
        c = AsyncClient("127.0.0.1:1")
        try:
            await c.cancel(session_id)
        finally:
            await c.close()

    with pytest.raises(InvalidRequest) as e:
        asyncio.run(cancel_async())
    assert needle in str(e.value)


def test_an_option_a_generation_does_not_have_is_named_with_the_one_it_may_mean():
    """A misspelt option is a TypeError naming it and the option it is close to (OpenAI's
    ``max_tokens`` for ``max_new_tokens``), or listing the options, before anything travels:
    the client below points at no server."""
    from edgespec.client import Client

    client = Client("127.0.0.1:9", timeout=1)
    with pytest.raises(TypeError, match=r"'max_tokens'.*did you mean 'max_new_tokens'"):
        client.generate("x", max_tokens=5)
    with pytest.raises(TypeError, match=r"'zzz'.*options: .*max_new_tokens.*timeout"):
        list(client.stream("x", zzz=1))
    client.close()


def test_a_message_s_none_valued_keys_are_none_given():
    req = build_request(messages=[{"role": "user", "content": "hi", "name": None}])
    assert [(m.role, m.content) for m in req.messages] == [("user", "hi")]
