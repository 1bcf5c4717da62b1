"""Which inline lead drafts better on real text, measured without timing noise.

Step 1 (``refs``): the default model's greedy target-only outputs of Spec-Bench questions,
batched (``SpecEngine`` with no drafter), written to a JSON file.
Step 2 (``replay``): the engine with MaG drafting inline (the product's path), over a runner
that answers each row from those outputs at once (``ReferenceRunner``: the verifier's greedy
token at every position is the reference's), with a fixed draft length (``adaptive=False``:
nothing depends on timing), for each inline lead: ``board`` (a board's ``lead_cap``, 2k + 2
within the window: the inline drafter's before the fortieth session, imposed here by capping each
call's length) and ``window`` (the whole window, the product's since). With the default window of
16, 2k + 2 reaches it from k = 7 on: the k = 8 rows are the same by construction. Every replayed
output must equal its
reference (checked); what differs is which draft tokens the steps verify, so the figures are
exact: forwards a session needs, tokens a forward, drafter calls.

    python lead_replay.py refs refs.json 40          # 40 questions a category
    python lead_replay.py replay refs.json out.json 2,3,4,8
"""

from __future__ import annotations

import json
import sys
import time

import torch

torch.set_num_threads(1)  # said: the reference run uses one thread (its speed is not measured)


def make_refs(path: str, per_category: int) -> None:
    from edgespec.config import EngineConfig, SamplingParams
    from edgespec.engine.local import LocalGenerator
    from edgespec.engine.spec_engine import Request, SpecEngine
    from edgespec_cli.bench.run import SPEC_BENCH, load_questions

    questions = load_questions([*sorted(SPEC_BENCH), "mt_bench"], per_category, False)
    cfg = EngineConfig(max_sessions=16)
    gen = LocalGenerator("default", "none", "cpu", "bfloat16", cfg)
    prompts = [gen.encode(q["prompt"]) for q in questions]
    out = []
    t0 = time.perf_counter()
    with SpecEngine(gen.runner, None, cfg, set(gen.stop_ids)) as engine:
        for i in range(0, len(prompts), 16):
            batch = prompts[i:i + 16]
            results = engine.generate_many([Request(list(p), 96, SamplingParams())
                                            for p in batch])
            out += [{"id": q["id"], "category": q["category"], "prompt": p,
                     "output": r.token_ids}
                    for q, p, r in zip(questions[i:i + 16], batch, results)]
            print(f"{len(out)}/{len(prompts)} in {time.perf_counter() - t0:.0f} s", flush=True)
    json.dump({"stop_ids": sorted(gen.stop_ids), "dtype": gen.dtype, "questions": out},
              open(path, "w"))


def replay(refs_path: str, out_path: str, ks: list[int]) -> None:
    import edgespec.engine.inline_drafts as inline
    from edgespec.config import EngineConfig
    from edgespec.drafters import build_drafter
    from edgespec.drafters.drafting_loop import lead_cap

    refs = json.load(open(refs_path))
    qs, stop_ids = refs["questions"], set(refs["stop_ids"])
    leads, window = ("board", "window"), EngineConfig().window
    report = []
    for k in ks:
        for name in leads:
            calls = [0]
            asked: dict[str, int] = {}
            draft, draft_one = inline.InlineDrafts.draft, inline.InlineDrafts._draft_one

            def noting(self, wants, _inner=draft):
                asked.clear()
                asked.update((w.session_id, w.k) for w in wants)
                return _inner(self, wants)

            def counted(self, sid, state, length, _inner=draft_one, _lead=name):
                calls[0] += 1
                if _lead == "board":  # the product's length, cut to a board's lead
                    length = min(length, max(asked[sid] + 1, lead_cap(asked[sid], window)))
                return _inner(self, sid, state, length)

            inline.InlineDrafts.draft, inline.InlineDrafts._draft_one = noting, counted
            try:
                by_cat = replay_counts(qs, stop_ids, build_drafter("mag"), k)
            finally:
                inline.InlineDrafts.draft, inline.InlineDrafts._draft_one = draft, draft_one
            tokens = sum(c[0] for c in by_cat.values())
            steps = sum(c[1] for c in by_cat.values())
            row = {"k": k, "lead": name, "tokens": tokens, "session_steps": steps,
                   "tokens_per_forward": tokens / steps, "drafter_calls": calls[0],
                   "draft_tokens": sum(c[2] for c in by_cat.values()),
                   "accepted": sum(c[3] for c in by_cat.values()),
                   "by_category": {cat: {"tokens_per_forward": c[0] / c[1], "steps": c[1]}
                                   for cat, c in sorted(by_cat.items())}}
            report.append(row)
            print(f"k={k} lead={name:6s} tokens/forward {row['tokens_per_forward']:.4f} "
                  f"session-steps {steps} calls {calls[0]} " +
                  " ".join(f"{cat}:{v['tokens_per_forward']:.3f}"
                           for cat, v in row["by_category"].items()), flush=True)
    json.dump({"questions": len(qs), "rows": report}, open(out_path, "w"), indent=1)


