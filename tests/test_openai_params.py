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
])
def test_an_empty_object_or_list_is_neutral_only_where_it_is_the_default(name, value):
    with pytest.raises(ApiError) as e:
        parse_request(completion(**{name: value}), False, MODEL)
    assert e.value.status == 400 and e.value.param == name


def test_penalties_and_logit_bias_become_sampling_settings():
    g = parse_request(chat(presence_penalty=0.5, frequency_penalty=-1, logit_bias={"7": -100,
                                                                                  "3": 2.5}),
                      True, MODEL).generation
    assert g.params.presence_penalty == 0.5 and g.params.frequency_penalty == -1.0
    assert g.params.logit_bias == ((3, 2.5), (7, -100.0))
    assert not parse_request(chat(presence_penalty=0, logit_bias={}), True,
                             MODEL).generation.params.adjusts_logits


@pytest.mark.parametrize("kw,param", [
    (dict(presence_penalty=-2.01), "presence_penalty"),
    (dict(frequency_penalty=3), "frequency_penalty"),
    (dict(frequency_penalty=True), "frequency_penalty"), (dict(logit_bias=[[3, 1]]), "logit_bias"),
    (dict(logit_bias={"3": 100.5}), "logit_bias"), (dict(logit_bias={"3": "1"}), "logit_bias"),
    (dict(logit_bias={"3": None}), "logit_bias"), (dict(logit_bias={"-3": 1}), "logit_bias"),
    (dict(logit_bias={" 3": 1}), "logit_bias"), (dict(logit_bias={"99999999999": 1}), "logit_bias"),
    (dict(logit_bias={"\u0663": 1}), "logit_bias"),  # a digit, not an ASCII one
    (dict(logit_bias={str(i): 1 for i in range(301)}), "logit_bias"),
    (dict(logit_bias={"5": 1, "05": 2}), "logit_bias"),  # one token twice
    (dict(top_k=1 << 40), "top_k"), (dict(top_k=1 << 31), "top_k"), (dict(top_k=-1), "top_k"),
])
def test_bad_penalties_and_logit_bias_are_refused_by_name(kw, param):
    with pytest.raises(ApiError) as e:
        parse_request(chat(**kw), True, MODEL)
    assert e.value.status == 400 and e.value.param == param


@pytest.mark.parametrize("name", ["max_tokens", "max_completion_tokens"])
@pytest.mark.parametrize("value,said", [(1e308, "must be <= 2147483647, got 1e+308"),
                                        (1 << 31, "must be <= 2147483647, got 2147483648"),
                                        (-1e308, "must be >= 1, got -1e+308"),
                                        (-2.0, "must be >= 1, got -2.0")])
def test_a_token_limit_out_of_range_is_refused_by_name_as_given(name, value, said):
    """A limit past the wire's int32, or below 1, is refused naming the parameter, the value
    shown as the request wrote it (-1e308 was shown as its 309 digits)."""
    with pytest.raises(ApiError) as e:
        parse_request(chat(**{name: value}), True, MODEL)
    assert e.value.status == 400 and e.value.param == name
    assert f"'{name}' {said}" in str(e.value)


@pytest.mark.parametrize("name,value", [("user", 7), ("user", ["a"]), ("metadata", "x"),
                                        ("store", 1), ("service_tier", {}),
                                        ("parallel_tool_calls", "abc"),
                                        ("parallel_tool_calls", 1e308)])
def test_an_ignored_hint_of_the_wrong_type_is_refused_by_name(name, value):
    """The hints edgespec ignores are still checked for their type, on both endpoints (the
    completions endpoint took any ``parallel_tool_calls``)."""
    for body, is_chat in ((chat(**{name: value}), True), (completion(**{name: value}), False)):
        with pytest.raises(ApiError) as e:
            parse_request(body, is_chat, MODEL)
        assert e.value.status == 400 and e.value.param == name
    good = {"user": "u-1", "metadata": {"k": "v"}, "store": False, "service_tier": "auto",
            "parallel_tool_calls": True}
    assert parse_request(chat(**good), True, MODEL).generation.max_new_tokens == 0


def test_chat_logprobs_false_or_zero_is_none():
    for value in (False, 0, None):
        assert parse_request(chat(logprobs=value), True, MODEL).generation.logprobs is None
    assert parse_request(chat(logprobs=True), True, MODEL).generation.logprobs == 0
    assert parse_request(chat(logprobs=True, top_logprobs=20), True,
                         MODEL).generation.logprobs == 20


