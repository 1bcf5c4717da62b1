"""Vision-language targets: a SmolVLM / Idefics3 model served as the Llama it speaks through.

Such a model is a vision encoder and a connector in front of a Llama text model. The runner
serves the text model as it serves any Llama (``TextView`` shows it the Llama's modules, the same
tensors as the VLM's); the vision encoder and connector run once per session, through the VLM's
own transformers modules, when the session is prefilled:

1. ``VisionModel.encode`` renders the request through the processor's chat template, with one
   ``<image>`` mark per image (marks the caller wrote where they stand, else every image before
   the text of the last user message), and tokenizes it with the processor, which expands each
   mark into the image's token run (``<fake_token_around_image>``, ``<global-img>``,
   ``image_seq_len`` image tokens per crop). The token ids are the session's prompt: what the
   drafters see, image tokens included as ordinary ids.
2. ``VisionModel.prompt_embeds`` runs the encoder over the images and puts its features at the
   image tokens' positions of the prompt's embeddings (every other position keeps its token's
   embedding row, bit for bit), and the runner prefills those embeddings into the session's KV
   (``TargetRunner.prefill(..., embeds=)``). From then on every position is a text token: drafts
   are verified, and the target decodes, exactly as for a text-only prompt.

A request with images for a text-only target, images whose count differs from the prompt's
marks, or a prompt holding image tokens without their images, is refused (``ConfigError``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ..config import ConfigError
from .chat_prompt import chat_roles, special_text_in, special_texts
from .images import ImageRefused

VISION_TYPES = ("idefics3", "smolvlm")  # transformers model types served this way


def is_vision_model(directory: Path) -> bool:
    """Whether a transformers directory holds a vision-language model served here."""
    try:
        cfg = json.loads((Path(directory) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return cfg.get("model_type") in VISION_TYPES


@dataclass
class ImageInput:
    """A request's images as the vision encoder takes them (the processor's output)."""

    pixel_values: torch.Tensor  # [1, crops, 3, h, w] float32 (every image's crops, in order)
    pixel_attention_mask: torch.Tensor | None  # [1, crops, h, w] (which pixels are not padding)
    count: int  # images given
    tokens: int  # the image tokens they fill in the prompt

    def spent(self) -> "ImageInput":
        """The same images once prefilled: their counts without the pixels (a SmolVLM image in
        17 crops is 53 MB of float32, which a running session need not hold)."""
        return ImageInput(torch.empty(0), None, self.count, self.tokens)


class TextView(torch.nn.Module):
    """The VLM's text model as a causal LM: ``model`` (its Llama), ``lm_head``, ``config`` (the
    text config) and ``generation_config``, the VLM's own modules (no copy)."""

    def __init__(self, vlm: Any):
        super().__init__()
        self.model = vlm.model.text_model
        self.lm_head = vlm.lm_head
        self.config = vlm.config.text_config
        self.generation_config = vlm.generation_config


