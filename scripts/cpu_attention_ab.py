"""The CPU attention's pieces (after) against one call (before), in one process, runs
alternating, on the default model: torch on ``--threads`` threads, set here.

- a prompt's prefill (``TargetRunner.prefill``: chunks of ``PREFILL_CHUNK`` tokens, as the
  prefill queue's parts): after, a chunk's queries 64 at a time, each piece over the key blocks
  it sees, its softmax in the scores' layout (``attention.QUERY_PIECE``, ``WIDE_COLUMNS``);
- a verification step of ragged contexts (``--steps``: each a comma-separated list of
  ``COUNTxCONTEXT``, every row 4 draft tokens): after, the rows that read far fewer key blocks
  than another attend apart (``attention.row_groups``).

Each side's outputs must be the same bits (the slot's next logits after a prefill, the step's
logits). Prints each case's best time a side and their ratio; writes every run as JSON.

    python scripts/cpu_attention_ab.py [--dtype auto] [--threads 2] [--lengths 128,512,1024,2000]
        [--steps "16x60;16x60,1x300;16x60,1x1000"] [--rounds 3] [--json cpu-attention-ab.json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import edgespec.runner.attention as attention
import edgespec.runner.eager_forward as eager_forward
from edgespec.runner.target_runner import TargetRunner
from ab_table import best_table, sides_in_round  # scripts/, where the script runs from


def _side(after: bool, knobs: tuple) -> None:
    piece, wide, groups = knobs
    attention.QUERY_PIECE = piece if after else 10 ** 9
    attention.WIDE_COLUMNS = wide if after else 10 ** 9
    eager_forward.row_groups = groups if after else (lambda visible: ())


def _prefills(runner, vocab: int, lengths: list[int], rounds: int, knobs) -> list[dict]:
    runs = []
    for n in lengths:
        prompt = [(i * 7919 + 13) % (vocab - 100) + 50 for i in range(n)]
        logits = {}
        for r in range(rounds):
            for side in sides_in_round(r):
                _side(side == "after", knobs)
                slot = runner.new_slot()
                t0 = time.perf_counter()
                runner.prefill(slot, prompt)
                runs.append({"case": f"prefill {n}", "side": side, "s": time.perf_counter() - t0})
                _side(True, knobs)
                logits[side] = runner.forward([slot], [[prompt[0]]])[0]
                runner.free_slot(slot)
        assert torch.equal(logits["before"], logits["after"]), n
    return runs


def _steps(runner, vocab: int, steps: list[str], rounds: int, knobs) -> list[dict]:
    runs = []
    for spec in steps:
        lengths = [int(ctx) for part in spec.split(",")
                   for count, ctx in [part.split("x")] for _ in range(int(count))]
        slots = [runner.new_slot() for _ in lengths]
        for s, n in zip(slots, lengths):
            runner.prefill(s, [(i * 7919 + 13) % (vocab - 100) + 50 for i in range(n)])
        logits = {}
        for r in range(rounds):
            for side in sides_in_round(r):
                _side(side == "after", knobs)
                for _ in range(3):  # the best of three forwards a round
                    for s, n in zip(slots, lengths):
                        runner.rollback(s, n)
                    t0 = time.perf_counter()
                    logits[side] = runner.forward(slots, [[5, 6, 7, 8]] * len(slots))
                    runs.append({"case": f"step {spec}", "side": side,
                                 "s": time.perf_counter() - t0})
        _side(True, knobs)
        assert torch.equal(logits["before"], logits["after"]), spec
        for s in slots:
            runner.free_slot(s)
    return runs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default", help="the target model (default: %(default)s)")
    p.add_argument("--dtype", default="auto", help="its dtype, as serve's (default: %(default)s)")
    p.add_argument("--threads", type=int, default=2,
                   help="torch's CPU threads (default: %(default)s)")
    p.add_argument("--lengths", default="128,512,1024,2000",
                   help="comma-separated prompt lengths to prefill (default: %(default)s)")
    p.add_argument("--steps", default="16x60;16x60,1x300;16x60,1x1000;8x100,8x600;64x60,4x1000",
                   help="';'-separated steps, each comma-separated COUNTxCONTEXT rows of 4 "
                        "draft tokens (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=3,
                   help="rounds, each side once a round (default: %(default)s)")
    p.add_argument("--json", default="cpu-attention-ab.json",
                   help="where to write every run (default: %(default)s)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)  # deliberately: the serving threads of a 2-core machine
    from edgespec.models.loading import load_model

    lengths = [int(x) for x in args.lengths.split(",") if x]
    steps = [s for s in args.steps.split(";") if s]
    loaded = load_model(args.model, "cpu", args.dtype)
    longest = max(lengths + [int(part.split("x")[1]) for s in steps for part in s.split(",")])
    runner = TargetRunner(loaded.model, n_slots=80, max_len=longest + 64)
    vocab = loaded.tokenizer.vocab_size
    knobs = (attention.QUERY_PIECE, attention.WIDE_COLUMNS, eager_forward.row_groups)
    runs = _prefills(runner, vocab, lengths, args.rounds, knobs) + \
        _steps(runner, vocab, steps, args.rounds, knobs)
    print(f"the {args.model} model ({runner.dtype}), torch on {args.threads} thread(s), the "
          f"best of each side's runs; every output identical both ways")
    table = best_table(runs)
    with open(args.json, "w") as f:
        json.dump({"model": args.model, "dtype": str(runner.dtype), "threads": args.threads,
                   "query_piece": knobs[0], "wide_columns": knobs[1], "table": table,
                   "runs": runs}, f, indent=2)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
