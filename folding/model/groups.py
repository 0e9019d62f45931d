"""The process groups a model uses, by role, taken from a :class:`~folding.parallel.ParallelState`.

Modules receive exactly the groups they need; this small record only carries them from the
parallel state to the model's constructor. ``ModelGroups.single()`` is the 1-rank model (no
communication), allowed only when ``torch.distributed`` is not initialized (otherwise a ``None``
group would mean the world: pass a parallel state instead).

Usage::

    groups = ModelGroups.from_state(ps)       # or ModelGroups.single()
    groups.tp, groups.tp_size, groups.cp_rank
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch.distributed as dist

from ..parallel.collectives import group_rank, group_size


@dataclasses.dataclass(frozen=True)
class ModelGroups:
    """Attention groups (tp, cp, tp_cp, tp_dp_cp) and MoE groups (ep, etp) used by the model."""

    tp: Optional[Any] = None
    """Attention tensor-parallel group (sequence parallel when its size > 1)."""
    cp: Optional[Any] = None
    """Context-parallel group."""
    tp_cp: Optional[Any] = None
    """TP x CP group (token counts of one sequence, for MoE aux losses)."""
    tp_dp_cp: Optional[Any] = None
    """TP x DP x CP group (global token counts, for MoE expert bias)."""
    ep: Optional[Any] = None
    """Expert-parallel group."""
    etp: Optional[Any] = None
    """Expert tensor-parallel group."""
    dp_cp: Optional[Any] = None
    """DP x CP group: the ranks that run the same layers (FP8 amax reduction of a model chunk)."""

    @staticmethod
    def from_state(ps) -> "ModelGroups":
        """The groups of a :class:`~folding.parallel.ParallelState` (PP is handled by the pipeline)."""
        return ModelGroups(
            tp=ps.tp_group,
            cp=ps.cp_group,
            tp_cp=ps.tp_cp_group,
            tp_dp_cp=ps.tp_dp_cp_group,
            ep=ps.ep_group,
            etp=ps.etp_group,
            dp_cp=ps.dp_cp_group,
        )

    @staticmethod
    def single() -> "ModelGroups":
        """No parallelism; only valid outside a ``torch.distributed`` job of several ranks."""
        if dist.is_initialized() and dist.get_world_size() > 1:
            raise ValueError(
                "torch.distributed is initialized with several ranks: pass parallel_state= "
                "(build_parallel_state(ParallelLayout(...))) to build the model"
            )
        return ModelGroups()

    @property
    def tp_size(self) -> int:
        """Size of the TP group."""
        return group_size(self.tp)

    @property
    def cp_size(self) -> int:
        """Size of the CP group."""
        return group_size(self.cp)

    @property
    def cp_rank(self) -> int:
        """This rank's index in CP."""
        return group_rank(self.cp)
