"""One-process speculative generation: model + runner + drafter + engine, from names.

Used by ``edgespec generate`` and ``edgespec bench``; the distributed verifier builds the same
parts around its own session store.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from collections.abc import Sequence
from typing import Any, Callable

from ..config import ConfigError, EngineConfig, SamplingParams
from ..drafters import build_drafter, parse_drafter_spec
from .spec_engine import Request, SpecEngine
from ..protocol.request_stats import Stats
from ..protocol.token_logprob import TokenLogprob
from ..models.images import decode_images, image_bytes
from ..models.loading import LoadedModel, encode_prompt, load_model, stop_token_ids
from ..models.vision import ImageInput
from ..runner.target_runner import TargetRunner
from ..models.text_stream import TextStream


@dataclass
class Generation:
    token_ids: list[int]
    text: str
    stats: Stats
    finish_reason: str
    prompt_tokens: int
    dtype: str = "float32"  # the target's dtype that served it
    logprobs: list[TokenLogprob] | None = None  # asked for (``generate(logprobs=k)``), else None
    # asked for (``generate(prompt_logprobs=k)``): each prompt token's after the first
    prompt_logprobs: list[TokenLogprob] | None = None

    def to_dict(self) -> dict:
        out = {"token_ids": self.token_ids, "text": self.text,
               "finish_reason": self.finish_reason, "prompt_tokens": self.prompt_tokens,
               "dtype": self.dtype, "stats": self.stats.to_dict()}
        for key, entries in (("logprobs", self.logprobs), ("prompt_logprobs",
                                                            self.prompt_logprobs)):
            if entries is not None:
                out[key] = [{"token_id": e.token, "logprob": e.logprob,
                             "top": [[t, lp] for t, lp in e.top]} for e in entries]
        return out


class LocalGenerator:
    def __init__(self, model: str | LoadedModel = "default", drafter: str = "mag",
                 device: str = "cpu", dtype: str = "auto",
                 config: EngineConfig | None = None):
        self.cfg = config or EngineConfig()
        self.target = model if isinstance(model, LoadedModel) else load_model(model, device, dtype)
        self.runner = TargetRunner(self.target.model, n_slots=self.cfg.max_sessions,
                                   max_len=self.cfg.max_context, graphs=self.cfg.cuda_graphs)
        self.stop_ids = stop_token_ids(self.target)
        self.engines: dict[str, SpecEngine] = {}
        self.default_drafter = drafter
        self.device, self.dtype = device, self.target.dtype

    def engine(self, drafter: str | None = None) -> SpecEngine:
        spec = drafter or self.default_drafter
        if spec not in self.engines:
            d = build_drafter(spec, self.target, self.runner, n_slots=self.cfg.max_sessions,
                              max_len=self.cfg.max_context, device=self.device, dtype=self.dtype)
            cfg = self.cfg
            parsed = parse_drafter_spec(spec)
            if parsed.head:  # head:DIR, or SPEC+head:DIR: a head drafting in the verifier
                cfg = replace(cfg, head=parsed.head)
            if parsed.kind == "auto":  # mag+cacheback, the shipped head if it fits, chosen
                cfg = replace(cfg, auto=True, head=cfg.head or shipped_head_for(self.target))
            self.engines[spec] = SpecEngine(self.runner, d, cfg, self.stop_ids,
                                            vision=self.target.vision)
        return self.engines[spec]

    def encode(self, prompt: str, raw: bool = False) -> list[int]:
        return self.encode_with_images(prompt, raw)[0]

    def encode_with_images(self, prompt: str, raw: bool = False, images: Sequence[Any] = ()
                           ) -> tuple[list[int], ImageInput | None]:
        """A prompt's token ids, and its images for a vision-language target (``images``:
        paths, bytes or PIL images; refused by a text-only target)."""
        vision = self.target.vision
        if vision is None:
            if images:
                raise ConfigError(f"the model {self.target.name} is text-only: it takes no "
                                  "images")
            return encode_prompt(self.target.tokenizer, prompt, raw=raw), None
        return vision.encode(prompt, raw=raw,
                             images=decode_images([image_bytes(i) for i in images]))

    def generate(self, prompt: str | list[int], max_new_tokens: int = 128,
                 params: SamplingParams | None = None, drafter: str | None = None,
                 raw: bool = False, stream: Callable[[str], None] | None = None,
                 images: Sequence[Any] = (), logprobs: int | None = None,
                 prompt_logprobs: int | None = None) -> Generation:
        """``images`` (a text prompt only): see ``encode``. ``logprobs``: each token's logprob
        with this many alternatives (``Request.logprobs``); ``prompt_logprobs``: the prompt's
        (``Request.prompt_logprobs``)."""
        pictures: ImageInput | None = None
        if isinstance(prompt, list):
            if images:
                raise ConfigError("images need a text prompt (the processor places their "
                                  "tokens), not token ids")
            ids = prompt
        else:
            ids, pictures = self.encode_with_images(prompt, raw, images)
        on_tokens = TextStream(self.target.tokenizer, stream) if stream else None
        req = Request(ids, max_new_tokens, params or SamplingParams(), on_tokens,
                      images=pictures, logprobs=logprobs, prompt_logprobs=prompt_logprobs)
        res = self.engine(drafter).generate(req)
        if on_tokens is not None:  # an output that ends mid-character: its last bytes
            on_tokens.flush()
        text = self.target.tokenizer.decode(res.token_ids, skip_special_tokens=True,
                                            clean_up_tokenization_spaces=False)  # as streamed
        return Generation(res.token_ids, text, res.stats, res.finish_reason, len(ids), self.dtype,
                          res.logprobs, res.prompt_logprobs)

    def close(self) -> None:
        for e in self.engines.values():
            e.close()


def shipped_head_for(target: LoadedModel) -> str:
    """'default' when this install ships a head for the target's model, else ''."""
    from ..heads.manifest import resolve_head_dir

    try:
        resolve_head_dir("default", target.name)
    except ConfigError:
        return ""
    return "default"


def print_stream(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()
