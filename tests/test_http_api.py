"""The OpenAI-compatible HTTP API of a live `edgespec serve --http-port`, driven by the official
`openai` client: the models listed, the README's curl and openai examples, completions and chat
completions (text or token-id prompts, streamed or whole, seeded) equal to target-only, a
prompt's room in its slot, the empty prompt's one rule on every surface. How a request finishes
and what the server counts (stop strings, /metrics, `edgespec status`, cancellation):
tests/test_http_finish_and_metrics.py."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import openai
import pytest

import edgespec

from edgespec.config import DEFAULT_MODEL_NAME
from edgespec.models.loading import encode_prompt
from http_harness import MESSAGES, N, PROMPT, TOKEN, api, reference, server  # noqa: F401

pytestmark = pytest.mark.slow  # processes, servers or long sweeps: not the fast tier


def test_models_lists_the_served_model(api, looping_dir):
    assert api.model_id == str(looping_dir)


README = Path(__file__).resolve().parent.parent / "README.md"


def test_the_readme_http_examples_work(server, api):
    """The README's curl commands and openai example, pointed at this server (its port, the model
    id it serves, its token), answer as the README says: /v1/models lists that id, in the shape
    the README shows; the chat completion answers; the openai example prints its reply."""
    text = README.read_text()
    port = re.search(r"edgespec serve [^\n]*--http-port (\d+)", text).group(1)

    def here(snippet: str) -> str:
        return (snippet.replace(f"http://127.0.0.1:{port}", server["base"])
                .replace(DEFAULT_MODEL_NAME, api.model_id))

    def curl(command: str) -> dict:
        command = here(command).replace("curl ", f'curl -H "Authorization: Bearer {TOKEN}" ', 1)
        out = subprocess.run(["bash", "-c", command], capture_output=True, text=True,
                             timeout=120, check=True)
        return json.loads(out.stdout)

    listing_cmd, chat_cmd = [b for b in re.findall(r"```bash\n(.+?)\n```", text, flags=re.S)
                             if b.startswith("curl ")]
    listing = curl(listing_cmd)
    shown = json.loads(re.search(r"```json\n(.+?)\n```", text, flags=re.S).group(1))
    assert [m["id"] for m in listing["data"]] == [api.model_id]
    assert set(listing) == set(shown) and set(listing["data"][0]) == set(shown["data"][0])
    chat = curl(chat_cmd)
    assert chat["object"] == "chat.completion" and chat["model"] == api.model_id
    assert isinstance(chat["choices"][0]["message"]["content"], str)
    assert chat["usage"]["completion_tokens"] > 0

    example = next(b for b in re.findall(r"```python\n(.+?)\n```", text, flags=re.S)
                   if "openai.OpenAI(" in b)
    assert 'api_key="unused"' in example
    example = here(example).replace('api_key="unused"', f'api_key="{TOKEN}"')
    out = subprocess.run([sys.executable, "-c", example], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.endswith("\n")  # it printed the reply


def test_completion_text_prompt_equals_target_only(api, looping):
    ids = encode_prompt(looping.tokenizer, PROMPT, raw=True)
    ref_ids, ref_text = reference(looping, ids)
    r = api.completions.create(model=api.model_id, prompt=PROMPT, max_tokens=N, temperature=0)
    assert r.choices[0].text == ref_text
    assert r.choices[0].finish_reason == ("length" if len(ref_ids) == N else "stop")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), len(ref_ids))
    assert r.usage.total_tokens == len(ids) + len(ref_ids)
    stats = r.model_extra["edgespec"]
    assert stats["lossless"] is True and stats["device"] == "board-1"
    assert 0 <= stats["accepted"] <= stats["drafted"]


def test_completion_token_ids_prompt(api, looping):
    ids = [1, 30, 31, 30, 31, 30]
    _, ref_text = reference(looping, ids)
    r = api.completions.create(model=api.model_id, prompt=ids, max_tokens=N, temperature=0)
    assert r.choices[0].text == ref_text


def test_a_prompt_gets_the_room_its_slot_leaves(server, api, looping):
    """``--max-context 512`` holds prompt + output + a step's draft room (``--max-draft`` 8 + 1):
    a request asking that much is served, one token more is refused saying how many fit, and a
    request that sets no limit gets the server's default cut to that room (target-only's
    tokens to the slot's end), not a refusal."""
    ids = [1] + [30, 31] * 220  # 441 tokens: room for 512 - 441 - 9 = 62, under the default 128
    room = 512 - len(ids) - 9
    ref_ids, ref_text = reference(looping, ids, room)
    r = api.completions.create(model=api.model_id, prompt=ids, max_tokens=room, temperature=0)
    assert r.choices[0].text == ref_text and r.usage.completion_tokens == len(ref_ids)
    with pytest.raises(openai.BadRequestError) as e:
        api.completions.create(model=api.model_id, prompt=ids, max_tokens=room + 1)
    assert f"at most {room} new tokens fit" in e.value.body["message"]
    assert e.value.code == "context_length_exceeded"
    r = api.completions.create(model=api.model_id, prompt=ids, temperature=0)
    assert r.choices[0].text == ref_text
    assert r.choices[0].finish_reason == ("length" if len(ref_ids) == room else "stop")
    # a prompt that leaves no room, with no limit set: said without a limit it never sent
    full = [1] + [30, 31] * 251  # 503 tokens + 9 of draft room: the slot's 512
    with pytest.raises(openai.BadRequestError) as e:
        api.completions.create(model=api.model_id, prompt=full)
    message = e.value.body["message"]
    assert "leaves no room for output within the context limit (512)" in message
    assert "max_new_tokens" not in message and e.value.code == "context_length_exceeded"


