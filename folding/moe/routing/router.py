"""The MoE router: gate weight, top-k routing, capacity, load-balancing losses and expert bias.

The router runs on the *attention* layout: each rank routes its own local tokens
(``T = S·B/(TP·CP)``, the sequence-parallel chunk at the attention→MoE handoff), so it needs no
communication except small token-count all-reduces for the load-balancing losses (over the TP×CP
group, or TP×DP×CP for ``global_aux_loss``) and, once per global batch, for the expert-bias update.

Losses reach the gradient without changing the forward output: an identity on the returned
probabilities (z-loss: on the logits) whose backward also gives the loss the gradient
``aux_loss_scale``, i.e. the objective gains ``aux_loss_scale · loss``. Each rank's loss value is its
*share*: summed over the loss's group it is the loss of the whole micro-batch (see docs/routing.md).

Shape suffixes (docs/shapes.md): T local tokens, H hidden, E (global) experts, B sequences of the
micro-batch, S sequence positions.

Usage::

    router = Router(hidden_size=H, config=moe_cfg, groups=ps.groups, init_seed=seed, layer_number=i,
                    aux_loss_scale=1.0 / (num_microbatches * ps.coords.dp.size))
    out = router(hidden_SBH)                                          # or hidden_TH, num_sequences=B
    out.probs_TE, out.routing_map_TE                                  # after capacity
    out.stats.losses["aux_loss"], out.stats.tokens_per_expert_E       # this rank's share (detached), loads
    ...                                                               # after the global batch:
    update_expert_biases(routers, group=ps.groups.tp_dp_cp)           # folding.optim, if moe.expert_bias
    router.reset_global_aux_loss()
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from folding.moe.config import MoEConfig
from folding.moe.routing import functions as R
from folding.moe.routing.balancing import BalancingRouter, RoutingStats
from folding.parallel import collectives as C
from folding.parallel.groups import ProcessGroups
from folding.parallel.params import initialize_parameters, mark_param, set_init_spec

_DTYPES = {"fp32": torch.float32, "fp64": torch.float64}


class _AttachLossGrad(torch.autograd.Function):
    """Forward: identity on ``x`` (``loss`` is only carried along). Backward: ``x``'s gradient passes
    unchanged and ``loss`` receives the gradient ``scale``, as if ``scale·loss`` were in the objective."""

    @staticmethod
    def forward(ctx, x, loss, scale):
        ctx.save_for_backward(loss)
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad_x):
        (loss,) = ctx.saved_tensors
        return grad_x, torch.ones_like(loss) * ctx.scale, None


class _Gating(torch.autograd.Function):
    """``x·Wᵀ`` computed in ``dtype`` (fp32 or fp64) from ``x`` as it comes (bf16 in a bf16 run), which
    is what it keeps: the wide copy of ``x`` exists only inside forward and backward."""

    @staticmethod
    def forward(ctx, x_TH, w_EH, dtype):
        ctx.save_for_backward(x_TH, w_EH)
        ctx.dtype = dtype
        return F.linear(x_TH.to(dtype), w_EH.to(dtype))

    @staticmethod
    def backward(ctx, g_TE):
        x_TH, w_EH = ctx.saved_tensors
        g_TE = g_TE.to(ctx.dtype)
        gx = (g_TE @ w_EH.to(ctx.dtype)).to(x_TH.dtype) if ctx.needs_input_grad[0] else None
        gw = (g_TE.t() @ x_TH.to(ctx.dtype)).to(w_EH.dtype) if ctx.needs_input_grad[1] else None
        return gx, gw, None


def gating(x_TH: torch.Tensor, w_EH: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The router's logits ``[T, E] = x·Wᵀ`` in ``dtype`` (Megatron-Core's router gating: the GEMM in
    fp32, or fp64, from the activation-dtype input it keeps for backward; no wide copy of ``x`` is
    kept). Backward: ``grad·W`` cast to ``x``'s dtype and ``gradᵀ·x`` in ``dtype`` cast to ``W``'s."""
    return _Gating.apply(x_TH, w_EH, dtype)


