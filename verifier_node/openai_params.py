"""Reading an OpenAI completions / chat-completions request body into edgespec's terms.

Honoured: ``model``, ``prompt`` (completions: text or token ids, or a batch of either) or
``messages`` (chat; roles
system, developer, user, assistant, tool, as OpenAI's: another is refused by name), content
parts ``text`` and ``image_url`` (an image as a ``data:`` URL, for a vision-language target:
``image_parts``), ``max_tokens`` / ``max_completion_tokens``, ``temperature`` (default 1, as
OpenAI's), ``top_p``, ``top_k`` (an extension), ``verify`` (an extension: "exact", or "loose" /
"pad" where the verifier was started with ``--verify loose`` / ``--verify pad:DIR``), ``seed``,
``stop`` (a string or up to 4), ``n`` (1-16 choices, a session each, their prompt
prefilled once), ``stream``, ``stream_options.include_usage``,
``logprobs`` (chat: a boolean, with ``top_logprobs`` 0-20 alternatives; completions: 0-20
alternatives; ``logprob_shapes`` gives the answers' shapes), ``presence_penalty``,
``frequency_penalty`` and ``logit_bias`` (``edgespec.verify.logit_adjust``), and the
completions' ``echo`` (the prompt's text before the completion's, with its tokens' logprobs
where ``logprobs`` is given).
Ignored, as OpenAI documents them as optional hints or bookkeeping: ``user``, ``metadata``,
``store``, ``service_tier``, ``parallel_tool_calls`` (each of its type, else refused by
name). Accepted only at their neutral value: chat's ``echo`` false, ``best_of`` 1, ``tools``
empty. A message's fields besides ``role`` and ``content`` are accepted only null
(``tool_calls`` and ``annotations`` also empty), as an echoed assistant message carries them:
a ``name``, say, is refused. Anything else is refused by name, so a client never silently gets
a different behaviour from the one it asked for."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from edgespec.config import VERIFY_MODES, ConfigError, SamplingParams, logit_bias_pairs
from edgespec.models.chat_prompt import CHAT_ROLES
from edgespec.protocol.token_logprob import MAX_TOP_LOGPROBS
from edgespec.wire.convert import unencodable_text

from .admission import GenerationRequest
from .api_errors import ApiError, error_response
from .image_parts import parts_content

__all__ = ["ApiError", "OpenAIParams", "error_response", "parse_request"]

IGNORED = {"model", "user", "metadata", "store", "service_tier", "parallel_tool_calls",
           "stream", "stream_options"}
# the ignored hints' types (OpenAI's): a value of another type is refused by name, as OpenAI's
# API refuses it, not ignored
IGNORED_TYPES: dict[str, tuple[type, str]] = {
    "user": (str, "a string"), "metadata": (dict, "an object"), "store": (bool, "a boolean"),
    "service_tier": (str, "a string"), "parallel_tool_calls": (bool, "a boolean")}
NEUTRAL: dict[str, tuple] = {
    "echo": (False, None), "best_of": (1, None), "suffix": (None, ""),
    "response_format": (None, {"type": "text"}),
    "tools": (None, []), "tool_choice": (None, "none")}
# the legacy completions have no ``top_logprobs`` (their ``logprobs`` is the count), and take
# ``echo``
COMPLETIONS_NEUTRAL = {**{k: v for k, v in NEUTRAL.items() if k != "echo"},
                       "top_logprobs": (None, 0)}
# what a chat message may carry besides its role and content: any field null (a client echoing
# an assistant message back sends its unused ones so: refusal, audio, parsed, ...), and these
# empty too; a name, tool calls or a tool call's id would change the prompt the chat template
# makes, and are refused by name
MESSAGE_EMPTY: dict[str, tuple] = {"tool_calls": ([],), "annotations": ([],)}
SAMPLING = {"max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed",
            "stop", "n", "verify", "logprobs", "presence_penalty", "frequency_penalty",
            "logit_bias"}
MAX_STOP = 4
MAX_WIRE_INT = (1 << 31) - 1  # the gRPC request's int32 (a token count: max_new_tokens)
MAX_N = 16  # choices a request may ask for: each is a session, with a KV slot of its own
MAX_PROMPTS = 64  # prompts a completions request may batch (each a session a choice)


def _bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", param)


@dataclass
class OpenAIParams:
    generation: GenerationRequest
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    n: int = 1  # choices: a session each
    echo: bool = False  # completions: the prompt's text (and logprobs) before the completion's
    # completions: the prompts of a batch after the first (``generation``'s), each with its
    # ``n`` choices, in order
    batch: list[GenerationRequest] = field(default_factory=list)

    @property
    def generations(self) -> list[GenerationRequest]:
        return [self.generation, *self.batch]


def _number(body: dict, name: str, default, kind=float, low=None, high=None,
            low_open: bool = False):
    """``body[name]`` as ``kind``, or ``default`` when absent or null; refused (400, the
    parameter named) unless a finite number within [low, high] ((low, high] with
    ``low_open``)."""
    value = body.get(name, default)
    if value is None:
        return default
    what = f"'{name}' must be a finite {'integer' if kind is int else 'number'}"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _bad(what, name)
    if isinstance(value, int) and abs(value) > 1 << 64:
        raise _bad(f"'{name}' is out of range", name)  # before float() overflows on it
    if not math.isfinite(value) or (kind is int and not float(value).is_integer()):
        raise _bad(what, name)
    below = low is not None and (value <= low if low_open else value < low)
    if below or (high is not None and value > high):
        bounds = f"<= {high}" if low is None else \
            f"in {'(' if low_open else '['}{low}, {high}]" if high is not None else \
            f"{'>' if low_open else '>='} {low}"
        raise _bad(f"'{name}' must be {bounds}, got {value}", name)
    return kind(value)


def _text(value: str, what: str, param: str) -> str:
    """``value`` once a tokenizer can encode it (``unencodable_text``: JSON may hold a lone
    surrogate); refused with the SDK's words, the field named."""
    why = unencodable_text(value, what)
    if why is not None:
        raise _bad(why, param)
    return value


