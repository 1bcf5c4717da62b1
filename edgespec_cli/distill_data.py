"""The data step of ``edgespec distill``: the prompts (Spec-Bench questions outside the held-out
ones, and the user's JSONL files) and the harvest of the target's responses to them."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from collections import defaultdict
from pathlib import Path

from edgespec.config import ConfigError


def read_prompt_file(path: str) -> list[dict]:
    """A JSONL file's requests: {"prompt": TEXT}, {"messages": [...]} or {"turns": [...]}
    (the first turn) per line; blank lines are skipped."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise ConfigError(f"cannot read the prompt file {path}: {e.strerror}") from None
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            raise ConfigError(f"{path}:{n}: not a JSON object") from None
        if isinstance(row, dict) and isinstance(row.get("messages"), list):
            out.append({"messages": row["messages"]})
        elif isinstance(row, dict) and isinstance(row.get("prompt"), str):
            out.append({"prompt": row["prompt"]})
        elif isinstance(row, dict) and isinstance(row.get("turns"), list) and row["turns"]:
            out.append({"prompt": str(row["turns"][0])})
        else:
            raise ConfigError(f"{path}:{n}: a line needs \"prompt\", \"messages\" or \"turns\"")
    return out


def spec_bench_training_prompts(hold_out: int) -> list[dict]:
    """Spec-Bench's first turns, without the first ``hold_out`` of each category."""
    from .bench.run import load_questions

    seen: defaultdict[str, int] = defaultdict(int)
    out = []
    for q in load_questions([], 0, full=True):
        seen[q["category"]] += 1
        if seen[q["category"]] > hold_out:
            out.append({"prompt": q["prompt"]})
    return out


def make_dataset(args, folder: Path, command: str, deadline: float | None) -> bool:
    """Harvest the dataset into ``folder`` (resuming it); False if the deadline stopped it."""
    import torch

    from edgespec.heads.dataset import DatasetInfo
    from edgespec.heads.fingerprint import runner_fingerprint
    from edgespec.heads.harvest import Harvester, work_list
    from edgespec.models import encode_prompt, load_model, stop_token_ids
    from edgespec.runner import TargetRunner

    requests = [] if args.no_spec_bench else spec_bench_training_prompts(args.hold_out)
    sources = [] if args.no_spec_bench else [f"spec-bench minus the first {args.hold_out} "
                                             "of each category"]
    for path in args.prompts:
        requests += read_prompt_file(path)
        sources.append(path)
    if not requests:
        raise ConfigError("no prompts: give --prompts FILE or leave Spec-Bench on")
    t0 = time.monotonic()
    target = load_model(args.model, args.device, args.dtype)
    prompts = [encode_prompt(target.tokenizer, r.get("prompt"), messages=r.get("messages"))
               for r in requests]
    kept = [p for p in prompts if len(p) <= args.max_prompt_tokens]
    if not kept:
        raise ConfigError(f"every prompt is longer than --max-prompt-tokens "
                          f"{args.max_prompt_tokens}")
    if len(kept) < len(prompts):
        print(f"distill: left out {len(prompts) - len(kept)} prompts longer than "
              f"{args.max_prompt_tokens} tokens", flush=True)
    prompts = kept
    longest = max(len(p) for p in prompts)
    runner = TargetRunner(target.model, n_slots=args.slots,
                          max_len=min(2048, longest + args.max_new_tokens + 2))
    items = work_list(prompts, args.samples, args.temperature, args.seed)
    info = DatasetInfo(target=runner_fingerprint(runner), hidden=runner.embed.shape[1],
                       vocab=runner.vocab_size, feature_dtype=target.dtype, top_k=16,
                       per_shard=args.per_shard, items=len(items), seed=args.seed,
                       max_new_tokens=args.max_new_tokens, sources=sources, command=command)
    if (folder / "dataset.json").exists():
        old = DatasetInfo.load(folder)
        if replace(old, command="") != replace(info, command=""):  # any stop/train options
            raise ConfigError(f"{folder} holds a dataset made otherwise ({old.command!r}); "
                              "give another --out or the same options")
    else:
        info.save(folder)
    print(f"distill: {len(prompts)} prompts, {len(items)} responses in {info.shards} shards, "
          f"model loaded in {time.monotonic() - t0:.0f} s ({target.dtype})", flush=True)
    harvester = Harvester(runner, stop_token_ids(target), args.max_new_tokens, info.top_k)
    with torch.inference_mode():
        return harvester.run(folder, info, items, deadline,
                             say=lambda m: print(f"distill: {m}", flush=True))