def test_chat_completion_equals_target_only(api, looping):
    ids = encode_prompt(looping.tokenizer, messages=MESSAGES)
    ref_ids, ref_text = reference(looping, ids)
    r = api.chat.completions.create(model=api.model_id, messages=MESSAGES, max_tokens=N,
                                    temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref_text
    assert r.usage.completion_tokens == len(ref_ids)


def test_streams_concatenate_to_the_whole_text_with_usage_last(api):
    for chat in (False, True):
        kw = dict(model=api.model_id, max_tokens=N, temperature=0)
        if chat:
            whole = api.chat.completions.create(messages=MESSAGES, **kw)
            chunks = list(api.chat.completions.create(
                messages=MESSAGES, stream=True, stream_options={"include_usage": True}, **kw))
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            expected = whole.choices[0].message.content
        else:
            whole = api.completions.create(prompt=PROMPT, **kw)
            chunks = list(api.completions.create(
                prompt=PROMPT, stream=True, stream_options={"include_usage": True}, **kw))
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            expected = whole.choices[0].text
        assert text == expected
        assert chunks[-1].choices == [] and chunks[-1].usage.model_dump()["completion_tokens"] \
            == whole.usage.completion_tokens
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
        assert finishes[-1] == whole.choices[0].finish_reason
        assert all(f is None for f in finishes[:-1])


def test_an_empty_prompt_is_one_rule_on_every_surface(server, api, looping):
    """"" through the chat template is an empty user message, which the template makes into
    tokens: it generates, over HTTP and through the SDK (gRPC) alike, what target-only does. A
    prompt of zero tokens (raw "", no token ids) is refused on both with one message (the CLI:
    tests/test_cli.py)."""
    ids = encode_prompt(looping.tokenizer, "")
    ref_ids, ref_text = reference(looping, ids)
    r = api.chat.completions.create(model=api.model_id, messages=[{"role": "user", "content": ""}],
                                    max_tokens=N, temperature=0)
    assert r.choices[0].message.content == ref_text and r.usage.prompt_tokens == len(ids)
    with edgespec.Client(server["address"], token=TOKEN) as client:
        out = client.generate("", max_new_tokens=N)
        assert out.token_ids == ref_ids and out.prompt_tokens == len(ids)
        for kw in (dict(prompt="", raw=True), dict(prompt_ids=[])):
            with pytest.raises(edgespec.InvalidRequest, match="the prompt is empty$"):
                client.generate(**kw, max_new_tokens=N)
    for prompt in ("", []):
        with pytest.raises(openai.BadRequestError) as e:
            api.completions.create(model=api.model_id, prompt=prompt, max_tokens=N)
        assert e.value.body["message"] == "the prompt is empty" and e.value.param == "prompt"


def test_seeded_sampling_is_reproducible(api):
    kw = dict(model=api.model_id, prompt=PROMPT, max_tokens=20, temperature=0.9, seed=11)
    assert api.completions.create(**kw).choices[0].text == \
        api.completions.create(**kw).choices[0].text
