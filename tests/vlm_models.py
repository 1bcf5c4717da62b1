"""A tiny random-weight SmolVLM-family (Idefics3) model on disk, built from a config in a second:
a two-layer vision encoder over 32x32 images in 8x8 patches (4 image tokens an image after the
connector's pixel shuffle), a tiny Llama text model with peaked distributions, the tests'
character tokenizer plus the image tokens, and a processor whose chat template takes content
parts (text and image), as SmolVLM's does. No VLM weights can be downloaded here; the real
model's path through edgespec is the same code."""

from __future__ import annotations

import io

import numpy as np
import torch

from conftest import make_tokenizer

IMAGE_TOKENS = ["<image>", "<fake_token_around_image>", "<global-img>"]
# the conversation with content parts, each image part as the processor's <image> mark
VLM_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for p in m['content'] %}{% if p['type'] == 'image' %}<image>"
    "{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def make_tiny_vlm(path, seed: int = 0, layers: int = 3, hidden: int = 64,
                  init_range: float = 0.3):
    """Save a tiny Idefics3 VLM and its processor in ``path``; returns ``path``."""
    from transformers import (Idefics3Config, Idefics3ForConditionalGeneration,
                              Idefics3ImageProcessorPil, Idefics3Processor)

    tok = make_tokenizer()
    tok.add_tokens(IMAGE_TOKENS, special_tokens=True)
    text = dict(model_type="llama", vocab_size=len(tok), hidden_size=hidden,
                intermediate_size=2 * hidden, num_hidden_layers=layers, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=1024,
                initializer_range=init_range, tie_word_embeddings=False, bos_token_id=1,
                eos_token_id=2, pad_token_id=2)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, image_size=32, patch_size=8)
    cfg = Idefics3Config(vision_config=vision, text_config=text, scale_factor=2,
                         image_token_id=tok.convert_tokens_to_ids("<image>"),
                         tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # a connector that makes the image matter to the text model
        model.model.connector.modality_projection.proj.weight.normal_(0, init_range)
    model.generation_config.eos_token_id = 2
    model.generation_config.pad_token_id = 2
    images = Idefics3ImageProcessorPil(do_image_splitting=False, size={"longest_edge": 32},
                                       max_image_size={"longest_edge": 32})
    processor = Idefics3Processor(image_processor=images, tokenizer=tok,
                                  image_seq_len=model.model.image_seq_len,
                                  chat_template=VLM_CHAT_TEMPLATE)
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return path


def png(seed: int, size: tuple[int, int] = (40, 30), fmt: str = "PNG") -> bytes:
    """A random RGB image (width, height) encoded as ``fmt``."""
    from PIL import Image

    pixels = (np.random.RandomState(seed).rand(size[1], size[0], 3) * 255).astype("uint8")
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format=fmt)
    return buf.getvalue()


def vlm_greedy(vision, ids: list[int], pictures, n: int) -> list[int]:
    """The VLM's own greedy output (transformers' generate over ids and pixels): the
    reference of a lossless image session."""
    vlm = vision.vlm
    kwargs = {}
    if pictures is not None:
        kwargs["pixel_values"] = pictures.pixel_values
        if pictures.pixel_attention_mask is not None:
            kwargs["pixel_attention_mask"] = pictures.pixel_attention_mask
    with torch.no_grad():
        out = vlm.generate(input_ids=torch.tensor([ids]),
                           attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                           max_new_tokens=n, do_sample=False, eos_token_id=[2],
                           pad_token_id=2, **kwargs)
    return out[0, len(ids):].tolist()


def vlm_keyed(vision, ids: list[int], pictures, n: int, params) -> list[int]:
    """The VLM's own forward with edgespec's keyed sampler, target-only: the reference of a
    seeded sampled image session. The prompt's embeddings are transformers' own (its
    ``inputs_merger`` puts the image features at the prompt's image tokens); each token sampled
    after it enters as its embedding row, an image token included, as in ``generate``."""
    from reference import sample_at

    vlm = vision.vlm
    with torch.no_grad():
        ids_t = torch.tensor([ids])
        embeds = vlm.get_input_embeddings()(ids_t)
        feats = vlm.get_image_features(pixel_values=pictures.pixel_values,
                                       pixel_attention_mask=pictures.pixel_attention_mask)
        embeds = vlm.model.inputs_merger(ids_t, embeds, torch.cat(list(feats.pooler_output)))
        out: list[int] = []
        for _ in range(n):
            logits = vlm(inputs_embeds=embeds).logits[0, -1]
            out.append(sample_at(logits, params, len(ids) + len(out)))
            row = vlm.get_input_embeddings()(torch.tensor([[out[-1]]]))
            embeds = torch.cat([embeds, row], 1)
    return out
