"""The MoE layer: router → token dispatcher → grouped experts → combine (+ optional shared expert).

Under parallel folding the attention layers leave ``[S/(TP·CP), B, H]`` on every rank: a distinct
chunk of tokens per attention rank (sequence parallelism is on whenever TP > 1). The handoff to the
MoE layer is a reshape to ``[T, H]``; the dispatcher then moves tokens across the *expert* view
(EP × ETP) of the same ranks and brings the results back in the input's shape.

- Router: :class:`folding.moe.routing.router.Router` on this rank's tokens (aux-loss counts over TP×CP).
- Dispatcher: ``config.dispatcher`` (``alltoall`` | ``allgather``) over ``groups.ep`` / ``groups.etp``.
- Experts: :class:`folding.moe.experts.grouped.GroupedMLP` holding experts ``[ep_rank·L, (ep_rank+1)·L)``
  with this ETP rank's slice of F; its output under ETP is a partial sum the dispatcher reduces.
- Hot-expert replicas (``config.expert_replicas``): the routing map is split onto ``EP·(L+R)``
  slots after the router (:func:`folding.moe.replicas.table.split_to_slots`), the dispatcher routes by
  slot, and the replica slots' weights are fetched from their owners once per step, their gradients
  returned once per step (:mod:`folding.moe.replicas.fetch`); the slot table is set between steps
  (:meth:`MoELayer.set_replica_table`).
- Shared expert (Qwen2-MoE): a dense SwiGLU on the *attention* TP group (:class:`SharedExpert`),
  optionally scaled by ``sigmoid(x·g)``.

Initialization is layout-independent: every weight records which slice of which full tensor it
holds (:mod:`folding.parallel.params`), and the full tensor is drawn from ``(init_seed, the
weight's name)``; expert weights one expert at a time, so a rank draws only its own experts.

Shape suffixes (docs/shapes.md): ``S`` local sequence, ``B`` batch (sequences), ``T`` local tokens, ``H`` hidden,
``E`` global experts, ``N`` rows after dispatch, ``F`` full FFN width (shared expert), ``Fl`` its TP
shard.

Usage::

    layer = MoELayer(config=moe_cfg, hidden_size=1024, groups=ps.groups, layer_number=3)
    out_SBH = layer(hidden_SBH)
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from folding.parallel import overlap
from folding.parallel.collectives import group_size
from folding.parallel.groups import ProcessGroups
from folding.parallel.linear import column_parallel_weight, row_parallel_linear, row_parallel_weight
from folding.parallel.params import initialize_parameters, mark_param, set_init_spec
from folding.parallel.sequence_parallel import gather_linears

from .config import MoEConfig
from .dispatch.build import dispatcher_for
from .experts.grouped import GroupedMLP
from .replicas.fetch import ReplicaWeights, completes_after_backward
from .replicas.table import check_replica_layout, check_table, empty_table, split_to_slots
from .routing.balancing import RoutedBlock, RoutingStats
from .routing.router import Router


class SharedExpert(nn.Module):
    """Dense SwiGLU on the attention TP group, fed by sequence-parallel tokens.

    The layers of a dense model's MLP (:class:`~folding.model.mlp.DenseMLP`) with gate and up fused in
    one column-parallel weight, built from the same tensor-parallel parts
    (:mod:`folding.parallel.linear`): all-gather of the TP group's tokens fused with fc1 (this rank's
    shard of gate and of up; backward: reduce-scatter), SwiGLU, row-parallel fc2 reduce-scattered
    back to this rank's tokens (backward: all-gather). With ``gate``, the output is scaled by
    ``sigmoid(x·g)`` computed on the local tokens.

    Parameters: ``fc1_weight [2·Fl, H]`` (rows ``[0:Fl]`` gate shard, ``[Fl:]`` up shard of the full
    ``[gate; up]`` of shape ``[2, F, H]``; ``tp_sharded``), ``fc2_weight [H, Fl]`` (``tp_sharded``),
    ``gate_weight [1, H]`` (replicated, ``sequence_parallel``).
    """

    def __init__(
        self,
        *,
        hidden_size: int,
        ffn_hidden_size: int,
        tp_group: Optional[dist.ProcessGroup],
        gate: bool,
        init_seed: Optional[int] = 0,
        init_std: float = 0.02,
        output_init_std: Optional[float] = None,
        params_dtype: torch.dtype = torch.float32,
        device=None,
    ):
        super().__init__()
        self.tp_group, self.hidden_size, self.ffn_hidden_size = tp_group, hidden_size, ffn_hidden_size
        self.ffn_local = ffn_hidden_size // group_size(tp_group)
        kw = dict(tp_group=tp_group, name="moe.shared_expert_ffn_hidden_size", dtype=params_dtype, device=device)
        out_std = init_std if output_init_std is None else output_init_std
        self.fc1_weight = column_parallel_weight(hidden_size, ffn_hidden_size, parts=2, init_std=init_std, **kw)
        self.fc2_weight = row_parallel_weight(ffn_hidden_size, hidden_size, init_std=out_std, **kw)
        self.gate_weight = None
        if gate:
            w = torch.empty(1, hidden_size, dtype=params_dtype, device=device)
            self.gate_weight = mark_param(nn.Parameter(w), sequence_parallel=True)
            set_init_spec(self.gate_weight, full_shape=(1, hidden_size), std=init_std)
        if init_seed is not None and not self.fc1_weight.is_meta:
            initialize_parameters(self, init_seed)

    def forward(self, tokens_TH: torch.Tensor) -> torch.Tensor:
        """Shared-expert output for this rank's tokens ``[T, H]``."""
        (h,) = gather_linears(tokens_TH, [self.fc1_weight], None, self.tp_group)
        gate, up = h.split(self.ffn_local, dim=-1)
        y = row_parallel_linear(F.silu(gate) * up, self.fc2_weight, self.tp_group)
        if self.gate_weight is not None:
            y = y * torch.sigmoid(F.linear(tokens_TH, self.gate_weight.to(tokens_TH.dtype)))
        return y


