"""PAD inside the verification step: the pivot classifier as the step's ``LenientRule``.

The engine asks the target's forward for the hidden state at the classifier's tap (a reference
to a tensor the forward makes anyway: no second forward), binds it to the rule, and
``verify_step`` calls the rule on the same step's logits. For every draft node the rule reads,
at the position that scores the node (its parent's), the tapped hidden state, the entropy of the
target's distribution and its probability of the node's token (temperature 1, before any
sampling filter, as the labels were made: ``classifier.position_inputs``), and keeps the node
where ``pad_keep`` says so. All on the device; the step's one host sync is unchanged.

Exact verification's rule still decides first (``verify_step``): a node the target would have
chosen is accepted as always, and the target's own token still follows the accepted path
(greedy: its argmax; sampled: the keyed sample there), so PAD only lengthens accepted prefixes.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import ConfigError, PadParams
from ..runner.host_transfers import longs_to_device
from ..verify.verify_step import LenientRule
from .classifier import PivotClassifier, load_classifier, pad_keep, position_inputs

SHIPPED = Path(__file__).parent / "shipped"


def resolve_classifier_dir(spec: str, target_name: str = "") -> Path:
    """``--verify pad:SPEC``'s folder: "default" (the classifier shipped for the default model)
    or a folder made by ``edgespec pad-train`` (its ``classifier`` subfolder is taken when the
    run's folder is given)."""
    from ..config import DEFAULT_MODEL_NAME

    if spec == "default":
        folder = SHIPPED / (target_name or DEFAULT_MODEL_NAME)
        if not (folder / "pad.json").exists():
            raise ConfigError(f"no PAD classifier is shipped for {target_name or 'this model'}; "
                              "make one with edgespec pad-train and give --verify pad:DIR")
        return folder
    folder = Path(spec).expanduser()
    if not (folder / "pad.json").exists() and (folder / "classifier" / "pad.json").exists():
        return folder / "classifier"
    return folder


@dataclass
class PadVerifier:
    """The classifier a verifier keeps, and its knobs."""

    classifier: PivotClassifier
    params: PadParams

    @classmethod
    def load(cls, params: PadParams, runner) -> "PadVerifier":
        """The classifier named by ``params`` for ``runner``'s target (``ConfigError`` when it
        is missing or was made for another target)."""
        folder = resolve_classifier_dir(params.classifier, getattr(runner, "name", ""))
        return cls(load_classifier(folder, runner), params)

    @property
    def tap(self) -> int:
        """The tap the forward is asked for (``TargetRunner.score_rows(tap=...)``)."""
        return self.classifier.cfg.tap

    def rule(self, tapped: torch.Tensor, stop_ids: Collection[int] = ()) -> LenientRule:
        """The step's keep rule over the forward's tapped hidden states [B, 1 + N, H]; a
        stop token is never kept leniently (it would end the answer where the target did
        not)."""

        def keep(logits: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor
                 ) -> torch.Tensor:
            return self.keep(tapped, logits, tokens, parents, stop_ids)
        return keep

    def keep(self, tapped: torch.Tensor, logits: torch.Tensor, tokens: torch.Tensor,
             parents: torch.Tensor, stop_ids: Collection[int] = ()) -> torch.Tensor:
        """tapped [B, R, H], logits [B, R, V] (R >= 1 + N), tokens/parents [B, N] ->
        keep [B, N] bool."""
        if self.params.sigma <= 0 or tokens.shape[1] == 0:
            return torch.zeros_like(tokens, dtype=torch.bool)
        at = (parents + 1).clamp(min=0)  # [B, N]: the row scoring each node
        logp, entropy = position_inputs(logits)  # [B, R, V], [B, R]
        rows = torch.arange(len(tokens), device=tokens.device)[:, None]
        token_prob = logp[rows, at, tokens.clamp(min=0)].exp()  # [B, N]
        feats = tapped.gather(1, at[..., None].expand(-1, -1, tapped.shape[-1]))  # [B, N, H]
        keep = pad_keep(self.classifier, feats, entropy.gather(1, at), token_prob,
                        self.params.sigma, self.params.min_prob)
        if stop_ids:
            [stops] = longs_to_device([sorted(stop_ids)], tokens.device)  # no wait
            keep = keep & ~torch.isin(tokens, stops)
        return keep
