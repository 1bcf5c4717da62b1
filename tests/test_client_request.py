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
])
def test_what_the_wire_cannot_carry_is_an_invalid_request(kw, needle):
    with pytest.raises(InvalidRequest) as e:
        build_request(**kw)
    assert needle in str(e.value)


def test_max_new_tokens_none_is_the_servers_default():
    assert build_request(prompt="x", max_new_tokens=None).max_new_tokens == 0


@pytest.mark.parametrize("ids", [[5, 6], np.array([5, 6]), torch.tensor([5, 6]),
                                 [np.int64(5), np.int32(6)]])
def test_token_ids_of_any_integer_type_are_sent(ids):
    req = build_request(prompt_ids=ids, max_new_tokens=np.int64(7))
    assert list(req.prompt_ids) == [5, 6] and req.max_new_tokens == 7
