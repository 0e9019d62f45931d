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

    layer = build_moe_layer(moe_cfg, hidden_size=1024, groups=ps.groups, layer_number=3,
                            settings=LayerSettings(init_seed=1, overlap_comm=True))
    out_SBH = layer(hidden_SBH)
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from folding.overlap.backward_turn import turn_in_backward
from folding.overlap.runtime import defer, recompute_contexts
from folding.parallel.collectives import group_size
from folding.parallel.groups import ProcessGroups
from folding.parallel.linear import column_parallel_weight, row_parallel_linear, row_parallel_weight
from folding.parallel.params import initialize_parameters, mark_param, set_init_spec
from folding.parallel.sequence_parallel import gather_linears

from .config import MoEConfig
from .dispatch.build import dispatcher_for
from .experts.grouped import GroupedMLP
from .experts.swiglu import swiglu
from .replicas.fetch import ReplicaWeights, completes_after_backward
from .replicas.table import IndexCache, check_replica_layout, check_table, empty_table, split_to_slots
from .routing.balancing import RoutedBlock, RoutingStats
from .routing.router import Router
from .settings import LayerSettings


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
    ``gate_weight [1, H]`` (replicated, ``sequence_parallel``). ``settings``: their dtype, device and
    initialization seed (:class:`~folding.moe.settings.LayerSettings`); ``recompute``: see the attribute.
    """

    def __init__(
        self,
        *,
        hidden_size: int,
        ffn_hidden_size: int,
        tp_group: Optional[dist.ProcessGroup],
        gate: bool,
        init_std: float = 0.02,
        output_init_std: Optional[float] = None,
        settings: LayerSettings = LayerSettings(),
        recompute: bool = False,
    ):
        super().__init__()
        self.recompute = recompute
        """The ``shared_experts`` recompute module: the forward runs under a checkpoint (only its input
        is kept; it runs again, with its TP collectives, in backward)."""
        self.tp_group, self.hidden_size, self.ffn_hidden_size = tp_group, hidden_size, ffn_hidden_size
        self.ffn_local = ffn_hidden_size // group_size(tp_group)
        dtype, device = settings.params_dtype, settings.device
        kw = dict(tp_group=tp_group, name="moe.shared_expert_ffn_hidden_size", dtype=dtype, device=device)
        out_std = init_std if output_init_std is None else output_init_std
        self.fc1_weight = column_parallel_weight(hidden_size, ffn_hidden_size, parts=2, init_std=init_std, **kw)
        self.fc2_weight = row_parallel_weight(ffn_hidden_size, hidden_size, init_std=out_std, **kw)
        self.gate_weight = None
        if gate:
            w = torch.empty(1, hidden_size, dtype=dtype, device=device)
            self.gate_weight = mark_param(nn.Parameter(w), sequence_parallel=True)
            set_init_spec(self.gate_weight, full_shape=(1, hidden_size), std=init_std)
        self.delay_wgrad = settings.delay_wgrad
        """fc1's and fc2's weight gradients are computed behind the backward's next exchange
        (``parallel.delay_wgrad``, :mod:`folding.overlap.wgrad`)."""
        if settings.init_seed is not None and not self.fc1_weight.is_meta:
            initialize_parameters(self, settings.init_seed)

    def forward(self, tokens_TH: torch.Tensor) -> torch.Tensor:
        """Shared-expert output for this rank's tokens ``[T, H]``."""
        if self.recompute and torch.is_grad_enabled():
            return checkpoint(self._forward, tokens_TH, use_reentrant=False, context_fn=recompute_contexts)
        return self._forward(tokens_TH)

    def _forward(self, tokens_TH: torch.Tensor) -> torch.Tensor:
        delay = self.delay_wgrad
        (h,) = gather_linears(tokens_TH, [self.fc1_weight], None, self.tp_group, delay_wgrad=delay)
        gate, up = h.split(self.ffn_local, dim=-1)
        y = row_parallel_linear(swiglu(gate, up), self.fc2_weight, self.tp_group, delay_wgrad=delay)
        if self.gate_weight is not None:
            y = y * torch.sigmoid(F.linear(tokens_TH, self.gate_weight.to(tokens_TH.dtype)))
        return y


