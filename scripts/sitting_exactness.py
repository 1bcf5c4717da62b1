"""The GPU sitting's ``exactness`` stage (``scripts/gpu_sitting.py``): what batch invariance
costs, against the same model's step on torch's own kernels.

``PlainStep`` runs a verification step of B sessions x T tokens over C cached keys each with
the runner's own weights through cuBLAS (``F.linear``), torch's RMS norm and SDPA
(``scaled_dot_product_attention``, grouped-query): the work of the runner's step with kernels
that pick their algorithm by the call's shape, so a row's bits may depend on the batch (not
lossless for speculative decoding). Its static buffers make it one CUDA graph, replayed and
timed as the runner's steps are (``graphed_median_ms``). The stage writes its milliseconds at
1 x 1 and 64 x 9 over 300 keys and, where the ``decode`` stage timed the runner at the same
sizes, the runner's cost over it (the issue's goal: at most 15%; SGLang's deterministic mode
costs 34%).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class PlainStep:
    """One step's forward on torch's kernels over static buffers: tokens [B, T] at positions
    C..C+T-1 of B caches of C + T keys (random keys for the first C: their values do not change
    the work), each token seeing the keys before it and itself."""

    def __init__(self, runner, B: int, T: int, context: int, seed: int = 0):
        self.runner, self.B, self.T, self.C = runner, B, T, context
        dev, dt = runner.device, runner.dtype
        g = torch.Generator().manual_seed(seed)
        L, kvh, hd = runner.n_layers, runner.kv_heads, runner.head_dim
        n = context + T
        self.k = [torch.randn(B, kvh, n, hd, generator=g).to(dev, dt) for _ in range(L)]
        self.v = [torch.randn(B, kvh, n, hd, generator=g).to(dev, dt) for _ in range(L)]
        self.tokens = torch.randint(3, runner.vocab_size, (B, T), generator=g).to(dev)
        keys = torch.arange(n, device=dev)
        self.mask = keys[None, :] <= (context + torch.arange(T, device=dev))[:, None]  # [T, n]
        self.cos = runner.cos[context:n][None, None]  # [1, 1, T, hd]
        self.sin = runner.sin[context:n][None, None]
        self.logits: torch.Tensor | None = None

    def _rope(self, x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * self.cos + rotated * self.sin

    def __call__(self) -> torch.Tensor:
        r, B, T, C = self.runner, self.B, self.T, self.C
        nh, kvh, hd, H = r.n_heads, r.kv_heads, r.head_dim, r.embed.shape[1]
        h = F.embedding(self.tokens, r.embed)  # [B, T, H]
        for i, layer in enumerate(r.layers):
            a = F.rms_norm(h, (H,), layer.ln1, r.eps)
            qkv = F.linear(a, layer.qkv.weight, layer.qkv.bias)
            q, k, v = qkv.split([nh * hd, kvh * hd, kvh * hd], dim=-1)
            q = self._rope(q.view(B, T, nh, hd).transpose(1, 2))  # [B, nh, T, hd]
            self.k[i][:, :, C:] = self._rope(k.view(B, T, kvh, hd).transpose(1, 2))
            self.v[i][:, :, C:] = v.view(B, T, kvh, hd).transpose(1, 2)
            att = F.scaled_dot_product_attention(q, self.k[i], self.v[i], attn_mask=self.mask,
                                                 scale=r.scale, enable_gqa=True)
            h = h + F.linear(att.transpose(1, 2).reshape(B, T, nh * hd), layer.o.weight)
            m = F.rms_norm(h, (H,), layer.ln2, r.eps)
            gate, up = F.linear(m, layer.gate_up.weight).chunk(2, dim=-1)
            h = h + F.linear(F.silu(gate) * up, layer.down.weight)
        self.logits = F.linear(F.rms_norm(h, (H,), r.norm, r.eps), r.lm_head.weight)
        return self.logits


def stage_exactness(s, shape: str, runner, sizes, context: int, timer) -> None:
    """The plain step's milliseconds at each size (``timer(fn)``: replayed from a CUDA graph
    on the GPU), and the runner's over it where the ``decode`` stage timed the same size."""
    out = s.data.setdefault("exactness", {}).setdefault(shape, {})
    decode = s.data.get("decode", {}).get(shape, {}).get("tiles", {})
    for B, T in sizes:
        step = PlainStep(runner, B, T, context)
        with torch.inference_mode():
            ms = round(timer(step), 3)
        row: dict = {"plain_ms": ms}
        runner_ms = decode.get(f"{B}x{T}_ms") or decode.get(f"{B}x{T}@{context}_ms")
        if runner_ms:
            row["runner_ms"] = runner_ms
            row["cost_of_exactness"] = round(runner_ms / ms - 1, 3)
        out[f"{B}x{T}"] = row
        print(f"   {shape} {B} x {T} at {context} keys: plain (cuBLAS + SDPA, graphed) {ms} ms"
              + (f", the runner {runner_ms} ms: exactness costs "
                 f"{100 * row['cost_of_exactness']:.0f}%" if runner_ms else ""), flush=True)
        del step
