"""How many draft tokens each session should verify in the next step, from measured costs.

A verification forward over T tokens costs about ``fixed + per_token * T`` seconds
(``ForwardCost`` fits the two on the steps the engine actually ran, with a prior slope until the
steps vary enough to measure it). A session whose draft tokens are accepted with probability
alpha each (``DraftLength.alpha``, measured) gains alpha^m expected tokens from its m-th draft
token. ``allocate`` hands out draft tokens, the most promising first, while each one raises the
step's expected tokens per second: a token worth g tokens at a cost of per_token seconds pays
iff g / per_token > (tokens so far) / (seconds so far). So a session whose drafts are rarely
accepted is decoded plainly (k = 0: no wider forward, no wait), and draft lengths shrink as a
batch grows or the forward gets dearer per token, as on a CPU.

Token trees the same way (``allocate_branches``): after the chains, a session's branch tokens
are worth beta expected tokens each (its measured accepted branch tokens per branch token), and
are added while they raise the step's expected tokens per second; on a CPU, where a wider
forward is dear, trees that rarely pay are left out.
"""

from __future__ import annotations

import heapq


class ForwardCost:
    """seconds ~ fixed + per_token * tokens, least squares over recent steps (older steps decay
    by ``decay`` per step). Until the token counts seen vary, the slope is the prior
    ``prior_share`` of a step's mean time per token (measured here: a 5-token forward of the
    default model cost ~1.2x a 1-token one on 2 CPU cores, i.e. ~0.05 per token)."""

    def __init__(self, prior_share: float = 0.05, decay: float = 0.98, prior_weight: float = 4.0):
        self.prior_share, self.decay, self.prior_weight = prior_share, decay, prior_weight
        self.n = self.sx = self.sy = self.sxx = self.sxy = 0.0

    def observe(self, tokens: int, seconds: float) -> None:
        if seconds <= 0 or tokens <= 0:
            return
        d = self.decay
        self.n = d * self.n + 1
        self.sx = d * self.sx + tokens
        self.sy = d * self.sy + seconds
        self.sxx = d * self.sxx + tokens * tokens
        self.sxy = d * self.sxy + tokens * seconds

    def fit(self) -> tuple[float, float] | None:
        """(fixed, per_token) seconds, or None before the first step."""
        if self.n <= 0:
            return None
        mx, my = self.sx / self.n, self.sy / self.n
        var = self.sxx / self.n - mx * mx
        cov = self.sxy / self.n - mx * my
        prior = self.prior_share * my
        # the prior slope weighs as much as prior_weight steps spread by one token
        w = self.prior_weight / self.n
        slope = (cov + w * prior) / (var + w)
        # one preempted wide step must not stop drafting for a while: stay within 1/4..4x the
        # prior slope
        slope = min(4 * prior, max(prior / 4, slope))
        fixed = max(1e-6, my - slope * mx)
        return fixed, slope


def allocate_branches(betas: list[float], caps: list[int], alphas: list[float], ks: list[int],
                      cost: ForwardCost) -> list[int]:
    """Branch tokens per session (each at most its cap) on top of chains of ks tokens, while
    each raises the step's expected tokens per second. betas[i]: session i's accepted tokens
    per branch token verified; alphas[i]: its chain's per-token acceptance."""
    fit = cost.fit()
    if fit is None:
        return list(caps)
    fixed, per_token = fit
    gain = sum(1 + sum(a ** m for m in range(1, k + 1)) for a, k in zip(alphas, ks))
    seconds = fixed + per_token * (len(ks) + sum(ks))
    budgets = [0] * len(caps)
    for i in sorted(range(len(caps)), key=lambda j: -betas[j]):
        while budgets[i] < caps[i] and betas[i] * seconds > per_token * gain:
            budgets[i] += 1
            gain, seconds = gain + betas[i], seconds + per_token
    return budgets


def allocate(alphas: list[float], caps: list[int], cost: ForwardCost) -> list[int]:
    """Draft tokens per session (each at most its cap) that maximise expected tokens per
    second of the next step. alphas[i]: session i's per-token acceptance estimate."""
    fit = cost.fit()
    if fit is None:
        return list(caps)
    fixed, per_token = fit
    n_rows = len(caps)
    gain, seconds = float(n_rows), fixed + per_token * n_rows  # every row emits one token
    ks = [0] * n_rows
    heap = [(-a, i) for i, (a, c) in enumerate(zip(alphas, caps)) if c > 0 and a > 0]
    heapq.heapify(heap)
    while heap:
        g, i = heapq.heappop(heap)
        g = -g
        if g * seconds <= per_token * gain:  # this token (and every later one) lowers the rate
            break
        ks[i] += 1
        gain, seconds = gain + g, seconds + per_token
        if ks[i] < caps[i]:
            heapq.heappush(heap, (-g * alphas[i], i))
    return ks