def _message(i: int, m, images: list[bytes]) -> dict:
    """One chat message as {"role", "content"}: one of OpenAI's roles, text content (content
    parts: text, and images as <image> marks, their bytes appended to ``images``)."""
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise _bad("each message needs a 'role' and a 'content'", "messages")
    if m["role"] not in CHAT_ROLES:
        raise ApiError(400, f"messages[{i}] has the unknown role '{m['role'][:40]}': the roles "
                            f"are {', '.join(CHAT_ROLES)}", "invalid_request_error",
                       f"messages.[{i}].role", "invalid_value")
    for key, value in m.items():
        if key in ("role", "content"):
            continue
        if value is not None and not _is_neutral(value, MESSAGE_EMPTY.get(key, ())):
            raise _bad(f"messages[{i}].{key[:40]} is not supported by edgespec", f"messages.[{i}]")
    content = m.get("content")
    if isinstance(content, list):  # content parts: text and image_url
        content = parts_content(i, content, images)
    if not isinstance(content, str):
        raise _bad("each message needs a 'role' and a 'content'", "messages")
    _text(content, f"messages[{i}].content", f"messages.[{i}].content")
    # OpenAI's developer messages are its newer models' system messages: a chat template knows
    # "system" (SmolLM2's, given no system message, adds its own default one)
    role = "system" if m["role"] == "developer" else m["role"]
    return {"role": role, "content": content}


def _prompt(body: dict, chat: bool, g: GenerationRequest) -> list:
    """The prompt into ``g`` (a completions batch's first); returns a batch's other prompts,
    unread. "" and [] are prompts: one of zero tokens is refused at admission, with every other
    surface's message."""
    if chat:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise _bad("'messages' must be a non-empty list", "messages")
        g.messages = [_message(i, m, g.images) for i, m in enumerate(msgs)]
        return []
    prompts = _prompts(body.get("prompt"))
    _one_prompt(prompts[0], g, "prompt" if len(prompts) == 1 else "prompt[0]")
    return prompts[1:]


