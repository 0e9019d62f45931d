"""Router-collapse warning: a layer whose routed tokens go almost all to ``k`` experts, step after step.

A collapsed router still trains (the LM loss falls), and the console's ``imb`` column only shows the
worst layer of the steps it prints, so a collapse is easy to miss. :class:`CollapseWatch` reads each
step's token counts per expert (``counts_LE``, summed over the world: what the ``train`` record's
``expert_counts`` holds) and returns one warning per *streak*: a layer whose ``k`` busiest experts
(``k`` = top-k, the experts each token chooses) take more than ``share`` (90%) of the layer's routed
tokens (``Σ_e count_e``, k per token) on ``steps`` (5) consecutive steps. The definition is on the
load, so it means the same at every k: at top-1 one expert takes more than 90% of the tokens; at
top-2 every token on the same two experts of eight (``load_imbalance`` 4.00, the ceiling) is 100%; at
top-8 of 64 the busiest eight take the share the layer's eight choices would if every token made
the same ones. One expert chosen by every token while the other choices spread is not a collapse: the
layer still uses its experts. The busiest experts may change within a streak (a collapsed router often
jumps between experts from one step to the next); the warning names the layer (its global layer
number) and the experts that were among the busiest on some step of the streak. The layer warns
again only after a step at or below the threshold ends its streak. With capacity dropping the counts
are the kept ones, so the share is among the kept tokens.

Shape names: L MoE layers, E experts.

Usage::

    watch = CollapseWatch(moe_layers=[0, 1, 2, 3], topk=2)
    for warning in watch.update(step, counts_LE):     # {"layer", "experts", "share", "message"}
        print("warning: " + warning["message"])
"""

from __future__ import annotations

from typing import Any, Dict, List, Sequence

COLLAPSE_SHARE = 0.9
"""A layer whose ``topk`` busiest experts take more than this fraction of its routed tokens has a
collapsed step."""
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
        """The busiest experts of every step of each layer's current streak."""
        self.warned = [False] * len(self.moe_layers)
        """True once the layer's current streak has been reported."""

    def update(self, step: int, counts_LE: Sequence[Sequence[float]]) -> List[Dict[str, Any]]:
        """Take step ``step``'s token counts per (MoE layer, expert); return the warnings that are due,
        one per layer whose streak reaches ``steps`` on this step: ``{"layer": global layer number,
        "experts": the streak's busiest experts, "share": their share this step, "message": ...}``."""
        if len(counts_LE) != len(self.moe_layers):
            raise ValueError(
                f"counts_LE has {len(counts_LE)} rows, expected one per MoE layer ({len(self.moe_layers)})"
            )
        out = []
        for row, counts_E in enumerate(counts_LE):
            total = float(sum(counts_E))
            busiest = sorted(range(len(counts_E)), key=lambda e: (-counts_E[e], e))[: self.topk]
            share = sum(counts_E[e] for e in busiest) / total if total > 0 else 0.0
            if share <= self.share:
                self.streak[row], self.hot[row], self.warned[row] = 0, [], False
                continue
            self.streak[row] += 1
            self.hot[row].extend(busiest)
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
        n, layer, k = self.streak[row], self.moe_layers[row], self.topk
        hot = sorted(set(self.hot[row]))
        experts = ", ".join(str(e) for e in hot)
        if k == 1:
            who = f"expert {experts}" if len(hot) == 1 else f"one expert (experts {experts} in turn)"
        else:
            who = f"its {k} busiest experts ({'experts ' + experts if len(hot) == k else experts + ' in turn'})"
        return (
            f"router collapse in layer {layer}: {who} took more than {self.share:.0%} of the layer's routed "
            f"tokens on {n} steps running (steps {step - n + 1}-{step}; {share:.1%} at step {step}); what "
            "helps: docs/routing.md#a-collapsed-router (a larger moe.aux_loss_coeff, a lower optim.lr, for a "
            "small model a larger model.init_std)"
        )
