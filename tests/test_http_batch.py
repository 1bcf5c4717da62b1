"""A completions request that batches prompts (``prompt`` as a list of strings or of token id
lists), on a live ``edgespec serve`` with a MaG board, read by the official ``openai`` client:
a session a prompt and choice, each choice the answer its prompt gets alone (target-only
decoding's), in OpenAI's order (a prompt's ``n`` choices together), ``usage`` counting each
prompt once."""

from __future__ import annotations

import pytest

from http_harness import N, TOKEN, call

pytestmark = pytest.mark.slow  # processes, servers or long sweeps: not the fast tier

PROMPTS = ["The capital of France is", "Once upon a time", "1, 2, 3, 4,"]


def alone(api, prompt, **kw):
    return api.completions.create(**{"model": api.model_id, "prompt": prompt, "max_tokens": N,
                                     "temperature": 0, **kw})


def test_each_prompt_of_a_batch_gets_its_own_answer(api, looping):
    singles = [alone(api, p) for p in PROMPTS]
    r = api.completions.create(model=api.model_id, prompt=PROMPTS, max_tokens=N, temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [s.choices[0].text for s in singles]
    assert r.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    assert r.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)
    assert len(r.edgespec) == 3 and len({e["session_id"] for e in r.edgespec}) == 3


def test_token_id_prompts_with_n_choices_come_in_openais_order(api, looping):
    """Two prompts x n = 2, sampled with a seed: choices 0 and 1 are the first prompt's (its
    seed, then the seed after it), 2 and 3 the second's."""
    ids = [looping.tokenizer.encode(p) for p in PROMPTS[:2]]
    kw = dict(max_tokens=N, temperature=0.9, seed=17)
    r = api.completions.create(model=api.model_id, prompt=ids, n=2, **kw)
    want = [alone(api, ids[k], **{**kw, "seed": 17 + i}).choices[0].text
            for k in range(2) for i in range(2)]
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == want
    assert r.usage.prompt_tokens == len(ids[0]) + len(ids[1])  # each prompt once


def test_a_streamed_batch_is_the_whole_one(api):
    whole = api.completions.create(model=api.model_id, prompt=PROMPTS, max_tokens=N,
                                   temperature=0, echo=True, logprobs=1)
    chunks = list(api.completions.create(model=api.model_id, prompt=PROMPTS, max_tokens=N,
                                         temperature=0, echo=True, logprobs=1, stream=True))
    for c in whole.choices:
        mine = [ch.choices[0] for ch in chunks if ch.choices and ch.choices[0].index == c.index]
        assert "".join(m.text for m in mine) == c.text and c.text.startswith(PROMPTS[c.index])
        assert [t for m in mine if m.logprobs for t in m.logprobs.token_logprobs] == \
            c.logprobs.token_logprobs


def cancelled(server) -> float:
    """Sessions the server ended as cancelled so far (its Prometheus counter)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = call("GET", server["base"] + "/metrics")[1]
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name.endswith("request_success_total")
               and s.labels.get("finished_reason") == "cancelled")


@pytest.mark.parametrize("prompt, says", [
    ([], None), (["a", 5], None), ([[1, 2], "a"], "not both"), (["a"] * 65, "at most 64"),
    ([[1, 2], [True]], "'prompt[1]' must be"),
    ([[1, 2], [-1]], "prompt[1]: prompt token ids must be"),  # refused before any is admitted
    (["ab", ""], "prompt[1]: the prompt is empty"),
    ([[1, 2], [5] * 5000], "prompt[1]: the prompt (5000 tokens) exceeds the context limit"),
    (["ab", "\ud800"], "prompt[1]: the prompt holds"),  # a lone surrogate: which prompt
    ([[1, -5]], "prompt token ids must be"),  # a batch of one, refused as a single prompt is
    ([1, -5], "prompt token ids must be"),
])
def test_a_malformed_batch_is_a_400_naming_prompt_and_starts_nothing(server, api, prompt, says):
    before = cancelled(server)
    code, reply = call("POST", server["base"] + "/v1/completions",
                       {"model": api.model_id, "prompt": prompt, "max_tokens": 2},
                       {"Authorization": f"Bearer {TOKEN}"})
    assert code == 400 and reply["error"]["param"] == "prompt", reply
    assert says is None or says in reply["error"]["message"], reply
    assert cancelled(server) == before  # no prompt of it was admitted, then cancelled


def test_a_batch_past_the_verifiers_sessions_is_a_400(server, api):
    code, reply = call("POST", server["base"] + "/v1/completions",
                       {"model": api.model_id, "prompt": ["a"] * 64, "n": 16, "max_tokens": 2},
                       {"Authorization": f"Bearer {TOKEN}"})
    assert code == 400 and reply["error"]["param"] == "prompt"
    assert "64 prompts x n = 16 choices" in reply["error"]["message"]