@pytest.mark.parametrize("kw,param", [
    (dict(logprobs=1), "logprobs"), (dict(logprobs="yes"), "logprobs"),
    (dict(top_logprobs=3), "top_logprobs"),  # without logprobs true, as OpenAI answers it
    (dict(logprobs=False, top_logprobs=3), "top_logprobs"),
    (dict(logprobs=True, top_logprobs=21), "top_logprobs"),
    (dict(logprobs=True, top_logprobs=-1), "top_logprobs"),
    (dict(logprobs=True, top_logprobs=2.5), "top_logprobs"),
])
def test_chat_logprobs_settings_out_of_range_are_refused_by_name(kw, param):
    with pytest.raises(ApiError) as e:
        parse_request(chat(**kw), True, MODEL)
    assert e.value.status == 400 and e.value.param == param


def test_completions_logprobs_is_the_count_of_alternatives():
    assert parse_request(completion(), False, MODEL).generation.logprobs is None
    for k in (0, 5, 20):
        assert parse_request(completion(logprobs=k), False, MODEL).generation.logprobs == k
    for bad in (21, -1, True, 1.5):
        with pytest.raises(ApiError) as e:
            parse_request(completion(logprobs=bad), False, MODEL)
        assert e.value.status == 400 and e.value.param == "logprobs"
    with pytest.raises(ApiError) as e:  # not a parameter of the legacy completions
        parse_request(completion(top_logprobs=2), False, MODEL)
    assert e.value.param == "top_logprobs"


@pytest.mark.parametrize("newer,older,tokens,alone", [
    (5, 0, 5, False), (0, 5, 0, True), (0, None, 0, True), (None, 0, 0, True),
    (None, 7, 7, False), (3, None, 3, False)])
def test_with_echo_the_limit_in_force_is_the_newer_names_where_both_are_given(
        newer, older, tokens, alone):
    """max_completion_tokens wins over max_tokens, for the count and for the prompt alone
    (echo with a limit of 0) alike: neither is read from the name that lost."""
    kw = {k: v for k, v in (("max_completion_tokens", newer), ("max_tokens", older))
          if v is not None}
    g = parse_request(completion(echo=True, **kw), False, MODEL).generation
    assert (g.max_new_tokens, g.prompt_only) == (tokens, alone)


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


@pytest.mark.parametrize("options,param", [
    ({"include_usage": True, "bogus": 1}, "stream_options.bogus"),
    ({"include_obfuscation": True}, "stream_options.include_obfuscation"),  # not honoured
])
def test_a_stream_option_edgespec_does_not_honour_is_refused_by_name(options, param):
    with pytest.raises(ApiError) as e:
        parse_request(completion(stream=True, stream_options=options), False, MODEL)
    assert e.value.status == 400 and e.value.param == param and param in str(e.value)
    p = parse_request(completion(stream=True, stream_options={"include_usage": True,
                                                              "include_obfuscation": False}),
                      False, MODEL)
    assert p.stream and p.include_usage


@pytest.mark.parametrize("part,param", [
    ({"type": "text", "text": "hi", "bogus": 5}, "messages.[0].content.[0].bogus"),
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA", "size": 2}},
     "messages.[0].content.[0].image_url.size"),
    ({"type": "image_url", "image_url": "data:image/png;base64,AAAA", "text": "x"},
     "messages.[0].content.[0].text"),
])
def test_a_content_parts_unknown_field_is_refused_by_name(part, param):
    """A content part holds its type's fields (a null one aside): another would be silently
    dropped from the prompt."""
    with pytest.raises(ApiError) as e:
        parse_request(chat({"role": "user", "content": [part]}), True, MODEL)
    assert e.value.status == 400 and e.value.param == param
    p = parse_request(chat({"role": "user", "content": [{"type": "text", "text": "hi",
                                                          "bogus": None}]}), True, MODEL)
    assert p.generation.messages == [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("part", [{"text": "hi"}, "hi", 5, None])
def test_a_content_part_without_a_type_is_told_to_have_one(part):
    with pytest.raises(ApiError) as e:
        parse_request(chat({"role": "user", "content": [part]}), True, MODEL)
    assert e.value.status == 400 and e.value.param == "messages.[0].content.[0]"
    assert "must be an object with a 'type'" in str(e.value)


def test_a_content_part_of_an_unknown_type_names_its_type_field():
    """(A hostile probe's: the refusal named ``messages`` alone, where every other part's
    refusal names the part.)"""
    with pytest.raises(ApiError) as e:
        parse_request(chat({"role": "user", "content": [
            {"type": "text", "text": "hi"}, {"type": "audio", "audio": "x"}]}), True, MODEL)
    assert e.value.status == 400 and e.value.param == "messages.[0].content.[1].type"
    assert "'audio' part" in str(e.value)
