"""The SDK's request, checked before it travels: what the wire cannot carry (ids past int32,
messages without a role, a length past int32) is the SDK's InvalidRequest, as its docs promise,
never protobuf's ValueError or a KeyError; token ids in any integer type are sent as they are."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from edgespec.client import InvalidRequest, build_request


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
