"""The data step of ``edgespec distill``: the prompts (Spec-Bench questions outside the held-out
ones, and the user's JSONL files) and the harvest of the target's responses to them."""

from __future__ import annotations

import time
from dataclasses import replace
from collections import defaultdict
from pathlib import Path

from edgespec.config import ConfigError
from edgespec.jsonl_file import jsonl_rows
from edgespec.models.chat_prompt import chat_roles


def read_prompt_file(path: str) -> list[dict]:
    """A JSONL file's requests: {"prompt": TEXT}, {"messages": [...]} or {"turns": [...]}
    (the first turn) per line; blank lines are skipped."""
    out = []
    for n, row in jsonl_rows(path, "the prompt file"):
        if isinstance(row, dict) and isinstance(row.get("messages"), list):
            if not all(isinstance(m, dict) for m in row["messages"]):
                raise ConfigError(f"{path}:{n}: each message is an object with a \"role\" "
                                  "and a \"content\"")
            try:  # before the model loads (ShareGPT's roles, "human" and "gpt", say)
                chat_roles(row["messages"])
            except ConfigError as e:
                raise ConfigError(f"{path}:{n}: {e}") from None
            out.append({"messages": row["messages"], "line": n})
        elif isinstance(row, dict) and isinstance(row.get("prompt"), str):
            out.append({"prompt": row["prompt"], "line": n})
        elif isinstance(row, dict) and isinstance(row.get("turns"), list) and row["turns"]:
            out.append({"prompt": str(row["turns"][0]), "line": n})
        else:
            raise ConfigError(f"{path}:{n}: a line needs \"prompt\", \"messages\" or \"turns\"")
    return out


def _encoded(tokenizer, request: dict) -> list[int]:
    """A request's prompt ids; a prompt file's line its chat template refuses names the file
    and the line (a special token's text it cannot keep text, say)."""
    from edgespec.models.loading import encode_prompt

    try:
        return encode_prompt(tokenizer, request.get("prompt"), messages=request.get("messages"))
    except ConfigError as e:
        if "line" not in request:
            raise
        raise ConfigError(f"{request['tag']}:{request['line']}: {e}") from None


def spec_bench_training_prompts(hold_out: int) -> list[dict]:
    """Spec-Bench's first turns, without the first ``hold_out`` of each category."""
    from .bench.run import load_questions

    seen: defaultdict[str, int] = defaultdict(int)
    out = []
    for q in load_questions([], 0, full=True):
        seen[q["category"]] += 1
        if seen[q["category"]] > hold_out:
            out.append({"prompt": q["prompt"], "tag": q["category"]})
    return out


def distill_work(args, tokenizer) -> tuple[list, list[str]]:
    """The harvest's work list (``heads.harvest.WorkItem``s, each tagged with its prompt's
    Spec-Bench category or file) and the prompts' sources, from the distill options."""
    from edgespec.heads.harvest import work_list

    requests = [] if args.no_spec_bench else spec_bench_training_prompts(args.hold_out)
    sources = [] if args.no_spec_bench else [f"spec-bench minus the first {args.hold_out} "
                                             "of each category"]
    for path in args.prompts:
        requests += [{**r, "tag": path} for r in read_prompt_file(path)]
        sources.append(path)
    if not requests:
        raise ConfigError("no prompts: give --prompts FILE or leave Spec-Bench on")
    encoded = [(_encoded(tokenizer, r), r["tag"]) for r in requests]
    kept = [(p, tag) for p, tag in encoded if len(p) <= args.max_prompt_tokens]
    if not kept:
        raise ConfigError(f"every prompt is longer than --max-prompt-tokens "
                          f"{args.max_prompt_tokens}")
    if len(kept) < len(encoded):
        print(f"distill: left out {len(encoded) - len(kept)} prompts longer than "
              f"{args.max_prompt_tokens} tokens", flush=True)
    items = work_list([p for p, _ in kept], args.samples, args.temperature, args.seed,
                      [tag for _, tag in kept])
    return items, sources


def sequences_tagged(args, tokenizer, tags: set[str]) -> set[int]:
    """The dataset's sequences (their indices: a shard keeps its work items' order) whose
    prompts carry one of ``tags``."""
    items, _ = distill_work(args, tokenizer)
    return {i for i, w in enumerate(items) if w.tag in tags}


def make_dataset(args, folder: Path, command: str, deadline: float | None) -> bool:
    """Harvest the dataset into ``folder`` (resuming it); False if the deadline stopped it."""
    import torch

    from edgespec.heads.dataset import DatasetInfo
    from edgespec.heads.fingerprint import runner_fingerprint
    from edgespec.heads.harvest import Harvester
    from edgespec.models.loading import load_model, stop_token_ids
    from edgespec.runner.target_runner import TargetRunner

    t0 = time.monotonic()
    target = load_model(args.model, args.device, args.dtype)
    items, sources = distill_work(args, target.tokenizer)
    longest = max(len(w.prompt_ids) for w in items)
    runner = TargetRunner(target.model, n_slots=args.slots,
                          max_len=min(2048, longest + args.max_new_tokens + 2))
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
    prompts = len({tuple(w.prompt_ids) for w in items})
    print(f"distill: {prompts} prompts, {len(items)} responses in {info.shards} shards, "
          f"model loaded in {time.monotonic() - t0:.0f} s ({target.dtype})", flush=True)
    harvester = Harvester(runner, stop_token_ids(target), args.max_new_tokens, info.top_k)
    with torch.inference_mode():
        return harvester.run(folder, info, items, deadline,
                             say=lambda m: print(f"distill: {m}", flush=True))