def replay_counts(qs: list[dict], stop_ids: set[int], drafter, k: int) -> dict[str, list[int]]:
    """The questions replayed through the engine with ``drafter`` inline at a fixed draft
    length k, 16 sessions at a time, each output checked equal to its reference: per category,
    [tokens, session-steps, draft tokens verified, accepted]."""
    from edgespec.config import EngineConfig, SamplingParams
    from edgespec.engine.spec_engine import Request, SpecEngine

    runner = _reference_runner()(qs, 16)
    cfg = EngineConfig(max_sessions=16, max_draft=k, adaptive=False, rest_drafters=False)
    by_cat: dict[str, list[int]] = {}
    with SpecEngine(runner, drafter, cfg, stop_ids) as engine:
        for i in range(0, len(qs), 16):
            batch = qs[i:i + 16]
            results = engine.generate_many([Request(list(q["prompt"]), 96, SamplingParams())
                                            for q in batch])
            for q, r in zip(batch, results):
                assert r.token_ids == q["output"], q["id"]  # the replay is target-only's
                c = by_cat.setdefault(q["category"], [0, 0, 0, 0])
                c[0] += len(r.token_ids)
                c[1] += r.stats.steps
                c[2] += r.stats.draft_tokens
                c[3] += r.stats.accepted_tokens
    return by_cat


def _reference_runner():
    from edgespec_cli.bench.instant_runner import InstantRunner

    class ReferenceRunner(InstantRunner):
        """Answers each row from the reference outputs: slot s holds the session whose
        prefilled tokens start a reference; a row's logits at position t point at the
        reference's token t + 1 (any token past its end: the engine cuts the output there)."""

        def __init__(self, qs: list[dict], n_slots: int):
            super().__init__(n_slots, 1.0)
            self.vocab_size = 49152
            self.full = {tuple(q["prompt"][:-1]): q["prompt"] + q["output"] for q in qs}
            self.fed: dict[int, list[int]] = {}
            self.seq: dict[int, list[int]] = {}

        def prefill(self, slot, tokens, embeds=None):
            self.fed[slot] = list(tokens)
            self.seq.pop(slot, None)
            super().prefill(slot, tokens)

        def prefill_parts(self, slots, parts, reads=None):
            for slot, part in zip(slots, parts):
                self.fed.setdefault(slot, []).extend(part)
                self.seq.pop(slot, None)
            super().prefill_parts(slots, parts, reads=reads)

        def copy_prompt(self, src, dst, length):  # an identical prompt's prefill shared
            self.fed[dst] = list(self.fed[src][:length])
            self.seq.pop(dst, None)
            super().copy_prompt(src, dst, length)

        def free_slot(self, slot):
            self.fed.pop(slot, None)
            self.seq.pop(slot, None)
            super().free_slot(slot)

        def score_rows(self, rows, tap=None):
            from edgespec.runner.step_rows import Scored

            B, T = rows.tokens.shape
            positions = (rows.start_index[:, None] + rows.depths[:, :T]).tolist()
            logits = torch.zeros(B, T, self.vocab_size)
            for b, slot in enumerate(rows.slots):
                seq = self.seq.get(slot)
                if seq is None:
                    seq = self.seq[slot] = self.full[tuple(self.fed[slot])]
                for t, pos in enumerate(positions[b]):
                    nxt = seq[pos + 1] if pos + 1 < len(seq) else 0
                    logits[b, t, nxt] = 10.0
            return Scored(logits, torch.zeros(B, T, 8))

    return ReferenceRunner


if __name__ == "__main__":
    if sys.argv[1] == "refs":
        make_refs(sys.argv[2], int(sys.argv[3]))
    else:
        replay(sys.argv[2], sys.argv[3], [int(k) for k in sys.argv[4].split(",")])
