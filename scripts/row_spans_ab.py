"""The CPU linear layers in row spans (after: every oneDNN call 40 up to 128 rows) against 32-row
tiles (before: every call exactly 32 rows, padded), in one process, runs alternating, on the
default model: torch on ``--threads`` threads, set here. Only where this CPU's probe chooses
spans (an Emerald Rapids Xeon's bfloat16 at one to four threads); elsewhere it says so and stops.

- a verification step (``--steps``: ';'-separated, each a comma-separated list of
  ``COUNTxCONTEXT``, every row ``--width`` tokens), and a prompt's prefill (``--lengths``);
- the engine (``--sessions``): ``generate_many`` of that many Spec-Bench prompts (the first
  questions of the file), ``--new-tokens`` each, target-only and with in-process MaG drafts.

Spans and tiles are two kernels, so their bits differ; each side is checked against itself:
every step's rows against each row decoded alone, and the engine's MaG outputs against its own
target-only outputs. Prints each case's best time a side and their ratio; writes every run as
JSON.

    python scripts/row_spans_ab.py [--threads 1] [--dtype bfloat16] [--lengths 128,512]
        [--steps "1x60;4x60;16x60;16x60,1x300"] [--width 5] [--sessions 8]
        [--new-tokens 48] [--rounds 3] [--json row-spans-ab.json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from edgespec.runner import dtype_probe
from ab_table import SIDES, best_table, sides_in_round  # scripts/, where the script runs from


def _prompt(vocab: int, n: int, salt: int = 0) -> list[int]:
    return [(i * 7919 + 13 + salt * 104729) % (vocab - 100) + 50 for i in range(n)]


def _runners(model, max_len: int, slots: int) -> dict:
    """The two sides' runners of one model: tiles forced (before), the probe's spans (after)."""
    from edgespec.runner.target_runner import TargetRunner

    real = dtype_probe.packed_products
    dtype_probe.packed_products = lambda *a, **k: "packed-tiles"  # type: ignore[assignment]
    try:
        before = TargetRunner(model, n_slots=slots, max_len=max_len)
    finally:
        dtype_probe.packed_products = real
    after = TargetRunner(model, n_slots=slots, max_len=max_len)
    return {"before": before, "after": after}


def _steps(runners: dict, vocab: int, steps: list[str], width: int, rounds: int) -> list[dict]:
    runs = []
    for spec in steps:
        lengths = [int(ctx) for part in spec.split(",")
                   for count, ctx in [part.split("x")] for _ in range(int(count))]
        rows = [[7 + i + j for j in range(width)] for i in range(len(lengths))]
        placed = {}
        for side, runner in runners.items():
            slots = [runner.new_slot() for _ in lengths]
            for i, (s, n) in enumerate(zip(slots, lengths)):
                runner.prefill(s, _prompt(vocab, n, i))
            placed[side] = slots
        for r in range(rounds):
            for side in sides_in_round(r):
                runner, slots = runners[side], placed[side]
                for _ in range(3):  # the best of three forwards a round
                    t0 = time.perf_counter()
                    logits = runner.forward(slots, rows)
                    runs.append({"case": f"step {spec} x{width}", "side": side,
                                 "s": time.perf_counter() - t0})
        for side, runner in runners.items():  # each side against itself: every row alone
            logits = runner.forward(placed[side], rows)
            for b, (s, row) in enumerate(zip(placed[side], rows)):
                alone = runner.forward([s], [row])[0]
                assert torch.equal(logits[b, :len(row)], alone), (side, spec, b)
            for s in placed[side]:
                runner.free_slot(s)
    return runs


def _prefills(runners: dict, vocab: int, lengths: list[int], rounds: int) -> list[dict]:
    runs = []
    for n in lengths:
        prompt = _prompt(vocab, n)
        for r in range(rounds):
            for side in sides_in_round(r):
                runner = runners[side]
                slot = runner.new_slot()
                t0 = time.perf_counter()
                runner.prefill(slot, prompt)
                runs.append({"case": f"prefill {n}", "side": side,
                             "s": time.perf_counter() - t0})
                runner.free_slot(slot)
    return runs


def _engine_runs(runners: dict, prompts: list[list[int]], new_tokens: int, rounds: int,
                 stop: set[int]) -> list[dict]:
    from edgespec.config import EngineConfig, SamplingParams
    from edgespec.drafters import build_drafter
    from edgespec.drafters.spec_check import check_drafter_arg
    from edgespec.engine.generation import Request
    from edgespec.engine.spec_engine import SpecEngine

    runs: list[dict] = []
    outputs: dict = {}
    for drafter in ("none", "mag"):
        engines = {side: SpecEngine(runner, None if drafter == "none" else
                                    build_drafter(check_drafter_arg(drafter), None, None),
                                    EngineConfig(max_sessions=len(prompts)), stop)
                   for side, runner in runners.items()}
        try:
            for r in range(rounds + 1):  # the first round warms both sides up, untimed
                for side in sides_in_round(r):
                    reqs = [Request(list(p), new_tokens, SamplingParams()) for p in prompts]
                    t0 = time.perf_counter()
                    results = engines[side].generate_many(reqs)
                    wall = time.perf_counter() - t0
                    outputs[(side, drafter)] = [res.token_ids for res in results]
                    if r:
                        runs.append({"case": f"engine {len(prompts)} sessions, {drafter}",
                                     "side": side, "s": wall,
                                     "tokens": sum(len(res.token_ids) for res in results)})
        finally:
            for e in engines.values():
                e.close()
    for side in SIDES:  # lossless on each side: MaG's outputs its own target-only's
        assert outputs[(side, "mag")] == outputs[(side, "none")], side
    return runs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default", help="the target model (default: %(default)s)")
    p.add_argument("--dtype", default="bfloat16",
                   help="its dtype, as serve's (default: %(default)s)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch's CPU threads (default: %(default)s: the fleet runs' server core)")
    p.add_argument("--lengths", default="128,512",
                   help="comma-separated prompt lengths to prefill (default: %(default)s)")
    p.add_argument("--steps", default="1x60;4x60;16x60;16x60,1x300",
                   help="';'-separated steps, each comma-separated COUNTxCONTEXT rows "
                        "(default: %(default)s)")
    p.add_argument("--width", type=int, default=5,
                   help="tokens a row of a step: a draft of width - 1 (default: %(default)s)")
    p.add_argument("--sessions", type=int, default=8,
                   help="the engine's sessions, Spec-Bench prompts; 0: no engine runs "
                        "(default: %(default)s)")
    p.add_argument("--new-tokens", type=int, default=48,
                   help="tokens each engine session generates (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=3,
                   help="rounds, each side once a round (default: %(default)s)")
    p.add_argument("--json", default="row-spans-ab.json",
                   help="where to write every run (default: %(default)s)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)  # deliberately: the server's cores in the fleet runs
    from edgespec.models.loading import encode_prompt, load_model, stop_token_ids
    from edgespec_cli.bench.run import load_questions

    loaded = load_model(args.model, "cpu", args.dtype)
    dtype = loaded.model.dtype
    products = dtype_probe.packed_products(dtype)
    if products is None or not products.startswith(dtype_probe.SPANS):
        print(f"this CPU's products in {dtype} at {args.threads} thread(s) are {products}, not "
              "spans: nothing to compare here")
        return
    lengths = [int(x) for x in args.lengths.split(",") if x]
    steps = [s for s in args.steps.split(";") if s]
    questions = load_questions([], 0, True)[:args.sessions]
    prompts = [encode_prompt(loaded.tokenizer, q["prompt"]) for q in questions]
    longest = max(lengths + [int(part.split("x")[1]) for s in steps for part in s.split(",")]
                  + [len(q) for q in prompts])
    n_slots = max(args.sessions, max(sum(int(part.split("x")[0]) for part in s.split(","))
                                     for s in steps))
    runners = _runners(loaded.model, longest + args.new_tokens + 64, n_slots)
    got = {side: r.kernel_set.products for side, r in runners.items()}
    vocab = loaded.tokenizer.vocab_size
    runs = _steps(runners, vocab, steps, args.width, args.rounds) + \
        _prefills(runners, vocab, lengths, args.rounds)
    if args.sessions:
        runs += _engine_runs(runners, prompts, args.new_tokens, args.rounds,
                             stop_token_ids(loaded))
    print(f"the {args.model} model ({dtype}), torch on {args.threads} thread(s); before: "
          f"{got['before']}, after: {got['after']}; the best of each side's runs; each side's "
          "steps identical to its rows alone, its MaG outputs to its target-only outputs")
    table = best_table(runs, width=34)
    with open(args.json, "w") as f:
        json.dump({"model": args.model, "dtype": str(dtype), "threads": args.threads,
                   "products": got, "table": table, "runs": runs}, f, indent=2)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
