"""The methods ``edgespec bench`` measures, and how one run of each goes: edgespec's engine
(target-only, each drafter, trees, loose, float32 target-only beside another served dtype),
transformers' own generation paths and llama.cpp's. ``MethodPlan`` is what the options ask for;
``BenchMethods`` holds the loaded generators and runs a method on a prompt."""

from __future__ import annotations

import importlib.util
import time
from dataclasses import dataclass, replace

from edgespec.config import ConfigError, EngineConfig, SamplingParams

from .report import LOOSE_PREFIX, TREE_TAG

HF_METHODS = ["hf_generate", "hf_prompt_lookup", "hf_assisted"]
FLOAT32_TARGET = "target_only_float32"  # float32 target-only beside another served dtype
LLAMACPP_METHODS = ["llamacpp_target_only", "llamacpp_prompt_lookup"]


def llamacpp_installed() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


@dataclass(frozen=True)
class MethodPlan:
    """The drafters, tree drafters and loose drafter asked for, checked."""

    drafters: list[str]
    trees: list[str]
    loose: str | None
    use_llamacpp: bool

    def methods(self, float32: bool, hf: bool, llamacpp: bool, tree_width: int) -> list[str]:
        """Every method of the run, baselines first."""
        return (["target_only"] + ([FLOAT32_TARGET] if float32 else [])
                + (HF_METHODS if hf else []) + (LLAMACPP_METHODS if llamacpp else [])
                + [f"edgespec:{d}" for d in self.drafters]
                + [f"edgespec:{d}{TREE_TAG}{tree_width}" for d in self.trees]
                + ([f"{LOOSE_PREFIX}{self.loose}"] if self.loose else []))


def split_drafters(text: str) -> list[str]:
    """``--drafters``' list: ';'-separated (a cascade's members are ','-separated), or
    ','-separated when there is no ';' and no cascade (``cascade:a,b`` alone is one drafter)."""
    sep = ";" if ";" in text or "cascade:" in text else ","
    return [d.strip() for d in text.split(sep) if d.strip()]


def plan_methods(args) -> MethodPlan:
    """The methods the options ask for; an unknown drafter or a missing model is refused
    before anything loads."""
    from edgespec_cli.cli_args import check_drafter_arg, check_model_arg

    drafters = split_drafters(args.drafters)
    if getattr(args, "head", None):  # the head alone, and beside each drafter
        drafters += [f"head:{args.head}"] + [f"{d}+head:{args.head}" for d in drafters
                                             if d != "none" and "+head:" not in d]
    use_llamacpp = llamacpp_installed() and not args.skip_llamacpp and args.temperature <= 0
    if use_llamacpp and not any(d.startswith("llamacpp:") for d in drafters):
        drafters.append("llamacpp:default")
    loose = None if args.loose in ("", "none") else args.loose
    trees = [] if args.trees in ("", "none") else split_drafters(args.trees)
    check_model_arg(args.model)
    for d in drafters + trees + ([loose] if loose else []):
        check_drafter_arg(d)
    if trees and not 2 <= args.bench_tree_width <= 16:
        raise ConfigError(f"--tree-width must be in [2, 16], got {args.bench_tree_width}")
    return MethodPlan(drafters, trees, loose, use_llamacpp)


class HFBaselines:
    """transformers' own generation paths on the same model object."""

    def __init__(self, model, stop_ids: set[int], assist_layers: int):
        self.model, self.assist_layers = model, assist_layers
        eos = sorted(stop_ids)
        self.common = dict(do_sample=False, eos_token_id=eos or None,
                           pad_token_id=eos[0] if eos else None)

    def run(self, method: str, ids: list[int], max_new: int) -> list[int]:
        import torch

        extra = {}
        if method == "hf_prompt_lookup":
            extra = {"prompt_lookup_num_tokens": 10}
        elif method == "hf_assisted":
            extra = {"assistant_early_exit": self.assist_layers}
        from transformers import GenerationConfig

        inp = torch.tensor([ids], device=self.model.device)
        config = GenerationConfig(max_new_tokens=max_new, **self.common, **extra)
        with torch.inference_mode():
            out = self.model.generate(inp, attention_mask=torch.ones_like(inp),
                                      generation_config=config)
        return out[0, len(ids):].tolist()