def _prompts(prompt) -> list:
    """The completions' ``prompt``: one (a string, a list of token ids) or a batch of them (a
    list of strings, a list of token id lists: each a session, its choices after the one
    before's), refused (400 naming ``prompt``) otherwise."""
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) > MAX_PROMPTS:
            raise _bad(f"'prompt' may batch at most {MAX_PROMPTS} prompts, got {len(prompt)}",
                       "prompt")
        if len({type(p) for p in prompt}) > 1:  # OpenAI's: texts, or token id lists
            raise _bad("'prompt' batches texts or token id lists, not both", "prompt")
        return prompt
    return [prompt]


def _one_prompt(prompt, g: GenerationRequest, where: str = "prompt") -> None:
    """``prompt`` into ``g``; ``where``: how a refusal names it (a batch's says which)."""
    if isinstance(prompt, str):
        try:
            g.prompt, g.raw = _text(prompt, "the prompt", "prompt"), True
        except ApiError as e:
            if where == "prompt":
                raise
            raise _bad(f"{where}: {e}", "prompt") from None
    elif isinstance(prompt, list) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        g.prompt_ids = list(prompt)
    else:
        raise _bad(f"'{where}' must be a string, a list of token ids, or a list of either (a "
                   "batch)", "prompt")


def parse_request(body, chat: bool, model_name: str) -> OpenAIParams:
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str):
        raise _bad("'model' is required" if model is None else "'model' must be a string",
                   "model")
    if model != model_name:
        raise ApiError(404, f"the model '{model[:80]}' does not exist; this server serves "
                            f"'{model_name}'", "invalid_request_error", "model",
                       "model_not_found")
    known = IGNORED | SAMPLING | set(NEUTRAL) | {"messages", "top_logprobs"} if chat else \
        IGNORED | SAMPLING | set(COMPLETIONS_NEUTRAL) | {"prompt", "echo"}
    for name in body:
        if name not in known:
            raise _bad(f"'{name[:80]}' is not supported by edgespec", name[:80])
    for name, (kind, what) in IGNORED_TYPES.items():
        if body.get(name) is not None and not isinstance(body[name], kind):
            raise _bad(f"'{name}' must be {what}", name)
    for name, neutral in (NEUTRAL if chat else COMPLETIONS_NEUTRAL).items():
        if name in body and not _is_neutral(body[name], neutral):
            raise _bad(f"'{name}' is not supported by edgespec (only its default)", name)
    g = GenerationRequest()
    rest = _prompt(body, chat, g)  # a completions batch's prompts after the first
    # each checked, if given; >= 1, or 0 with echo (below)
    newer = _number(body, "max_completion_tokens", None, int, high=MAX_WIRE_INT)
    older = _number(body, "max_tokens", None, int, high=MAX_WIRE_INT)
    limit = newer if newer is not None else older  # the newer name wins where both are given
    g.max_new_tokens = 0 if limit is None else limit
    n = _number(body, "n", 1, int, 1, MAX_N)
    seed = body.get("seed")
    if seed is not None:  # the wire carries seeds as int64
        seed = _number(body, "seed", None, int, -(1 << 63), (1 << 63) - 1)
    try:
        g.params = SamplingParams(_number(body, "temperature", 1.0, float, 0, 2),
                                  _number(body, "top_k", 0, int, 0, (1 << 31) - 1),
                                  _number(body, "top_p", 1.0, float, 0, 1, low_open=True), seed,
                                  _number(body, "presence_penalty", 0.0, float, -2, 2),
                                  _number(body, "frequency_penalty", 0.0, float, -2, 2),
                                  _logit_bias(body.get("logit_bias")))
    except ConfigError as e:
        raise _bad(str(e)) from None
    verify = body.get("verify")
    if verify is not None and verify not in VERIFY_MODES:
        raise _bad("'verify' must be \"exact\", \"loose\" or \"pad\"", "verify")
    g.verify = verify or ""
    g.logprobs = _logprobs(body, chat)
    echo = False if chat else body.get("echo")  # chat's: refused above unless false or null
    if echo is not None and not isinstance(echo, bool):
        raise _bad("'echo' must be a boolean", "echo")
    if echo and g.logprobs is not None:  # the prompt's logprobs too, read as it is prefilled
        g.prompt_logprobs = g.logprobs
    for name, given in (("max_completion_tokens", newer), ("max_tokens", older)):
        if given is not None and (given < 0 or (given == 0 and not echo)):
            with_echo = "" if chat else " (0 only with echo: the prompt alone)"
            raise _bad(f"'{name}' must be >= 1{with_echo}, got {body[name]}", name)
    if limit == 0:  # the limit in force: the newer name's where both are given
        g.prompt_only = True  # the prompt scored (with logprobs) and echoed, no completion
    stop = body.get("stop")
    stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or len(stops) > MAX_STOP or \
            not all(isinstance(s, str) and s for s in stops):
        raise _bad(f"'stop' must be a non-empty string or a list of up to {MAX_STOP}", "stop")
    for text in stops:
        _text(text, "a stop string", "stop")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise _bad("'stream' must be a boolean", "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise _bad("'stream_options' must be an object", "stream_options")
    if options and not stream:  # as OpenAI's API answers it
        raise _bad("'stream_options' is only allowed when 'stream' is true", "stream_options")
    for key, value in (options or {}).items():  # OpenAI's other option, at its neutral value
        if key != "include_usage" and not (key == "include_obfuscation" and not value):
            raise _bad(f"'stream_options.{str(key)[:40]}' is not supported",
                       f"stream_options.{str(key)[:40]}")
    usage = (options or {}).get("include_usage")
    if usage is not None and not isinstance(usage, bool):
        raise _bad("'stream_options.include_usage' must be a boolean",
                   "stream_options.include_usage")
    batch = []
    for k, prompt in enumerate(rest, 1):  # each with the request's settings, in its order
        other = replace(g, prompt=None, prompt_ids=None, images=[])
        _one_prompt(prompt, other, f"prompt[{k}]")
        batch.append(other)
    return OpenAIParams(g, stops, bool(stream), bool(usage), n, bool(echo), batch)


def _logit_bias(bias) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``logit_bias``: an object mapping token ids, written as decimal strings, to
    numbers (null or {}: none), their ranges, count and repeats checked by
    ``SamplingParams``' own rule (``logit_bias_pairs``); refused (400, naming ``logit_bias``)
    otherwise. An id past the model's vocabulary is refused when the request is admitted."""
    if bias is None:
        return ()
    if not isinstance(bias, dict):
        raise _bad("'logit_bias' must be an object mapping token ids to biases", "logit_bias")
    pairs: list[tuple[int, float]] = []
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit() and len(key) <= 10):
            raise _bad(f"'logit_bias' keys must be token ids (decimal strings), got "
                       f"'{key[:20]}'", "logit_bias")
        if value is None:
            raise _bad(f"'logit_bias' biases must be numbers, token {key}'s is null",
                       "logit_bias")
        pairs.append((int(key), _number({"logit_bias": value}, "logit_bias", None, float)))
    try:
        return logit_bias_pairs(pairs)  # "5" and "05" are one token given twice
    except ConfigError as e:
        raise _bad(str(e), "logit_bias") from None


