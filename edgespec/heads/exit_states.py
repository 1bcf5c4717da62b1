"""The layer-L hidden states an imitation network learns from, beside a distillation dataset.

The harvest (``heads.harvest``) keeps the final norm's output of every response position; an
imitation network reads the hidden state after layer L instead. Those states are recomputed
here by one teacher-forced pass per response (its prompt and the response tokens, through the
target's first L layers only, in chunks), so any finished dataset can feed networks at any exit
layer without harvesting again. They go into ``DATA/exit-L/`` as one file per dataset shard
(``states-NNNNN.safetensors``: ``states`` [N, H] bfloat16, the shard's rows in order), so a
stopped pass resumes at its first missing shard.

Row i of a sequence (``heads.dataset``) is the target at position i of the response's context
(row 0: the prompt's last token); its state here is layer L's output at that position.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..config import ConfigError
from .dataset import DatasetInfo, finished_shards, shard_path

CHUNK = 512  # tokens a forward


def states_dir(data: Path, layer: int) -> Path:
    return data / f"exit-{layer}"


def states_path(folder: Path, n: int) -> Path:
    return folder / f"states-{n:05d}.safetensors"


@torch.inference_mode()
def sequence_states(runner, slot: int, prompt: Sequence[int], response: Sequence[int],
                    layer: int) -> torch.Tensor:
    """Layer ``layer``'s states [n, H] at a response's n positions (the prompt's last token,
    then its first n - 1 tokens), teacher-forced in ``slot`` (left dirty)."""
    ids = list(prompt) + list(response[:-1])
    out = []
    for at in range(0, len(ids), CHUNK):
        part = torch.as_tensor([ids[at:at + CHUNK]], dtype=torch.long, device=runner.device)
        out.append(runner.early_hidden([slot], part, [at], layer)[0])
    states = torch.cat(out)  # [P + n - 1, H]
    return states[len(prompt) - 1:]


def make_exit_states(runner, data: Path, prompts: list[list[int]], layer: int,
                     deadline: float | None = None, say: Callable[[str], None] = print) -> bool:
    """Compute the missing state shards of ``data`` at ``layer`` (``prompts``: each dataset
    sequence's prompt ids, in the work list's order); False when the deadline (a
    ``time.monotonic`` value) stopped it first."""
    info = DatasetInfo.load(data)
    if len(prompts) != info.items:
        raise ConfigError(f"{data} holds {info.items} responses, the work list {len(prompts)}: "
                          "give the options that made the dataset")
    shards = finished_shards(data, info)  # --no-harvest: the finished ones
    if shards == 0:
        raise ConfigError(f"the dataset in {data} has no finished shard yet")
    folder = states_dir(data, layer)
    folder.mkdir(parents=True, exist_ok=True)
    meta = {"exit_layer": layer, "target": info.target, "dataset": info.command}
    meta_path = folder / "states.json"
    if meta_path.exists() and json.loads(meta_path.read_text()) != meta:
        raise ConfigError(f"{folder} holds states of another dataset or target: delete it")
    meta_path.write_text(json.dumps(meta, indent=1) + "\n")
    slot = runner.new_slot()
    t0, done = time.monotonic(), 0
    try:
        for n in range(shards):
            if states_path(folder, n).exists():
                continue
            if deadline is not None and time.monotonic() >= deadline:
                return False
            t = load_file(str(shard_path(data, n)))
            starts, tokens = t["starts"], t["next_tokens"]
            parts = []
            for s in range(len(starts) - 1):
                response = tokens[int(starts[s]):int(starts[s + 1])].tolist()
                item = n * info.per_shard + s
                parts.append(sequence_states(runner, slot, prompts[item], response, layer)
                             .to(torch.bfloat16).cpu())
                done += len(prompts[item]) + len(response) - 1
            tmp = folder / f".states-{n:05d}.tmp"
            save_file({"states": torch.cat(parts).contiguous()}, str(tmp))
            tmp.replace(states_path(folder, n))
            if (n + 1) % 10 == 0 or n + 1 == shards:
                say(f"exit states (layer {layer}): shard {n + 1}/{shards}, "
                    f"{done / max(1e-9, time.monotonic() - t0):.0f} tok/s")
    finally:
        runner.free_slot(slot)
    return True


def load_exit_states(data: Path, layer: int) -> torch.Tensor:
    """The finished shards' states at ``layer``, concatenated [N, H] (the rows
    ``dataset.load_sequences`` gives)."""
    info = DatasetInfo.load(data)
    folder = states_dir(data, layer)
    parts = []
    for n in range(finished_shards(data, info)):
        path = states_path(folder, n)
        if not path.exists():
            raise ConfigError(f"{folder} lacks {path.name}: compute the layer-{layer} states "
                              "first (edgespec distill --kinds imitation does)")
        parts.append(load_file(str(path))["states"])
    return torch.cat(parts)
