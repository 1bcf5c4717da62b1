"""Whether imitation drafting should verify alternatives beside its chain, on this machine.

    python scripts/imitation_alternatives.py [--threads 2] [--json FILE]

Three measurements on the default model (bfloat16) with the shipped ``imitation:default``
network, torch threads set by ``--threads`` (default 2):

1. how often the network's first draft holds the target's next token within its top k
   (k = 1..8), over the target's own greedy answers to 12 Spec-Bench questions (teacher-forced:
   the layer-L states drafting would see);
2. what a verification forward costs with branch nodes beside a chain (the branch nodes' keys
   are read in decoding order: ``runner.attention.TailKeys``), and what one draft forward
   costs (layers 1..L, then the network and the draft head), median of 15;
3. whole generations through ``SpecEngine`` (4 questions, 96 tokens, greedy) with no head
   (target-only), a chain, and a chain with alternatives (``ImitationProposer(widths=...)``),
   in one run: tok/s, acceptance length, ratios to target-only, and per step the forward's
   time (the step's verification and, with a head, its drafting) and the rest of the step.

Prints a table of each and writes them as JSON. Measured figures: docs/heads.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from edgespec.config import EngineConfig
from edgespec.drafters import build_drafter
from edgespec.engine.spec_engine import Request, SpecEngine
from edgespec.heads.imitation import load_imitation
from edgespec.heads.imitation_proposer import ImitationProposer
from edgespec.models.loading import encode_prompt, load_model, stop_token_ids
from edgespec.runner.target_runner import TargetRunner
from edgespec.runner.threads import set_threads
from edgespec.verify.trees import DraftTree

QUESTIONS = Path(__file__).resolve().parents[1] / "edgespec_cli" / "bench" / \
    "spec_bench_questions.jsonl"
TOP_K = (1, 2, 3, 4, 6, 8)
WIDTHS = {"chain": (0,), "widths (1, 0)": (1, 0), "widths (5, 1)": (5, 1)}


def median_ms(fn, n: int = 15) -> float:
    fn()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def questions(every: int, n: int) -> list[str]:
    with open(QUESTIONS) as f:
        return [json.loads(line)["turns"][0] for line in f][::every][:n]


@torch.inference_mode()
def greedy_answer(runner: TargetRunner, ids: list[int], n: int) -> list[int]:
    slot = runner.new_slot()
    runner.prefill(slot, ids[:-1])
    runner.commit(slot, len(ids) - 1)
    last, out = ids[-1], []
    for _ in range(n):
        logits = runner.forward([slot], [[last]], "last")
        runner.commit(slot, runner.cache.lengths[slot] + 1)
        last = int(logits[0].argmax())
        out.append(last)
    runner.free_slot(slot)
    return out


@torch.inference_mode()
def top_k_accuracy(runner: TargetRunner, net, tokenizer) -> dict[str, float]:
    """Share of positions where the target's next token is within the first draft's top k."""
    hits, positions = dict.fromkeys(TOP_K, 0), 0
    for text in questions(40, 12):
        ids = encode_prompt(tokenizer, text)
        seq = ids + greedy_answer(runner, ids, 96)
        slot = runner.new_slot()
        runner.prefill(slot, seq[:len(ids) - 1])
        runner.commit(slot, len(ids) - 1)
        h = runner.early_hidden([slot], torch.tensor([seq[len(ids) - 1:-1]]), [len(ids) - 1],
                                net.cfg.exit_layer)[0]  # [T, H]: predicts seq[len(ids):]
        runner.free_slot(slot)
        probs = net.logits(net.features(h.float())).softmax(-1)  # [T, Vd]
        top = net.target.vocab_ids[probs.topk(max(TOP_K), dim=-1).indices]  # [T, 8]
        truth = torch.tensor(seq[len(ids):])[:, None]
        for k in TOP_K:
            hits[k] += int((top[:, :k] == truth).any(-1).sum())
        positions += len(truth)
    return {"positions": positions, **{f"top_{k}": hits[k] / positions for k in TOP_K}}


def tree_costs(runner: TargetRunner) -> dict[str, float]:
    """A 9-row verification forward: a chain of 8, and a chain of 3 with 1 or 5 branch nodes
    hanging from the root (what widths (1,) / (5,) add at the first position)."""
    slot = runner.new_slot()
    runner.prefill(slot, list(range(100, 400)))
    runner.commit(slot, 300)
    shapes = {"chain of 8": DraftTree(tuple(range(5, 13)), tuple(range(-1, 7))),
              "chain of 3 + 1 branch node": DraftTree((5, 6, 7, 8), (-1, 0, 1, -1)),
              "chain of 3 + 5 branch nodes": DraftTree(tuple(range(5, 13)),
                                                       (-1, 0, 1, -1, -1, -1, -1, -1))}
    out = {name: median_ms(lambda t=tree: runner.score_tree([slot], [4], [t]))
           for name, tree in shapes.items()}
    runner.free_slot(slot)
    return out


@torch.inference_mode()
def draft_costs(runner: TargetRunner, net) -> dict[str, float]:
    """One session's draft forward: the first L layers over one token, then the network and
    the draft-vocabulary head."""
    slot = runner.new_slot()
    runner.prefill(slot, list(range(100, 400)))
    runner.commit(slot, 300)
    token = torch.tensor([[500]])
    L = net.cfg.exit_layer
    layers = median_ms(lambda: runner.early_hidden([slot], token, [300], L))
    h = runner.early_hidden([slot], token, [300], L)[:, 0].float()  # [1, H]
    readout = median_ms(lambda: net.logits(net.features(h)).softmax(-1).max(-1))
    runner.free_slot(slot)
    return {f"layers 1..{L}": layers, "network and draft head": readout}


def generations(loaded, net_spec: str) -> dict[str, dict[str, float]]:
    prompts = [encode_prompt(loaded.tokenizer, q) for q in questions(80, 4)]
    rows = {}
    for name, widths in {"target-only": None, **WIDTHS}.items():
        runner = TargetRunner(loaded.model, n_slots=2, max_len=2048)
        head = None if widths is None else \
            ImitationProposer(load_imitation(net_spec, runner), runner, widths=widths)
        tokens = accepted = drafts = steps = 0
        forward_s = 0.0
        t0 = time.perf_counter()
        with SpecEngine(runner, build_drafter("none"), EngineConfig(max_draft=6),
                        stop_token_ids(loaded), head=head) as engine:
            for p in prompts:
                res = engine.generate_many([Request(p, 96)])[0]
                tokens += len(res.token_ids)
                accepted += res.stats.accepted_tokens
                drafts += res.stats.num_drafts
                steps += res.stats.steps
                forward_s += res.stats.forward_s
        seconds = time.perf_counter() - t0
        rows[name] = {"tokens_per_s": tokens / seconds,
                      "mean_acceptance_length": 1 + accepted / max(drafts, 1),
                      "forward_ms_per_step": 1000 * forward_s / steps,
                      "rest_ms_per_step": 1000 * (seconds - forward_s) / steps}
    base = rows["target-only"]["tokens_per_s"]
    for row in rows.values():
        row["speedup_vs_target_only"] = row["tokens_per_s"] / base
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads (default: 2)")
    ap.add_argument("--imitation", default="default", help="the network (default: shipped)")
    ap.add_argument("--json", default="bench-results/imitation-alternatives.json",
                    help="where to write the figures")
    args = ap.parse_args()
    print(f"torch threads {set_threads(args.threads)}")
    loaded = load_model("default", dtype="bfloat16")
    runner = TargetRunner(loaded.model, n_slots=2, max_len=1024)
    net = load_imitation(args.imitation, runner)
    result = {"threads": args.threads, "exit_layer": net.cfg.exit_layer,
              "top_k": top_k_accuracy(runner, net, loaded.tokenizer),
              "verify_ms": tree_costs(runner), "draft_ms": draft_costs(runner, net),
              "generation": generations(loaded, args.imitation)}
    print(f"\nfirst draft within the top k ({result['top_k']['positions']} positions)")
    for k in TOP_K:
        print(f"  top {k}: {result['top_k'][f'top_{k}']:.3f}")
    print("\nverification forward, 9 rows (median ms)")
    for name, ms in result["verify_ms"].items():
        print(f"  {name:30s} {ms:6.1f}")
    print("\none draft forward (median ms)")
    for name, ms in result["draft_ms"].items():
        print(f"  {name:30s} {ms:6.1f}")
    print(f"\n{'generation':16s} {'tok/s':>7s} {'x target':>9s} {'MAL':>6s} "
          f"{'forward ms/step':>16s} {'rest ms/step':>13s}")
    for name, row in result["generation"].items():
        print(f"{name:16s} {row['tokens_per_s']:7.1f} {row['speedup_vs_target_only']:9.2f} "
              f"{row['mean_acceptance_length']:6.2f} {row['forward_ms_per_step']:16.1f} "
              f"{row['rest_ms_per_step']:13.1f}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