class BenchMethods:
    """The generators a run needs (target, loose, tree and float32 engines over one loaded
    model), transformers' and llama.cpp's baselines, and one run of a method on a prompt."""

    def __init__(self, args, cfg: EngineConfig, plan: MethodPlan):
        from edgespec.engine.local import LocalGenerator

        self.args = args
        self.gen = LocalGenerator(args.model, "none", args.device, args.dtype, cfg)
        self.gens: dict = {"loose": None, "tree": None, "float32": None}
        if plan.loose:
            self.gens["loose"] = LocalGenerator(self.gen.target, "none", args.device,
                                                args.dtype, replace(cfg, verify="loose"))
        if plan.trees:
            self.gens["tree"] = LocalGenerator(self.gen.target, "none", args.device, args.dtype,
                                               replace(cfg, tree_width=args.bench_tree_width))
        # another dtype than float32: float32 target-only runs beside it, and transformers'
        # baselines run in float32 (what a user would otherwise run)
        if self.gen.dtype != "float32":
            self.gens["float32"] = LocalGenerator(args.model, "none", args.device, "float32",
                                                  cfg)
        self.has_float32 = self.gens["float32"] is not None
        skip_hf = args.skip_hf or args.temperature > 0
        self.hf = None if skip_hf else HFBaselines(
            (self.gens["float32"] or self.gen).target.model, self.gen.stop_ids,
            args.assist_layers)
        self.gguf = None
        if plan.use_llamacpp:
            from edgespec.models.files import default_model_gguf

            self.gguf = default_model_gguf()

    def params_for(self, ids: list[int]) -> SamplingParams:
        """Greedy, or keyed sampling with a seed of the prompt's own (every method the same)."""
        if self.args.temperature <= 0:
            return SamplingParams()
        return SamplingParams(temperature=self.args.temperature,
                              seed=len(ids) * 7919 + sum(ids))

    def run_one(self, method: str, ids: list[int], max_new: int) -> dict:
        """One generation: its tokens and seconds (edgespec rows: decode seconds and stats)."""
        t0 = time.perf_counter()
        if method.startswith("hf_"):
            assert self.hf is not None  # hf_ methods are run only when the baselines loaded
            out = self.hf.run(method, ids, max_new)
            return {"token_ids": out, "seconds": time.perf_counter() - t0}
        if method.startswith("llamacpp_"):
            from .llamacpp_baseline import llamacpp_prompt_lookup, llamacpp_target_only

            run = llamacpp_prompt_lookup if method.endswith("lookup") else llamacpp_target_only
            out = run(self.gguf, ids, max_new, self.gen.stop_ids)
            return {"token_ids": out, "seconds": time.perf_counter() - t0}
        g, drafter = self.generator_for(method)
        res = g.generate(ids, max_new, self.params_for(ids), drafter=drafter)
        s = res.stats
        row = {"token_ids": res.token_ids, "seconds": time.perf_counter() - t0,
               "decode_seconds": s.elapsed_s - s.prefill_s, "stats": s.to_dict()}
        layer = exit_layer(g.engine(drafter))
        if layer is not None:
            row["exit_layer"] = layer
        return row

    def run_best(self, method: str, ids: list[int]) -> dict:
        """The fastest of ``--repeat`` runs (a drafter's state restored before each); a repeat
        whose tokens differ is returned at once, marked as not identical."""
        drafter = None
        if method.startswith(("edgespec:", LOOSE_PREFIX)):
            g, spec = self.generator_for(method)
            drafter = g.engine(spec).drafter
        state = drafter.snapshot() if drafter else None
        best = None
        for i in range(max(1, self.args.repeat)):
            if drafter is not None and i > 0:
                drafter.restore(state)
            r = self.run_one(method, ids, self.args.max_new_tokens)
            if best is not None and r["token_ids"] != best["token_ids"]:
                r["identical_to_target_only"] = False
                return r
            best = r if best is None or r["seconds"] < best["seconds"] else best
        assert best is not None  # at least one repeat
        return best

    def generator_for(self, method: str):
        """(the LocalGenerator, the drafter spec) an edgespec method runs with."""
        if method == "target_only":
            return self.gen, "none"
        if method == FLOAT32_TARGET:
            return self.gens["float32"], "none"
        if method.startswith(LOOSE_PREFIX):
            return self.gens["loose"], method[len(LOOSE_PREFIX):]
        spec = method.split(":", 1)[1]
        if TREE_TAG in spec:
            return self.gens["tree"], spec.rsplit(TREE_TAG, 1)[0]
        return self.gen, spec

    def cascade_levels(self, methods: list[str]) -> dict:
        """Per cascade method, each level's proposed and kept tokens."""
        out = {}
        for m in methods:
            if m.startswith("edgespec:cascade:"):
                g, spec = self.generator_for(m)
                out[m] = g.engine(spec).drafter.level_stats()
        return out

    def close(self) -> None:
        self.gen.close()
        for g in self.gens.values():
            if g is not None:
                g.close()


def exit_layer(engine) -> int | None:
    """The layer an early-exit drafter drafts from: ``layers:L``'s L, or an imitation
    network's (None for other drafters)."""
    head_cfg = getattr(getattr(engine.head, "head", None), "cfg", None)
    layer = getattr(head_cfg, "exit_layer", None)
    if layer is not None:
        return int(layer)
    name = getattr(engine.drafter, "name", "")
    if isinstance(name, str) and name.startswith("layers:"):
        return int(name.split(":", 1)[1])
    return None