class MoELayer(nn.Module, RoutedBlock):
    """One MoE layer under parallel folding (see the module docstring).

    Each training-mode forward adds its router's :class:`~folding.moe.routing.balancing.RoutingStats`
    to the layer's sum, which the training step takes once per step (:meth:`take_routing_stats`).

    Args:
        config: the MoE settings (experts, top-k, capacity, dispatcher, wires, shared expert...).
        hidden_size: H.
        groups: the rank's process groups: the expert view's ``ep`` and ``etp`` (token exchange;
            ETP shards expert F), the attention view's ``tp_cp`` and ``tp_dp_cp`` (the router's
            counts) and ``tp`` (shared expert).
        layer_number: index of the layer (names it in errors).
        init_seed: seed of the initialization of every weight of the layer, each drawn from its record
            and its name in the layer (:mod:`folding.parallel.params`); ``None`` leaves them to the
            owner (a model initializes all its parameters, named in the model, at once).
        init_std: std of the initial weights (router, fc1, shared-expert gate).
        output_init_std: std of the expert and shared-expert fc2 (which write into the residual
            stream); default ``init_std``. A model passes ``ModelConfig.output_init_std``.
        params_dtype: dtype of the expert and shared-expert parameters (the router keeps fp32).
        device: where every parameter and buffer is created (``meta``: nothing is allocated or
            initialized; :func:`folding.parallel.params.materialize` allocates and fills them).
    """

    def __init__(
        self,
        *,
        config: MoEConfig,
        hidden_size: int,
        groups: ProcessGroups,
        layer_number: int = 0,
        init_seed: Optional[int] = 0,
        init_std: float = 0.02,
        output_init_std: Optional[float] = None,
        params_dtype: torch.dtype = torch.float32,
        device=None,
    ):
        super().__init__()
        if not isinstance(config, MoEConfig):
            raise TypeError(f"config must be a folding.moe.config.MoEConfig (validated when built), got {type(config)}")
        self.config, self.hidden_size, self.layer_number = config, hidden_size, layer_number
        self.num_replicas = config.expert_replicas
        ep = group_size(groups.ep)
        slots = None
        if self.num_replicas:
            check_replica_layout(config, ep)
            slots = ep * (config.num_experts // ep + self.num_replicas)
        self.dispatcher = dispatcher_for(config, groups, num_slots=slots)
        d = self.dispatcher
        num_local = d.num_local_experts - self.num_replicas
        self.replica_table = empty_table(ep, self.num_replicas)
        """The slot table (:mod:`folding.moe.replicas.table`): the expert each replica slot computes; all
        empty until the first plan (:meth:`set_replica_table`)."""
        self.router = Router(
            hidden_size=hidden_size,
            config=config,
            groups=groups,
            init_std=init_std,
            init_seed=None,
            layer_number=layer_number,
            device=device,
        )
        self.experts = GroupedMLP(
            num_experts=config.num_experts,
            num_local_experts=num_local,
            hidden_size=hidden_size,
            ffn_hidden_size=config.ffn_hidden_size,
            etp_size=d.etp_size,
            etp_rank=d.etp_rank,
            expert_offset=d.ep_rank * num_local,
            backend=config.expert_backend,
            fp8_recipe=config.fp8_recipe,
            params_dtype=params_dtype,
            init_std=init_std,
            output_init_std=output_init_std,
            init_seed=None,
            device=device,
        )
        self.replica_weights = ReplicaWeights()
        """The replica slots' weights of the current step and their gathered gradients."""
        if self.num_replicas:  # the replicas' gradients reach these after the backward (replica_step)
            completes_after_backward(self.experts.fc1_weight)
            completes_after_backward(self.experts.fc2_weight)
        self.shared_expert: Optional[SharedExpert] = None
        if config.shared_expert_ffn_hidden_size is not None:
            self.shared_expert = SharedExpert(
                hidden_size=hidden_size,
                ffn_hidden_size=config.shared_expert_ffn_hidden_size,
                tp_group=groups.tp,
                gate=config.shared_expert_gate,
                init_seed=None,
                init_std=init_std,
                output_init_std=output_init_std,
                params_dtype=params_dtype,
                device=device,
            )
        self.overlap_comm = False
        """Compute the shared expert while this micro-batch's dispatch is in flight (set by the model
        from ``parallel.overlap_moe_comm``; the numbers do not change, only the order of the work)."""
        if init_seed is not None and not self.router.weight.is_meta:
            initialize_parameters(self, init_seed)

    _routing_stats: Optional[RoutingStats] = None
    """The sum of the routing statistics of the training forwards since the last :meth:`take_routing_stats`."""

    def take_routing_stats(self) -> Optional[RoutingStats]:
        """The sum of the routing statistics of the training forwards since the last call (``None``
        if there were none), and forget them."""
        taken, self._routing_stats = self._routing_stats, None
        return taken

    def replica_geometry(self) -> dict:
        """``ep_size``, ``num_local_experts`` and ``num_replicas`` of this layer's slots (the keyword
        arguments of the :mod:`folding.moe.replicas.table` functions)."""
        return dict(
            ep_size=self.dispatcher.ep_size,
            num_local_experts=self.experts.num_local_experts,
            num_replicas=self.num_replicas,
        )

    def _replica_weights(self, geo: dict):
        """``(fc1 [R, 2·Fl, H], fc2 [R, H, Fl])`` of the replica slots: inside a step
        (:func:`folding.moe.replicas.fetch.replica_step`) fetched from their owners by the step's first
        forward and kept; otherwise fetched now (one exchange, only the experts sent)."""
        return self.replica_weights.weights(
            self.experts.fc1_weight,
            self.experts.fc2_weight,
            self.replica_table,
            ep_group=self.dispatcher.ep_group,
            ep_size=geo["ep_size"],
            ep_rank=self.dispatcher.ep_rank,
        )

    def replica_owners(self):
        """``(fc1, fc2)``: the parameters the replicas' gradients are returned to."""
        return self.experts.fc1_weight, self.experts.fc2_weight

    def set_replica_table(self, table) -> None:
        """Install a slot table (every rank of the layer's EP×ETP domain must install the same one,
        between steps; :class:`folding.moe.replicas.table.ReplicaSchedule` does)."""
        if not self.num_replicas:
            raise ValueError("this MoE layer has no replica slots; set moe.expert_replicas > 0")
        check_table(table, **self.replica_geometry())
        if self.replica_weights.in_step:
            raise RuntimeError("set_replica_table inside a step; install slot tables between steps")
        self.replica_table = tuple(int(e) for e in table)

    def forward(
        self, hidden: torch.Tensor, *, num_sequences: Optional[int] = None, padding_mask: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """``hidden`` ``[S_local, B, H]`` or ``[T, H]`` (this attention rank's tokens) → the same shape.

        ``num_sequences`` and ``padding_mask`` are passed to the router (see ``Router.forward``):
        padding tokens are routed and computed like others but count in no loss.
        """
        # hidden's shape: checked by the router, the first to read it (before any collective)
        routed = self.router(hidden, num_sequences=num_sequences, padding_mask=padding_mask)
        if self.training:
            kept = self._routing_stats
            self._routing_stats = routed.stats if kept is None else kept + routed.stats
        probs_TE, routing_map_TE = routed.probs_TE, routed.routing_map_TE
        shared = None
        if self.shared_expert is not None:
            tokens_TH = hidden.reshape(-1, self.hidden_size)
            if self.overlap_comm:  # computed while this micro-batch's dispatch is in flight
                shared = overlap.defer(lambda: self.shared_expert(tokens_TH))
        replica_weights = None
        if self.num_replicas:  # route by slot; the replica slots' weights come from their owners
            geo = self.replica_geometry()
            routing_map_TE, probs_TE = split_to_slots(routing_map_TE, probs_TE, self.replica_table, **geo)
            replica_weights = self._replica_weights(geo)
        tokens_NH, record, probs_N = self.dispatcher.dispatch(hidden, routing_map_TE, probs_TE)
        out = self.dispatcher.combine(self.experts(tokens_NH, record, probs_N, replica_weights), record)
        if self.shared_expert is not None:
            y = shared.result() if shared is not None else self.shared_expert(tokens_TH)
            out = out + y.reshape(out.shape)
        return out