def _logprobs(body: dict, chat: bool) -> int | None:
    """How many alternatives each token's logprob comes with, or None for no logprobs: chat's
    ``logprobs`` (a boolean) and ``top_logprobs`` (0-20, only with ``logprobs`` true, as
    OpenAI's API answers it); the legacy completions' ``logprobs`` (0-20: 0 is the token's own
    logprob alone; false as null)."""
    if not chat:
        if body.get("logprobs") is False:
            return None
        return _number(body, "logprobs", None, int, 0, MAX_TOP_LOGPROBS)
    wanted = body.get("logprobs")
    if wanted is not None and not isinstance(wanted, bool) and not _is_neutral(wanted, (0,)):
        raise _bad("'logprobs' must be a boolean", "logprobs")
    top = _number(body, "top_logprobs", None, int, 0, MAX_TOP_LOGPROBS)
    if top is not None and not wanted:
        raise _bad("'top_logprobs' requires 'logprobs' to be true", "top_logprobs")
    return (top or 0) if wanted else None


def _is_neutral(value, neutral: tuple) -> bool:
    """``value`` one of a parameter's neutral values, of the same JSON kind (numbers equal by
    value, 1 and 1.0 alike; ``false`` is not 0 here, nor ``true`` 1; an empty object or list
    only where it is one of them)."""
    return any(_json_kind(value) == _json_kind(n) and value == n for n in neutral)


def _json_kind(value) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    return type(value).__name__
