"""The legacy completions' ``echo`` on a live ``edgespec serve`` with a MaG board, read by the
official ``openai`` client: the prompt's text before the completion's, and with ``logprobs``
the prompt's tokens' logprobs (the first null), as an evaluation harness asks for them (``echo``,
``logprobs`` 1, ``max_tokens`` 1, token ids in a batch of one). The prompt's logprobs are the
model's distribution at each position, read as the prompt is prefilled; the completion is the
one the same request without ``echo`` gets, target-only decoding's."""

from __future__ import annotations

import openai
import pytest
import torch

from edgespec.config import EngineConfig
from edgespec.engine.spec_engine import Request, SpecEngine
from edgespec.runner.target_runner import TargetRunner
from http_harness import MESSAGES, N, PROMPT, TOKEN, call

pytestmark = pytest.mark.slow  # processes, servers or long sweeps: not the fast tier


@pytest.fixture(scope="module")
def ids(looping):
    return looping.tokenizer.encode(PROMPT, add_special_tokens=True)


@pytest.fixture(scope="module")
def in_process(looping, ids):
    """Target-only decoding in this process with the prompt's logprobs (5 alternatives)."""
    runner = TargetRunner(looping.model, n_slots=1, max_len=512)
    with SpecEngine(runner, None, EngineConfig(), stop_ids={2}) as engine:
        return engine.generate(Request(ids, N, prompt_logprobs=5, logprobs=5))


def text_of(looping, token_id: int) -> str:
    return looping.tokenizer.decode([token_id], skip_special_tokens=False)