class VisionModel:
    """A loaded VLM: its processor, its text model for the runner (``text``), and the vision
    encoder that turns a session's images into prompt embeddings."""

    def __init__(self, vlm: Any, processor: Any):
        self.vlm, self.processor = vlm, processor
        self.text = TextView(vlm)
        self.tokenizer = processor.tokenizer
        self.image_token_id = int(vlm.config.image_token_id)
        self.mark: str = getattr(processor, "image_token", "<image>")

    # -- prompts ---------------------------------------------------------------------------------
    def encode(self, prompt: str | None = None, messages: list[dict] | None = None,
               raw: bool = False, images: Sequence[Any] = ()
               ) -> tuple[list[int], ImageInput | None]:
        """A request's token ids (image marks expanded) and its images for the encoder (None
        without images). ``prompt``: one user message through the chat template, or as is
        with ``raw``; ``messages``: a conversation, contents as text with ``<image>`` marks."""
        if (prompt is None) == (messages is None):
            raise ConfigError("give a prompt or messages")
        if messages is not None:
            messages = chat_roles(messages)
        images = list(images)
        texts = [prompt or ""] if messages is None else [str(m["content"]) for m in messages]
        marks = sum(t.count(self.mark) for t in texts)
        if images and marks == 0:  # the images go before the text of the last user message
            lead = self.mark * len(images)
            if messages is None:
                prompt = lead + (prompt or "")
            else:
                last = max((i for i, m in enumerate(messages) if m["role"] == "user"),
                           default=len(messages) - 1)
                messages = [dict(m, content=lead + m["content"]) if i == last else m
                            for i, m in enumerate(messages)]
        elif marks != len(images):
            raise ImageRefused(f"the prompt holds {marks} {self.mark} mark(s) but "
                               f"{len(images)} image(s) were given: one mark per image")
        if messages is None and raw:
            text, specials = prompt or "", True
        else:
            msgs = messages if messages is not None else [{"role": "user", "content": prompt}]
            self._check_text_only(msgs)
            text = self._chat_text(msgs)
            bos = getattr(self.tokenizer, "bos_token", None)
            specials = not (bos and text.startswith(bos))  # as the processor's template does
        try:
            out = self.processor(text=[text], images=[images] if images else None,
                                 return_tensors="pt", add_special_tokens=specials)
        except (ValueError, OSError) as e:
            raise ImageRefused(f"the images cannot be prepared: {str(e)[:200]}") from None
        ids = [int(t) for t in out["input_ids"][0]]
        if not images:
            return ids, None
        return ids, ImageInput(out["pixel_values"], out.get("pixel_attention_mask"),
                               len(images), ids.count(self.image_token_id))

    def _check_text_only(self, messages: list[dict]) -> None:
        """Refuse a message holding a special token's text other than the image mark: the
        processor reads the whole rendered conversation in one call, so such text would become
        the token (a turn's end, an image's frame), which a text model's messages keep as text
        (``chat_prompt``); here it cannot be kept text."""
        specials = [s for s in special_texts(self.tokenizer) if s != self.mark]
        for i, m in enumerate(messages):
            token = special_text_in(str(m["content"]).replace(self.mark, ""), specials)
            if token is not None:
                raise ConfigError(f"messages[{i}] holds {token!r}, a special token of this "
                                  f"model, which a vision model's message cannot carry as "
                                  f"text: leave it out ({self.mark} marks an image)")

    def _chat_text(self, messages: list[dict]) -> str:
        """The conversation through the processor's chat template (contents as parts: text and
        image), else the tokenizer's (contents as text, marks inline)."""
        if getattr(self.processor, "chat_template", None):
            parts = [{"role": m["role"], "content": self._parts(str(m["content"]))}
                     for m in messages]
            return self.processor.apply_chat_template(parts, add_generation_prompt=True,
                                                      tokenize=False)
        if getattr(self.tokenizer, "chat_template", None):
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                      tokenize=False)
        raise ConfigError("this model has no chat template: send the prompt raw")

    def _parts(self, content: str) -> list[dict]:
        """Text with image marks as content parts: [{"type": "text"}, {"type": "image"}...]."""
        parts: list[dict] = []
        for i, piece in enumerate(content.split(self.mark)):
            if i:
                parts.append({"type": "image"})
            if piece:
                parts.append({"type": "text", "text": piece})
        return parts

    def check_prompt(self, ids: list[int], images: ImageInput | None) -> None:
        """Refuse a prompt whose image tokens and images do not match (ids given directly, a
        session resumed without its images), or that ends on an image token (its last token
        enters the first step as a text token)."""
        n = ids.count(self.image_token_id)
        if images is None:
            if n:
                raise ConfigError(f"the prompt holds {n} image tokens but no image: a session "
                                  "with images is sent with them (the draft cache keeps no "
                                  "images, so it cannot be resumed by another verifier)")
            return
        if n != images.tokens or n == 0:
            raise ConfigError(f"the prompt holds {n} image tokens, its images fill "
                              f"{images.tokens}: give images with a text prompt or messages")
        if ids[-1] == self.image_token_id:
            raise ConfigError("the prompt cannot end on an image token")

    # -- the encoder -----------------------------------------------------------------------------
    @torch.inference_mode()
    def prompt_embeds(self, ids: list[int], images: ImageInput, embed: torch.Tensor
                      ) -> torch.Tensor:
        """The embeddings of ``ids`` [n, H] in ``embed``'s dtype and device: each token's row of
        ``embed`` [V, H], the image features at the image tokens."""
        dev = embed.device
        ids_t = torch.as_tensor(ids, dtype=torch.long, device=dev)
        x = F.embedding(ids_t, embed)  # [n, H]
        where = ids_t == self.image_token_id  # [n]
        mask = images.pixel_attention_mask
        out = self.vlm.get_image_features(
            pixel_values=images.pixel_values.to(dev),
            pixel_attention_mask=None if mask is None else mask.to(dev))
        pooled = out.pooler_output
        feats = torch.cat(list(pooled), 0) if isinstance(pooled, (list, tuple)) else \
            pooled.reshape(-1, pooled.shape[-1])  # [image tokens, H]
        if feats.shape[0] != int(where.sum()):
            raise ConfigError(f"the images give {feats.shape[0]} features for "
                              f"{int(where.sum())} image tokens")
        x[where] = feats.to(x.dtype)
        return x


def load_vision_model(directory: Path, device: str, dtype: torch.dtype) -> VisionModel:
    """A VLM and its processor from a transformers directory, on ``device`` in ``dtype``."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    vlm: Any = AutoModelForImageTextToText.from_pretrained(directory, dtype=dtype)
    vlm.to(device).eval()
    return VisionModel(vlm, AutoProcessor.from_pretrained(directory))
