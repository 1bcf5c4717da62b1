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
                    layers: list[int]) -> list[torch.Tensor]:
    """Each of ``layers``' states [n, H] at a response's n positions (the prompt's last token,
    then its first n - 1 tokens), teacher-forced in ``slot`` (left dirty): one pass."""
    ids = list(prompt) + list(response[:-1])
    out: list[list[torch.Tensor]] = [[] for _ in layers]
    for at in range(0, len(ids), CHUNK):
        part = torch.as_tensor([ids[at:at + CHUNK]], dtype=torch.long, device=runner.device)
        for keep, state in zip(out, runner.early_states([slot], part, [at], layers)):
            keep.append(state[0])
    return [torch.cat(parts)[len(prompt) - 1:] for parts in out]  # [n, H] each


def make_exit_states(runner, data: Path, prompts: list[list[int]], layers: list[int],
                     deadline: float | None = None, say: Callable[[str], None] = print) -> bool:
    """Compute the missing state shards of ``data`` at each of ``layers``, one teacher-forced
    pass for all (``prompts``: each dataset sequence's prompt ids, in the work list's order);
    False when the deadline (a ``time.monotonic`` value) stopped it first."""
    info = DatasetInfo.load(data)
    if len(prompts) != info.items:
        raise ConfigError(f"{data} holds {info.items} responses, the work list {len(prompts)}: "
                          "give the options that made the dataset")
    shards = finished_shards(data, info)  # --no-harvest: the finished ones
    if shards == 0:
        raise ConfigError(f"the dataset in {data} has no finished shard yet")
    for layer in layers:
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
            todo = [L for L in layers if not states_path(states_dir(data, L), n).exists()]
            if not todo:
                continue
            if deadline is not None and time.monotonic() >= deadline:
                return False
            t = load_file(str(shard_path(data, n)))
            starts, tokens = t["starts"], t["next_tokens"]
            parts: list[list[torch.Tensor]] = [[] for _ in todo]
            for s in range(len(starts) - 1):
                response = tokens[int(starts[s]):int(starts[s + 1])].tolist()
                item = n * info.per_shard + s
                states = sequence_states(runner, slot, prompts[item], response, todo)
                for keep, state in zip(parts, states):
                    keep.append(state.to(torch.bfloat16).cpu())
                done += len(prompts[item]) + len(response) - 1
            for L, keep in zip(todo, parts):
                folder = states_dir(data, L)
                tmp = folder / f".states-{n:05d}.tmp"
                save_file({"states": torch.cat(keep).contiguous()}, str(tmp))
                tmp.replace(states_path(folder, n))
            if (n + 1) % 5 == 0 or n + 1 == shards:
                say(f"exit states (layers {','.join(map(str, todo))}): shard {n + 1}/{shards}, "
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