def build_moe_layer(
    config: MoEConfig,
    *,
    hidden_size: int,
    groups: ProcessGroups,
    layer_number: int = 0,
    init_std: float = 0.02,
    output_init_std: Optional[float] = None,
    settings: LayerSettings = LayerSettings(),
    recompute_act: bool = False,
    recompute_shared_expert: bool = False,
) -> "MoELayer":
    """An :class:`MoELayer` and its parts made from ``config``: router, dispatcher, this rank's experts
    (and replica slots), shared expert. ``groups``: the expert view's ``ep``/``etp`` (token exchange,
    ETP shards F), the attention view's ``tp_cp``/``tp_dp_cp`` (router counts) and ``tp`` (shared
    expert). ``init_std``: router, fc1 and gate weights; ``output_init_std``: the fc2s, which write
    into the residual stream (default ``init_std``). ``settings``
    (:class:`~folding.moe.settings.LayerSettings`): dtype (the router keeps fp32), device (``meta``
    allocates nothing), ``init_seed`` (each weight drawn from its name in the layer; ``None``: left to
    the owner), ``overlap_comm``, ``delay_wgrad``, ``expert_backend`` (resolved here when absent).
    ``recompute_act`` / ``recompute_shared_expert``: the ``moe_act`` / ``shared_experts`` recompute modules
    (:attr:`GroupedMLP.recompute_act`, :attr:`SharedExpert.recompute`)."""
    if not isinstance(config, MoEConfig):
        raise TypeError(f"config must be a folding.moe.config.MoEConfig (validated when built), got {type(config)}")
    settings = settings.with_expert_backend(config)
    ep = group_size(groups.ep)
    slots = None
    if config.expert_replicas:
        check_replica_layout(config, ep)
        slots = ep * (config.num_experts // ep + config.expert_replicas)
    d = dispatcher_for(config, groups, num_slots=slots)
    if config.ffn_hidden_size % d.etp_size:
        raise ValueError(
            f"config.ffn_hidden_size={config.ffn_hidden_size} is not divisible by the size {d.etp_size} "
            "of etp_group; use an ETP group whose size divides it"
        )
    std = dict(init_std=init_std, output_init_std=output_init_std)
    router = Router(
        hidden_size=hidden_size,
        config=config,
        groups=groups,
        init_std=init_std,
        init_seed=None,
        layer_number=layer_number,
        device=settings.device,
        aux_loss_scale=settings.aux_loss_scale,
    )
    layer = MoELayer(
        config=config,
        hidden_size=hidden_size,
        layer_number=layer_number,
        router=router,
        dispatcher=d,
        experts=_experts(config, d, hidden_size, settings, recompute_act=recompute_act, **std),
        shared_expert=_shared_expert(config, groups, hidden_size, settings, recompute=recompute_shared_expert, **std),
        overlap_comm=settings.overlap_comm,
    )
    if settings.init_seed is not None and not router.weight.is_meta:
        initialize_parameters(layer, settings.init_seed)
    return layer


def _shared_expert(
    config: MoEConfig, groups: ProcessGroups, hidden_size: int, settings: LayerSettings, *, recompute: bool, **std
) -> Optional[SharedExpert]:
    """The shared expert on the attention TP group (``config.shared_expert_ffn_hidden_size``), or None."""
    if config.shared_expert_ffn_hidden_size is None:
        return None
    return SharedExpert(
        hidden_size=hidden_size,
        ffn_hidden_size=config.shared_expert_ffn_hidden_size,
        tp_group=groups.tp,
        gate=config.shared_expert_gate,
        settings=settings.replace(init_seed=None),
        recompute=recompute,
        **std,
    )


def _experts(
    config: MoEConfig, d, hidden_size: int, settings: LayerSettings, *, recompute_act: bool, **std
) -> GroupedMLP:
    """This rank's experts behind dispatcher ``d`` (its local experts, after them the replica slots'
    counts), on the backend ``settings`` carries."""
    num_local = d.num_local_experts - config.expert_replicas
    return GroupedMLP(
        num_experts=config.num_experts,
        num_local_experts=num_local,
        hidden_size=hidden_size,
        ffn_hidden_size=config.ffn_hidden_size,
        etp_size=d.etp_size,
        etp_rank=d.etp_rank,
        expert_offset=d.ep_rank * num_local,
        backend=settings.expert_backend,
        fp8_recipe=config.fp8_recipe,
        params_dtype=settings.params_dtype,
        init_seed=None,
        device=settings.device,
        delay_wgrad=settings.delay_wgrad,
        recompute_act=recompute_act,
        fp8_act_input_store=config.fp8_act_input_store,
        **std,
    )


class MoELayer(nn.Module, RoutedBlock):
    """One MoE layer under parallel folding (see the module docstring), built from its parts
    (:func:`build_moe_layer` makes them from the config).

    Each training-mode forward adds its router's :class:`~folding.moe.routing.balancing.RoutingStats`
    to the layer's sum, which the training step takes once per step (:meth:`take_routing_stats`).

    Args:
        config: the MoE settings the parts were made from (replica slots, the layer's record).
        hidden_size: H.
        layer_number: index of the layer (names it in errors).
        router: the :class:`~folding.moe.routing.router.Router` of this layer's tokens.
        dispatcher: the token dispatcher on the expert groups (``config.dispatcher``).
        experts: this rank's :class:`~folding.moe.experts.grouped.GroupedMLP` (local experts, then
            ``config.expert_replicas`` replica slots' worth of counts).
        shared_expert: the :class:`SharedExpert`, or ``None``.
        overlap_comm: compute the shared expert while this micro-batch's dispatch is in flight: before
            its count read where the dispatcher reads counts (it needs none), else at its token
            exchange's wait (``parallel.overlap_moe_comm``; the numbers do not change, only the order of
            the work).
    """

    def __init__(
        self,
        *,
        config: MoEConfig,
        hidden_size: int,
        layer_number: int = 0,
        router: nn.Module,
        dispatcher,
        experts: GroupedMLP,
        shared_expert: Optional[SharedExpert] = None,
        overlap_comm: bool = False,
    ):
        super().__init__()
        self.config, self.hidden_size, self.layer_number = config, hidden_size, layer_number
        self.num_replicas = config.expert_replicas
        self.dispatcher = dispatcher
        self.replica_table = empty_table(dispatcher.ep_size, self.num_replicas)
        """The slot table (:mod:`folding.moe.replicas.table`): the expert each replica slot computes; all
        empty until the first plan (:meth:`set_replica_table`)."""
        self.router = router
        self.experts = experts
        self.shared_expert = shared_expert
        self.overlap_comm = overlap_comm
        """Compute the shared expert while this micro-batch's dispatch is in flight (a construction
        setting, :class:`~folding.moe.settings.LayerSettings`)."""
        self.slot_index = IndexCache()
        """The index tensors of the slot table for the token split, built once per table."""
        self.replica_weights = ReplicaWeights()
        """The replica slots' weights of the current step and their gathered gradients."""
        if self.num_replicas:  # the replicas' gradients reach these after the backward (replica_step)
            completes_after_backward(self.experts.fc1_weight)
            completes_after_backward(self.experts.fc2_weight)

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
        if self.overlap_comm and self.dispatcher.counts_hand_over:
            # the forward hands over three times per layer (count read, dispatch, combine): the backward
            # gets its third turn where this layer's input gradient is ready
            hidden = turn_in_backward(hidden)
        routed = self.router(hidden, num_sequences=num_sequences, padding_mask=padding_mask)
        if self.training:
            kept = self._routing_stats
            self._routing_stats = routed.stats if kept is None else kept + routed.stats
        probs_TE, routing_map_TE = routed.probs_TE, routed.routing_map_TE
        shared = None
        if self.shared_expert is not None:
            tokens_TH = hidden.reshape(-1, self.hidden_size)
            if self.overlap_comm:  # while this dispatch is in flight: before its count read, or at its exchange
                shared = defer(lambda: self.shared_expert(tokens_TH))
        replica_weights = None
        if self.num_replicas:  # route by slot; the replica slots' weights come from their owners
            geo = self.replica_geometry()
            routing_map_TE, probs_TE = split_to_slots(
                routing_map_TE, probs_TE, self.replica_table, **geo, cache=self.slot_index
            )
            replica_weights = self._replica_weights(geo)
        tokens_NH, record, probs_N = self.dispatcher.dispatch(hidden, routing_map_TE, probs_TE)
        out = self.dispatcher.combine(self.experts(tokens_NH, record, probs_N, replica_weights), record)
        if self.shared_expert is not None:
            y = shared.result() if shared is not None else self.shared_expert(tokens_TH)
            out = out + y.reshape(out.shape)
        return out