def test_echo_puts_the_prompts_text_before_the_completion(api, looping, ids, in_process):
    """The text is the prompt and the completion decoded as one (a tokenizer that writes a
    word's leading space only inside a text would otherwise lose it where they meet)."""
    plain = api.completions.create(model=api.model_id, prompt=ids, max_tokens=N, temperature=0)
    echoed = api.completions.create(model=api.model_id, prompt=ids, max_tokens=N,
                                    temperature=0, echo=True)
    assert echoed.choices[0].text == looping.tokenizer.decode(
        ids + in_process.token_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    assert echoed.choices[0].text.endswith(plain.choices[0].text)
    assert echoed.usage == plain.usage  # the prompt counted once, as prompt tokens
    assert echoed.choices[0].logprobs is None


def test_a_stop_string_cuts_the_completion_not_the_prompt(api, looping, ids, in_process):
    """Choices of one request each echo the prompt; a stop string the prompt holds does not
    end the answer before its completion."""
    prompt_text = looping.tokenizer.decode(ids, skip_special_tokens=True)
    completion = looping.tokenizer.decode(in_process.token_ids, skip_special_tokens=True)
    stop = prompt_text[:3]
    r = api.completions.create(model=api.model_id, prompt=ids, max_tokens=N, temperature=0,
                               echo=True, stop=[stop], n=2)
    cut = completion.find(stop)
    want = prompt_text + (completion if cut < 0 else completion[:cut])
    assert [c.text for c in r.choices] == [want, want]


def test_echoed_logprobs_are_the_prompts_then_the_completions(api, looping, ids, in_process):
    r = api.completions.create(model=api.model_id, prompt=ids, max_tokens=N, temperature=0,
                               echo=True, logprobs=2)
    lp = r.choices[0].logprobs
    n = len(ids)
    assert lp.tokens[:n] == [text_of(looping, t) for t in ids]
    assert lp.tokens[n:] == [text_of(looping, t) for t in in_process.token_ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    # the prompt's: target-only's values as this process reads them, exactly
    assert lp.token_logprobs[1:n] == [e.logprob for e in in_process.prompt_logprobs]
    assert lp.token_logprobs[n:] == [e.logprob for e in in_process.logprobs]
    for top, e in zip(lp.top_logprobs[1:n], in_process.prompt_logprobs):
        assert top == {**{text_of(looping, t): v for t, v in e.top[:2]},
                       text_of(looping, e.token): e.logprob}
    # and the model's distribution at each prompt position (transformers' own kernels)
    with torch.no_grad():
        logits = looping.model(torch.tensor([ids])).logits[0].float()
    want = torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert lp.token_logprobs[1:n] == pytest.approx(want.tolist(), abs=1e-4)
    assert r.edgespec["accepted"] > 0  # the completion was drafted and verified
    text = r.choices[0].text
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    prompt_text = looping.tokenizer.decode(ids, skip_special_tokens=True)
    assert lp.text_offset[n] == len(prompt_text) and text.startswith(prompt_text)


def test_a_streamed_echo_is_the_whole_one(api, ids):
    kw = dict(model=api.model_id, prompt=ids, max_tokens=N, temperature=0, echo=True,
              logprobs=1)
    whole = api.completions.create(**kw).choices[0]
    chunks = list(api.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks) == whole.text
    streamed = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs]
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [x for part in streamed for x in getattr(part, key)] == \
            getattr(whole.logprobs, key)


def test_an_evaluation_harness_scoring_request(api, ids, in_process):
    """What lm-evaluation-harness sends to score a continuation: token ids in a batch of one,
    echo, logprobs 1, max_tokens 1, temperature 0."""
    r = api.completions.create(model=api.model_id, prompt=[ids], max_tokens=1, temperature=0,
                               echo=True, logprobs=1)
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == len(ids) + 1
    assert sum(lp.token_logprobs[1:len(ids)]) == \
        pytest.approx(sum(e.logprob for e in in_process.prompt_logprobs))
    assert len(lp.tokens) == len(lp.top_logprobs) == len(ids) + 1
    assert r.usage.completion_tokens == 1 and lp.tokens[-1] in lp.top_logprobs[-1]
    assert lp.token_logprobs[-1] == in_process.logprobs[0].logprob  # the completion's own


def test_echo_is_the_completions_alone(server, api):
    with pytest.raises(openai.BadRequestError) as e:  # the client's chat API has no echo
        api.chat.completions.create(model=api.model_id, messages=MESSAGES, max_tokens=2,
                                    extra_body={"echo": True})
    assert "echo" in str(e.value)
    code, reply = call("POST", server["base"] + "/v1/completions",
                       {"model": api.model_id, "prompt": PROMPT, "max_tokens": 2, "echo": 1},
                       {"Authorization": f"Bearer {TOKEN}"})
    assert code == 400 and reply["error"]["param"] == "echo"


def test_max_tokens_zero_with_echo_scores_the_prompt_alone(api, looping, ids, in_process):
    """The older scoring idiom (``echo``, ``max_tokens`` 0: HELM's, lm-evaluation-harness
    0.3's): the prompt's text and logprobs, no completion, finish_reason "length", streamed
    or whole, a batch of prompts too; without ``echo``, 0 is refused."""
    kw = dict(model=api.model_id, max_tokens=0, temperature=0, echo=True, logprobs=2)
    r = api.completions.create(prompt=ids, **kw)
    choice = r.choices[0]
    assert choice.finish_reason == "length" and r.usage.completion_tokens == 0
    assert choice.text == looping.tokenizer.decode(ids, skip_special_tokens=True)
    lp = choice.logprobs
    assert lp.token_logprobs[0] is None and len(lp.tokens) == len(ids)
    assert lp.token_logprobs[1:] == [e.logprob for e in in_process.prompt_logprobs]
    chunks = list(api.completions.create(prompt=ids, stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    assert chunks[-1].choices[0].finish_reason == "length"
    batch = api.completions.create(prompt=[ids, ids[:5]], **kw)
    assert [c.text for c in batch.choices] == [choice.text, looping.tokenizer.decode(
        ids[:5], skip_special_tokens=True)]
    assert batch.choices[1].logprobs.token_logprobs[1:] == lp.token_logprobs[1:5]
    plain = api.completions.create(prompt=ids, model=api.model_id, max_tokens=0, echo=True)
    assert plain.choices[0].text == choice.text and plain.choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError) as e:
        api.completions.create(model=api.model_id, prompt=ids, max_tokens=0)
    assert "only with echo" in str(e.value)
