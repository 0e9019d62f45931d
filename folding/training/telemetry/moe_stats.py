"""Per-step MoE statistics gathered from the MoE layers: expert load, dropped tokens, aux/z losses.

Every MoE layer (:class:`folding.moe.routing.balancing.RoutedBlock`) sums the routing statistics its
router returns for each training forward of the step (whatever order a pipeline schedule runs the
micro-batches in): the routed rows per expert, the dropped (token, expert) pairs and this rank's share
of each router loss. :meth:`MoEStats.collect` takes those sums from every layer once the step's
forwards and backwards are done.
:meth:`MoEStats.vector` packs them into one flat tensor that the trainer sums over the world in its
single per-step all-reduce; :meth:`MoEStats.summarize` unpacks the sum.

Shape names: L MoE layers of the whole model (by global layer number; multi-token-prediction layers
last), E experts.

- Rows per expert: every rank routes distinct tokens (attention ranks hold distinct token chunks), so
  the world sum is the global count per expert and layer.
- Loss shares: a micro-batch's loss is the sum of its TP×CP ranks' shares, so the world sum is the
  sum of every micro-batch's loss over all layers; dividing by the number of micro-batches of the global
  batch gives the per-micro-batch mean, which is what the objective adds (``aux_loss_scale``).
  ``global_aux_loss`` shares are already whole over TP×DP×CP, so its sum is further divided by DP.

Usage::

    stats = MoEStats(chunks, model_config=job.model)
    stats.reset(); ...forward/backward...; stats.collect(); v = stats.vector()   # then all-reduce(sum)
    stats.summarize(v, num_microbatches=M_global, dp=layout.dp)
"""

from __future__ import annotations

from typing import Dict, List, Sequence

import torch
from torch import nn

from ...model.config import ModelConfig
from ...moe.routing.balancing import BalancingRouter, RoutedBlock, RoutingStats, find_routed_blocks, find_routers

LOSS_NAMES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "z_loss")


class MoEStats:
    """Router statistics of the forwards of one step, collected from the MoE layers (see the module docstring)."""

    def __init__(self, chunks: Sequence[nn.Module], *, model_config: ModelConfig):
        """Find the routers and the MoE layers of ``chunks``; ``model_config`` gives the MoE layer
        numbering and E."""
        self.moe_layers = [i for i in model_config.layer_numbers() if model_config.is_moe_layer(i)]
        self.row_of = {layer: r for r, layer in enumerate(self.moe_layers)}
        self.E = model_config.moe.num_experts
        self.routers: List[BalancingRouter] = find_routers(chunks)
        device = next((p.device for c in chunks for p in c.parameters()), torch.device("cpu"))
        self.counts_LE = torch.zeros(len(self.moe_layers), self.E, dtype=torch.float64, device=device)
        self.dropped = torch.zeros((), dtype=torch.float64, device=device)
        self.dropped_LE = torch.zeros_like(self.counts_LE)
        """This rank's dropped pairs per layer and expert (for the routing trace; not in :meth:`vector`)."""
        self.losses = torch.zeros(len(LOSS_NAMES), dtype=torch.float64, device=device)
        self.blocks: List[RoutedBlock] = find_routed_blocks(chunks)

    def collect(self) -> None:
        """Take the routing statistics every MoE layer summed since the last :meth:`collect` or
        :meth:`reset` and add them to the step's (call it after the step's last backward)."""
        for block in self.blocks:
            stats = block.take_routing_stats()
            if stats is not None:
                self._add(stats)

    def _add(self, stats: RoutingStats) -> None:
        with torch.no_grad():
            row = self.row_of[stats.layer_number]
            self.counts_LE[row] += stats.tokens_per_expert_E.to(self.counts_LE)
            self.dropped += stats.dropped.to(self.dropped)
            self.dropped_LE[row] += stats.dropped_per_expert_E.to(self.dropped_LE)
            for name, value in stats.losses.items():
                if name in LOSS_NAMES:
                    self.losses[LOSS_NAMES.index(name)] += value.detach().to(self.losses).sum()

    def reset(self) -> None:
        """Forget the previous step (and whatever the layers kept of forwards since)."""
        for block in self.blocks:
            block.take_routing_stats()
        self.counts_LE.zero_()
        self.dropped.zero_()
        self.dropped_LE.zero_()
        self.losses.zero_()

    def vector(self) -> torch.Tensor:
        """This rank's statistics as one flat float64 tensor (sum it over the world)."""
        return torch.cat([self.counts_LE.flatten(), self.dropped.view(1), self.losses])

    @property
    def size(self) -> int:
        """Length of :meth:`vector`."""
        return self.counts_LE.numel() + 1 + len(LOSS_NAMES)

    def summarize(self, summed: torch.Tensor, *, num_microbatches: int, dp: int, topk: int) -> Dict:
        """Unpack a world-summed :meth:`vector`: ``counts_LE`` (list of lists), ``dropped_fraction``
        (dropped ÷ routed (token, expert) pairs) and each loss's per-micro-batch mean (summed over layers)."""
        n = self.counts_LE.numel()
        counts = summed[:n].view(len(self.moe_layers), self.E)
        dropped = float(summed[n])
        kept = float(counts.sum())
        losses = summed[n + 1 :]
        out = {
            "counts_LE": counts.tolist(),
            "dropped_fraction": dropped / (kept + dropped) if kept + dropped > 0 else 0.0,
        }
        for i, name in enumerate(LOSS_NAMES):
            v = float(losses[i]) / num_microbatches
            if name == "global_aux_loss":
                v /= dp
            out[name] = v
        return out

    def close(self) -> None:
        """Forget the MoE layers (they keep nothing once taken)."""
        self.reset()
        self.blocks = []
