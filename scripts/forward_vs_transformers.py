"""Where the runner's forward loses to transformers' eager forward on this CPU, part by part.

For the model in float32 (the default model unless ``--model``), one decode step at a
``--context``-token context, medians of ``--repeat`` runs at ``--threads`` torch threads:

- the whole forward: the runner's (batch-invariant kernels) against transformers' (SDPA
  attention, ``F.linear``) with its KV cache cropped back after each step;
- one layer's linears at one row: the runner's packed oneDNN linear (a lone row sent as two)
  against ``F.linear`` (MKL), for each distinct shape and the LM head;
- one layer's attention: ``invariant_attention`` against ``scaled_dot_product_attention``.

Run it natively and under ``ONEDNN_MAX_CPU_ISA`` / ``ATEN_CPU_CAPABILITY`` caps to see an older
CPU's code paths. Prints a table and writes JSON (the CPU it ran on in both).

    python scripts/forward_vs_transformers.py --threads 2
    ONEDNN_MAX_CPU_ISA=AVX512_CORE_VNNI python scripts/forward_vs_transformers.py --threads 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def median_ms(fn, repeat: int, warm: int = 3) -> float:
    for _ in range(warm):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--context", type=int, default=300)
    p.add_argument("--repeat", type=int, default=15)
    p.add_argument("--json", default="bench-results/forward-vs-transformers.json")
    args = p.parse_args()

    import torch
    import torch.nn.functional as F

    from edgespec.models.loading import load_model
    from edgespec.runner.attention import invariant_attention, padded_keys
    from edgespec.runner.cpu_kind import cpu_kind
    from edgespec.runner.linear import Linear
    from edgespec.runner.target_runner import TargetRunner

    torch.set_num_threads(args.threads)
    model = load_model(args.model, dtype="float32").model
    cfg = model.config
    g = torch.Generator().manual_seed(0)
    ctx = torch.randint(0, cfg.vocab_size, (1, args.context), generator=g)
    tok = torch.randint(0, cfg.vocab_size, (1, 1), generator=g)
    rows = []

    runner = TargetRunner(model, n_slots=1, max_len=args.context + 64)
    slot = runner.new_slot()
    runner.prefill(slot, ctx[0].tolist())
    ours = median_ms(lambda: runner.forward([slot], [[int(tok)]]), args.repeat)

    from transformers import DynamicCache

    with torch.no_grad():
        cache = DynamicCache()
        model(ctx, past_key_values=cache, use_cache=True)
        pos = torch.tensor([[args.context]])

        def hf_step():
            model(tok, past_key_values=cache, use_cache=True, position_ids=pos)
            cache.crop(-1)  # back to the context: every step sees the same

        theirs = median_ms(hf_step, args.repeat)
    rows.append(("forward, 1 token", ours, theirs))

    layer = model.model.layers[0]
    shapes = {"qkv": torch.cat([layer.self_attn.q_proj.weight, layer.self_attn.k_proj.weight,
                                layer.self_attn.v_proj.weight]),
              "o": layer.self_attn.o_proj.weight,
              "gate_up": torch.cat([layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight]),
              "down": layer.mlp.down_proj.weight, "lm_head": model.lm_head.weight}
    with torch.no_grad():
        for name, w in shapes.items():
            lin = Linear(w.detach())
            x = torch.randn(1, w.shape[1], generator=g)
            rows.append((f"linear {name} {w.shape[1]}->{w.shape[0]}, 1 row",
                         median_ms(lambda: lin(x), args.repeat),
                         median_ms(lambda: F.linear(x, w), args.repeat)))
        kvh, hd = runner.kv_heads, runner.head_dim
        grp = runner.n_heads // kvh
        n = padded_keys(args.context + 1, runner.cache.k[0].shape[2])
        q = torch.randn(1, kvh, grp, 1, hd, generator=g)
        keys = torch.randn(1, kvh, n, hd, generator=g)
        values = torch.cat([torch.randn(1, kvh, n, hd, generator=g), torch.ones(1, kvh, n, 1)],
                           -1)
        visible = (torch.arange(n) <= args.context)[None, None, :]
        sq = q.reshape(1, kvh * grp, 1, hd)
        sk, sv = keys[:, :, :args.context + 1], values[:, :, :args.context + 1, :hd]
        rows.append(("attention, 1 query, one layer",
                     median_ms(lambda: invariant_attention(q, keys, values, visible,
                                                           runner.col_tile, None,
                                                           runner.attention_products,
                                                           max_cols=runner.attention_cols),
                               args.repeat),
                     median_ms(lambda: F.scaled_dot_product_attention(sq, sk, sv,
                                                                      enable_gqa=True),
                               args.repeat)))
    layers = len(model.model.layers)
    kind = cpu_kind()
    print(f"machine: {kind.describe()}")
    print(f"model {args.model} float32, {layers} layers, context {args.context}, "
          f"median of {args.repeat}")
    print(f"{'part':44s} {'edgespec ms':>12s} {'transformers ms':>16s} {'ratio':>6s}")
    for name, a, b in rows:
        print(f"{name:44s} {a:12.3f} {b:16.3f} {a / b:6.2f}")
    out = {"cpu": kind.as_json(), "model": args.model, "threads": args.threads,
           "context": args.context, "layers": layers,
           "rows": [{"part": n, "edgespec_ms": a, "transformers_ms": b, "ratio": a / b}
                    for n, a, b in rows],
           "command": "python scripts/forward_vs_transformers.py " + " ".join(sys.argv[1:])}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1))
    print(f"wrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
