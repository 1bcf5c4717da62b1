"""The OpenAI request body read into edgespec's terms (``verifier_node.openai_params``), in
process: a parameter edgespec does not honour is accepted only at its neutral value, of its
JSON kind, and a chat message only with what the chat template is given (role, content), so a
client never silently gets another behaviour than the one it asked for. The served API's own
answers to these are in test_http_refusals."""

from __future__ import annotations

import pytest

from verifier_node.openai_params import ApiError, parse_request

MODEL = "m"


def completion(**kw) -> dict:
    return {"model": MODEL, "prompt": "hi", **kw}


def chat(*messages, **kw) -> dict:
    return {"model": MODEL, "messages": list(messages) or [{"role": "user", "content": "hi"}],
            **kw}


@pytest.mark.parametrize("kw", [
    dict(logit_bias={}), dict(logit_bias=None), dict(tools=[]), dict(tools=None),
    dict(response_format={"type": "text"}), dict(presence_penalty=0.0), dict(echo=False),
    dict(logprobs=None), dict(logprobs=False), dict(best_of=1), dict(tool_choice="none"),
])
def test_neutral_values_are_accepted(kw):
    assert parse_request(completion(**kw), False, MODEL).generation.prompt == "hi"


@pytest.mark.parametrize("name,value", [
    ("presence_penalty", []), ("frequency_penalty", {}), ("logprobs", {}), ("best_of", []),
    ("echo", []), ("tool_choice", {}), ("logit_bias", []), ("tools", {}),
    ("response_format", {}), ("response_format", {"type": "json_object"}),
    ("logprobs", 0),  # the legacy completions' 0 asks for the sampled token's logprob
])
def test_an_empty_object_or_list_is_neutral_only_where_it_is_the_default(name, value):
    with pytest.raises(ApiError) as e:
        parse_request(completion(**{name: value}), False, MODEL)
    assert e.value.status == 400 and e.value.param == name


def test_chat_logprobs_false_or_zero_is_neutral():
    for value in (False, 0, None):
        parse_request(chat(logprobs=value), True, MODEL)
    with pytest.raises(ApiError):
        parse_request(chat(logprobs=True), True, MODEL)


def test_an_echoed_assistant_message_with_empty_tool_fields_is_read_as_its_text():
    echoed = {"role": "assistant", "content": "hello", "tool_calls": None, "refusal": None,
              "function_call": None, "audio": None, "annotations": [],
              "parsed": None}  # the openai client's stream() / parse() message's model_dump()
    p = parse_request(chat({"role": "user", "content": "hi"}, echoed,
                           {"role": "user", "content": "again"}), True, MODEL)
    assert p.generation.messages == [{"role": "user", "content": "hi"},
                                     {"role": "assistant", "content": "hello"},
                                     {"role": "user", "content": "again"}]


@pytest.mark.parametrize("extra", [
    {"name": "alice"},
    {"tool_calls": [{"id": "c1", "type": "function",
                     "function": {"name": "f", "arguments": "{}"}}]},
    {"tool_call_id": "c1"},
    {"weight": 2},
    {"tool_calls": {}},
    {"refusal": "no"},
])
def test_a_message_field_the_prompt_would_lose_is_refused_by_name(extra):
    key = next(iter(extra))
    with pytest.raises(ApiError) as e:
        parse_request(chat({"role": "user", "content": "hi"},
                           {"role": "assistant", "content": "x", **extra}), True, MODEL)
    assert e.value.status == 400 and f"messages[1].{key}" in str(e.value)
    assert e.value.param == "messages.[1]"


def test_a_developer_message_is_the_templates_system_message():
    """OpenAI's ``developer`` role is its newer models' ``system``: the chat template (which
    knows system and, given none, may add a default of its own) is given ``system``."""
    p = parse_request(chat({"role": "developer", "content": "Be brief."},
                           {"role": "user", "content": "hi"}), True, MODEL)
    assert p.generation.messages == [{"role": "system", "content": "Be brief."},
                                     {"role": "user", "content": "hi"}]
