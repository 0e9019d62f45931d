"""Router-collapse warning: a layer that sends almost all of its tokens to one expert, step after step.

A collapsed router still trains (the LM loss falls), and the console's ``imb`` column only shows the
worst layer of the steps it prints, so a collapse is easy to miss. :class:`CollapseWatch` reads each
step's token counts per expert (``counts_LE``, summed over the world: what the ``train`` record's
``expert_counts`` holds) and returns one warning per *streak*: a layer whose most loaded expert gets
more than ``share`` (90%) of the layer's tokens on ``steps`` (5) consecutive steps. The hot expert
may change within a streak (a collapsed router often jumps between experts from one step to the
next); the warning names the layer (its global layer number) and the hot experts of the streak. The
layer warns again only after a step at or below the threshold ends its streak.

An expert's share of the layer's tokens is ``count_e · k / Σ_e count_e``: the fraction of the tokens
that chose it (each token makes k choices). With capacity dropping the counts are the kept ones,
so the share is among the kept tokens.

Shape names: L MoE layers, E experts.

Usage::

    watch = CollapseWatch(moe_layers=[0, 1, 2, 3], topk=2)
    for warning in watch.update(step, counts_LE):     # {"layer", "experts", "message"}
        print("warning: " + warning["message"])
"""

from __future__ import annotations

from typing import Any, Dict, List, Sequence

COLLAPSE_SHARE = 0.9
"""An expert with more than this fraction of its layer's tokens counts as a collapsed step."""
COLLAPSE_STEPS = 5
"""Consecutive collapsed steps after which the layer's warning is printed (once per streak)."""


class CollapseWatch:
    """Per-layer streaks of collapsed steps (see the module docstring)."""

    def __init__(
        self, *, moe_layers: Sequence[int], topk: int, share: float = COLLAPSE_SHARE, steps: int = COLLAPSE_STEPS
    ):
        """``moe_layers``: the global layer number of each row of ``counts_LE``; ``topk``: k, the
        experts each token chooses; ``share`` and ``steps``: the threshold and the streak length."""
        if topk < 1 or steps < 1 or not 0.0 < share <= 1.0:
            raise ValueError(
                f"CollapseWatch needs topk >= 1, steps >= 1 and 0 < share <= 1 (got {topk}, {steps}, {share})"
            )
        self.moe_layers = list(moe_layers)
        self.topk = topk
        self.share = share
        self.steps = steps
        self.streak = [0] * len(self.moe_layers)
        """Consecutive collapsed steps of each layer, up to the last step seen."""
        self.hot: List[List[int]] = [[] for _ in self.moe_layers]
        """The hot expert of each step of each layer's current streak."""
        self.warned = [False] * len(self.moe_layers)
        """True once the layer's current streak has been reported."""

    def update(self, step: int, counts_LE: Sequence[Sequence[float]]) -> List[Dict[str, Any]]:
        """Take step ``step``'s token counts per (MoE layer, expert); return the warnings that are due,
        one per layer whose streak reaches ``steps`` on this step: ``{"layer": global layer number,
        "experts": the streak's hot experts, "share": the hot expert's share this step, "message": ...}``."""
        if len(counts_LE) != len(self.moe_layers):
            raise ValueError(
                f"counts_LE has {len(counts_LE)} rows, expected one per MoE layer ({len(self.moe_layers)})"
            )
        out = []
        for row, counts_E in enumerate(counts_LE):
            total = float(sum(counts_E))
            top = max(range(len(counts_E)), key=lambda e: counts_E[e]) if len(counts_E) else 0
            share = counts_E[top] * self.topk / total if total > 0 else 0.0
            if share <= self.share:
                self.streak[row], self.hot[row], self.warned[row] = 0, [], False
                continue
            self.streak[row] += 1
            self.hot[row].append(top)
            if self.streak[row] >= self.steps and not self.warned[row]:
                self.warned[row] = True
                out.append(
                    dict(
                        layer=self.moe_layers[row],
                        experts=sorted(set(self.hot[row])),
                        share=share,
                        message=self._message(row, step, share),
                    )
                )
        return out

    def _message(self, row: int, step: int, share: float) -> str:
        n, layer = self.streak[row], self.moe_layers[row]
        experts = ", ".join(str(e) for e in sorted(set(self.hot[row])))
        which = f"expert {experts}" if "," not in experts else f"one expert (experts {experts} in turn)"
        return (
            f"router collapse in layer {layer}: {which} got more than {self.share:.0%} of the layer's tokens "
            f"on {n} steps running (steps {step - n + 1}-{step}; {share:.1%} at step {step}); what helps: "
            "docs/routing.md#a-collapsed-router (a larger moe.aux_loss_coeff, a lower optim.lr, for a small "
            "model a larger model.init_std)"
        )