def attach_loss(x: torch.Tensor, loss: torch.Tensor, scale: Union[float, torch.Tensor]) -> torch.Tensor:
    """Return ``x`` unchanged, wired so that back-propagating through it adds ``scale·∇loss``."""
    return _AttachLossGrad.apply(x, loss, scale)


@dataclasses.dataclass(frozen=True)
class RouterOutput:
    """What one :meth:`Router.forward` returns: the routing of this rank's tokens and its statistics."""

    probs_TE: torch.Tensor
    """Dense probabilities ``[T, E]`` in the router dtype, zero off the chosen experts (after
    capacity); the router losses are attached to them for the backward."""
    routing_map_TE: torch.Tensor
    """Bool ``[T, E]``: token t goes to expert e (after capacity)."""
    stats: RoutingStats
    """Loads, dropped pairs and this rank's share of each loss of the call (detached)."""


class Router(BalancingRouter):
    """Top-k router of one MoE layer with Megatron-Core's options (see :class:`MoEConfig`); the
    training step reads and updates it through :class:`~folding.moe.routing.balancing.BalancingRouter`.

    Args:
        hidden_size: model hidden size H.
        config: the MoE configuration (validated).
        groups: the rank's process groups; the router reads two attention groups: ``tp_cp``, the
            ranks whose token chunks form one micro-batch (aux_loss / seq_aux_loss token counts,
            z-loss share), and ``tp_dp_cp`` (global_aux_loss and expert-bias token counts).
        init_std: std of the normal initialization of the gate weight.
        init_seed: seed of the gate weight's initialization (``folding.parallel.params``: the same
            tensor on every rank and in every layout); ``None`` leaves it to the owner of the module
            (a model initializes all its parameters from their records at once).
        layer_number: the MoE layer's index (names the router in errors).

    Parameters and buffers: ``weight [E, H]`` (fp32, tagged ``sequence_parallel``: replicated over
    TP, partial gradients to sum over TP); ``expert_bias [E]`` (fp32, saved in checkpoints) and
    ``local_tokens_per_expert [E]`` when ``config.expert_bias``.
    """

    def __init__(
        self,
        *,
        hidden_size: int,
        config: MoEConfig,
        groups: ProcessGroups,
        init_std: float = 0.02,
        init_seed: Optional[int] = 0,
        layer_number: int = 0,
        device=None,
        aux_loss_scale: float = 1.0,
    ):
        super().__init__()
        if isinstance(hidden_size, bool) or not isinstance(hidden_size, int) or hidden_size < 1:
            raise ValueError(f"hidden_size={hidden_size!r} must be a positive integer")
        if not isinstance(config, MoEConfig):
            raise TypeError(f"config must be a folding.moe.config.MoEConfig (validated when built), got {type(config)}")
        self.config = config
        self.hidden_size = hidden_size
        self.layer_number = layer_number
        self.groups = groups
        """The process groups; the router reads ``groups.tp_cp`` and ``groups.tp_dp_cp``."""
        self.dtype = _DTYPES[config.router_dtype]
        E = config.num_experts
        self.weight = mark_param(
            nn.Parameter(torch.empty(E, hidden_size, dtype=torch.float32, device=device)), sequence_parallel=True
        )
        set_init_spec(self.weight, full_shape=(E, hidden_size), std=init_std)
        if config.expert_bias:
            self.register_buffer("expert_bias", torch.zeros(E, dtype=torch.float32, device=device))
            self.register_buffer(
                "local_tokens_per_expert", torch.zeros(E, dtype=torch.float32, device=device), persistent=False
            )
        else:
            self.register_buffer("expert_bias", None)
        self.register_buffer(
            "global_tokens_per_expert", torch.zeros(E, dtype=torch.float64, device=device), persistent=False
        )
        self.global_aux_steps = 0
        """Micro-batches accumulated into ``global_tokens_per_expert`` since the last reset."""
        self.aux_loss_scale: Union[float, torch.Tensor] = aux_loss_scale
        """Gradient given to each loss: the objective gains ``aux_loss_scale · loss`` per forward
        (a construction setting: 1 / (micro-batches · DP) in training,
        :attr:`folding.moe.settings.LayerSettings.aux_loss_scale`)."""

        if init_seed is not None and not self.weight.is_meta:
            initialize_parameters(self, init_seed)

    # ------------------------------------------------------------------------------- forward
    def forward(
        self,
        hidden: torch.Tensor,
        *,
        num_sequences: Optional[int] = None,
        padding_mask: Optional[torch.Tensor] = None,
        aux_loss_scale: Union[float, torch.Tensor, None] = None,
    ) -> RouterOutput:
        """Route this rank's tokens: scores → selection → capacity → losses → the record.

        Args:
            hidden: ``[S_local, B, H]`` (attention layout) or ``[T, H]`` with tokens ordered
                ``t = s·B + b``.
            num_sequences: B for ``[T, H]`` input; needed by ``seq_aux_loss`` only.
            padding_mask: bool, True on padding tokens, shaped like ``hidden`` without its last
                dim. Padding tokens are still routed but count in no loss and no expert-bias count.
            aux_loss_scale: overrides ``self.aux_loss_scale`` for this call.

        Returns a :class:`RouterOutput`: the dense probabilities in the router dtype (zero off the
        chosen experts) and the bool routing map, both after capacity, with the call's
        :class:`~folding.moe.routing.balancing.RoutingStats`.
        """
        cfg = self.config
        losses_on = self.training and torch.is_grad_enabled()
        aux_on = losses_on and cfg.aux_loss_type != "none" and cfg.aux_loss_coeff > 0
        hidden_TH, num_sequences, padding_mask_T = self._check_input(hidden, num_sequences, padding_mask, aux_on)
        scale = self.aux_loss_scale if aux_loss_scale is None else aux_loss_scale
        losses: Dict[str, torch.Tensor] = {}
        logits_TE = self._scores(hidden_TH, padding_mask_T, losses if losses_on else None, scale)
        # routing on the scores of all experts (pre-softmax, sigmoid) shares them with the aux loss: one copy kept
        full = cfg.score_function == "sigmoid" or cfg.pre_softmax
        scores_TE = R.full_scores(logits_TE, cfg.score_function) if full else None
        probs_TE, routed_TE = self._route(logits_TE, scores_TE)
        if cfg.expert_bias and losses_on:
            self._count_demand(routed_TE, padding_mask_T)
        probs_TE, routing_map_TE = self._capacity(probs_TE, routed_TE)
        if aux_on:
            losses[cfg.aux_loss_type] = self._aux_loss(logits_TE, num_sequences, padding_mask_T, scores_TE)
            probs_TE = attach_loss(probs_TE, losses[cfg.aux_loss_type], scale)
        return self._record(probs_TE, routed_TE, routing_map_TE, losses)

    def _check_input(self, hidden, num_sequences, padding_mask, aux_on: bool):
        """``(hidden_TH, num_sequences, padding_mask_T)`` from :meth:`forward`'s arguments, after
        checking their shapes (and, for ``seq_aux_loss``, that the tokens form the sequences)."""
        if hidden.dim() == 3:
            if num_sequences is not None and num_sequences != hidden.shape[1]:
                raise ValueError(f"num_sequences={num_sequences} but hidden has B={hidden.shape[1]}")
            num_sequences = hidden.shape[1]
        elif hidden.dim() != 2:
            raise ValueError(f"hidden must be [S, B, H] or [T, H], got shape {tuple(hidden.shape)}")
        if hidden.shape[-1] != self.hidden_size:
            raise ValueError(
                f"hidden has size {hidden.shape[-1]} in its last dim, the router expects hidden_size={self.hidden_size}"
            )
        hidden_TH = hidden.reshape(-1, self.hidden_size)
        if aux_on and self.config.aux_loss_type == "seq_aux_loss":
            if num_sequences is None:
                raise ValueError(
                    "moe.aux_loss_type=seq_aux_loss needs the sequences: pass hidden as "
                    "[S, B, H] or num_sequences=B with [T, H]"
                )
            if hidden_TH.shape[0] % num_sequences:
                raise ValueError(f"{hidden_TH.shape[0]} tokens are not a multiple of num_sequences={num_sequences}")
        if padding_mask is not None:
            if tuple(padding_mask.shape) != tuple(hidden.shape[:-1]):
                raise ValueError(
                    f"padding_mask has shape {tuple(padding_mask.shape)}, expected "
                    f"{tuple(hidden.shape[:-1])} (hidden without its last dim)"
                )
            padding_mask = padding_mask.reshape(-1).bool()
        return hidden_TH, num_sequences, padding_mask

    def _scores(self, hidden_TH, padding_mask_T, losses: Optional[Dict[str, torch.Tensor]], scale) -> torch.Tensor:
        """The gate's logits ``[T, E]`` in the router dtype (input jitter first, when training); with
        ``losses`` (a dict, when the losses are on) and ``z_loss_coeff``, the z-loss is added to it and
        attached to the returned logits."""
        cfg = self.config
        if self.training and cfg.input_jitter_eps:
            eps = cfg.input_jitter_eps
            hidden_TH = hidden_TH * torch.empty_like(hidden_TH).uniform_(1.0 - eps, 1.0 + eps)
        logits_TE = gating(hidden_TH, self.weight, self.dtype)
        if losses is None or not cfg.z_loss_coeff > 0:
            return logits_TE
        if padding_mask_T is None:
            total = logits_TE.shape[0] * C.group_size(self.groups.tp_cp)
        else:
            total = self._sum((~padding_mask_T).sum(), self.groups.tp_cp)
        losses["z_loss"] = R.z_loss(
            logits_TE, coeff=cfg.z_loss_coeff, padding_mask_T=padding_mask_T, total_num_tokens=total
        )
        return attach_loss(logits_TE, losses["z_loss"], scale)

    def _count_demand(self, routed_TE: torch.Tensor, padding_mask_T: Optional[torch.Tensor]) -> None:
        """Add the routed tokens per expert (valid tokens, before capacity) to ``local_tokens_per_expert``:
        demand before dropping, since saturated post-drop counts hide imbalance."""
        with torch.no_grad():
            demand_TE = routed_TE if padding_mask_T is None else routed_TE & ~padding_mask_T[:, None]
            self.local_tokens_per_expert += demand_TE.sum(dim=0).to(torch.float32)

    def _capacity(self, probs_TE: torch.Tensor, routed_TE: torch.Tensor):
        """``(probs_TE, routing_map_TE)`` after ``config.capacity_factor`` (unchanged without one)."""
        cfg = self.config
        if cfg.capacity_factor is None:
            return probs_TE, routed_TE
        return R.apply_capacity(
            probs_TE,
            routed_TE,
            topk=cfg.topk,
            capacity_factor=cfg.capacity_factor,
            drop_policy=cfg.drop_policy,
            pad_to_capacity=cfg.pad_to_capacity,
        )

    def _record(self, probs_TE, routed_TE, routing_map_TE, losses: Dict[str, torch.Tensor]) -> RouterOutput:
        """The call's :class:`RouterOutput`: loads after capacity, the pairs capacity dropped, and the
        losses' shares detached."""
        if self.config.capacity_factor is not None:
            dropped_E = (routed_TE & ~routing_map_TE).sum(dim=0)
        else:
            dropped_E = torch.zeros(routing_map_TE.shape[1], dtype=torch.int64, device=routing_map_TE.device)
        stats = RoutingStats(
            layer_number=self.layer_number,
            tokens_per_expert_E=routing_map_TE.sum(dim=0),
            dropped_per_expert_E=dropped_E,
            losses={k: v.detach() for k, v in losses.items()},
        )
        return RouterOutput(probs_TE=probs_TE, routing_map_TE=routing_map_TE, stats=stats)

    def _route(self, logits_TE: torch.Tensor, scores_TE: Optional[torch.Tensor]):
        cfg = self.config
        if cfg.force_balance:
            return R.balanced_routing(
                logits_TE,
                topk=cfg.topk,
                score_function=cfg.score_function,
                pre_softmax=cfg.pre_softmax,
                scaling_factor=cfg.topk_scaling_factor,
            )
        return R.topk_routing(
            logits_TE,
            topk=cfg.topk,
            score_function=cfg.score_function,
            pre_softmax=cfg.pre_softmax,
            num_groups=cfg.num_groups,
            group_topk=cfg.group_topk,
            scaling_factor=cfg.topk_scaling_factor,
            expert_bias_E=self.expert_bias,
            group_score_topk=cfg.group_score_topk,
            scores_TE=scores_TE,
        )

    def _aux_loss(
        self,
        logits_TE: torch.Tensor,
        num_sequences: Optional[int],
        padding_mask_T: Optional[torch.Tensor],
        full_scores_TE: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """This rank's share of the load-balancing loss (token counts reduced over its group).
        Token totals are T·group size, or with padding the valid tokens read off the reduced counts
        (each valid token counts ``topk`` times), which needs no extra collective."""
        cfg = self.config
        T, k = logits_TE.shape[0], cfg.topk
        kw = dict(topk=k, num_experts=cfg.num_experts, coeff=cfg.aux_loss_coeff)
        scores_TE, map_TE = R.aux_loss_scores(
            logits_TE,
            topk=k,
            score_function=cfg.score_function,
            padding_mask_T=padding_mask_T,
            scores_TE=full_scores_TE,
        )
        padded = padding_mask_T is not None
        if cfg.aux_loss_type == "aux_loss":
            counts_E = self._sum(map_TE.sum(dim=0), self.groups.tp_cp)
            total = (counts_E.sum() / k).clamp_min(1) if padded else T * C.group_size(self.groups.tp_cp)
            return R.switch_aux_loss(scores_TE, counts_E, total_num_tokens=total, **kw)
        if cfg.aux_loss_type == "seq_aux_loss":
            counts_BE = self._sum(R.tokens_per_sequence_expert(map_TE, num_sequences=num_sequences), self.groups.tp_cp)
            seq_length = counts_BE.sum(dim=1) / k if padded else T // num_sequences * C.group_size(self.groups.tp_cp)
            return R.seq_aux_loss(scores_TE, counts_BE, num_sequences=num_sequences, seq_length=seq_length, **kw)
        counts_E = self._sum(map_TE.sum(dim=0), self.groups.tp_dp_cp)
        with torch.no_grad():
            self.global_tokens_per_expert += counts_E.to(self.global_tokens_per_expert.dtype)
        self.global_aux_steps += 1
        mean_counts_E = self.global_tokens_per_expert / self.global_aux_steps
        total = (counts_E.sum() / k).clamp_min(1) if padded else T * C.group_size(self.groups.tp_dp_cp)
        return R.switch_aux_loss(scores_TE, mean_counts_E, total_num_tokens=total, **kw)

    def _sum(self, counts: torch.Tensor, group) -> torch.Tensor:
        """Forward: all-reduce (sum) of integer token counts over ``group``, as the router dtype.
        Backward: none (counts carry no gradient)."""
        with torch.no_grad():
            return C.all_reduce(counts.to(self.dtype), group)

    # ---------------------------------------------------------------- once per global batch
    @property
    def has_expert_bias(self) -> bool:
        """True with ``config.expert_bias`` (the ``expert_bias`` buffer exists)."""
        return self.expert_bias is not None

    def expert_demand(self) -> torch.Tensor:
        """``local_tokens_per_expert``: tokens routed to each expert before capacity, this rank."""
        if self.expert_bias is None:
            raise ValueError(f"router of layer {self.layer_number} has no expert bias (moe.expert_bias=false)")
        return self.local_tokens_per_expert

    def update_expert_bias(self, demand_E: torch.Tensor) -> None:
        """Move ``expert_bias`` by :func:`folding.moe.routing.functions.updated_expert_bias` at
        ``config.expert_bias_update_rate`` for the summed ``demand_E``; zero ``local_tokens_per_expert``."""
        rate = self.config.expert_bias_update_rate
        with torch.no_grad():
            self.expert_bias.copy_(R.updated_expert_bias(self.expert_bias, demand_E, rate=rate))
            self.expert_demand().zero_()

    @property
    def accumulates_global_aux_loss(self) -> bool:
        """True with ``config.aux_loss_type == "global_aux_loss"``."""
        return self.config.aux_loss_type == "global_aux_loss"

    def reset_global_aux_loss(self) -> None:
        """Forget the token counts of ``global_aux_loss`` (call once per global batch)."""
        self.global_tokens_per_expert.zero_()
        self.global_aux_steps = 0
