"""The base of the token dispatchers: argument checks, the per-call record, ``dispatch`` and
``combine`` composed of six per-call stages (``_preprocess``, ``_exchange``, ``_postprocess``,
``_combine_pre``, ``_combine_exchange``, ``_combine_post``) that an adapter can call one by one
(:class:`folding.interop.megatron.stages.MegatronDispatcher` drives them as Megatron-Core's six-stage
interface; see :func:`~folding.moe.dispatch.build.build_dispatcher`).

A dispatcher holds configuration and groups only. Each call's state (plan, token indices, shapes,
per-expert counts on the host and the device, byte counts) is a :class:`DispatchRecord` that
``dispatch`` returns and that the experts and ``combine`` take back, so any number of micro-batches
can be in flight through one dispatcher. Between the stages of one call, a :class:`DispatchCall`
carries the record built so far and what lives only until it is complete (counts in flight).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional, Tuple

import torch
import torch.distributed as dist

from ...parallel.collectives import group_rank
from .wire import check_wire, check_wire_format


def _group_ranks(group, name: str):
    if not dist.is_initialized():  # a single process without torch.distributed: a 1x1 expert domain
        if group is not None:
            raise ValueError(
                f"{name} is given but torch.distributed is not initialized; pass None for a "
                "single-process model, or initialize the process group first"
            )
        return [0]
    try:
        return dist.get_process_group_ranks(group)
    except Exception as e:  # not a group this rank belongs to, or not a group at all
        raise ValueError(
            f"{name} is not a process group this rank belongs to ({e}); pass the group of the "
            f"expert view that contains this rank (e.g. ParallelState.{name})"
        ) from None


@dataclasses.dataclass(frozen=True)
class DispatchRecord:
    """One dispatch call's state, returned by ``dispatch`` and handed to the experts and ``combine``.

    The stages build it as they learn its fields (:class:`DispatchCall` holds the record so far and
    replaces it); the one handed out by ``dispatch`` has every field its dispatcher fills.

    Shape-suffix legend: ``L`` local experts (see docs/shapes.md).
    """

    hidden_shape: Tuple[int, ...]
    """Shape of the ``hidden`` the call was given (``[S, B, H]`` or ``[T, H]``); combine restores it."""
    hidden_size: int
    """H."""
    dtype: torch.dtype
    """Activation dtype of the rows."""
    num_tokens: int
    """T, this rank's tokens."""
    token_idx: Optional[torch.Tensor] = None
    """Source token of every permuted row (what the combine's unpermute sums into)."""
    tokens_per_expert: Optional[torch.Tensor] = None
    """Rows per local expert ``[L]`` (int64, on the rows' device; derived there, no host copy)."""
    tokens_per_expert_host: Tuple[int, ...] = ()
    """The same counts as Python ints, known on the host from the split sizes (for backends that
    need host sizes, such as TransformerEngine's ``m_splits``)."""
    stats: Dict[str, Any] = dataclasses.field(default_factory=dict)
    """Byte and row counts of this call (host numbers, no sync needed)."""
    plan: Any = None
    """The call's route: all-to-all, its :class:`~folding.moe.dispatch.permute.AllToAllPlan` (host
    split sizes); hierarchical, its :class:`~folding.moe.dispatch.hier_exchange.HierRoute`."""
    sliced: bool = False
    """All-to-all: rows exchanged one call per local expert (``per_expert_exchange``)."""
    chunks_sorted: bool = False
    """All-to-all: the rank-major chunks are already expert-major (no sort or unsort)."""
    etp_padded: bool = False
    """All-to-all: the expert side holds its ETP-exchanged rows in padded blocks (uneven ETP sizes)."""
    num_gathered: int = 0
    """All-gather: G, the rows after the gather (every rank's tokens)."""


@dataclasses.dataclass
class DispatchCall:
    """One dispatch call in progress, between ``_preprocess`` and ``_postprocess``: the record so far
    and the fields that live only until the record is complete (never kept by a dispatcher; the
    six-stage adapter holds one between its stages).

    Shape-suffix legend: ``T`` local tokens, ``Tg`` gathered tokens, ``E`` experts (docs/shapes.md).
    """

    record: DispatchRecord
    """What the call knows so far (frozen: :meth:`learn` replaces it)."""
    routing_map_TE: Optional[torch.Tensor] = None
    """All-gather, hierarchical: the routing map the exchange moves or reads."""
    map_TgE: Optional[torch.Tensor] = None
    """All-gather: the routing map gathered over ETP×EP."""
    counts_dev: Optional[torch.Tensor] = None
    """All-to-all, hierarchical: the gathered per-expert counts ``[EP, ETP, *]`` on the device."""
    counts_work: Any = None
    """The EP count all-gather in flight (all-to-all: its :class:`~folding.overlap.exchange.Exchange`;
    hierarchical: its work handle), ``None`` once waited for."""

    def learn(self, **fields) -> None:
        """Replace the record by one with ``fields`` set (names of :class:`DispatchRecord` only)."""
        self.record = dataclasses.replace(self.record, **fields)


class TokenDispatcher:
    """Shared validation and the ``dispatch`` / ``combine`` shortcuts (see the module docstring).

    Args:
        num_experts: E, the global number of experts.
        topk: experts per token.
        ep_group: the expert-parallel group (EP ranks own disjoint expert slices).
        etp_group: the expert-tensor-parallel group (ranks sharing the same experts, F sharded).
        num_local_experts: optional check: must equal ``E / EP``.
        capacity_factor: ``None`` for dropless; otherwise the map is capacity-limited by the router.
        pad_to_capacity: every expert receives exactly ``min(capacity, T)`` rows from every rank
            (static shapes, no host sync). Needs ``capacity_factor``.
        dispatch_wire, combine_wire, grad_wire: ``none`` | ``fp8`` | ``mxfp8`` (see ``folding.moe.dispatch.wire``).
    """

    def __init__(
        self,
        *,
        num_experts: int,
        topk: int,
        ep_group,
        etp_group,
        num_local_experts: Optional[int] = None,
        capacity_factor: Optional[float] = None,
        pad_to_capacity: bool = False,
        dispatch_wire: str = "none",
        combine_wire: str = "none",
        grad_wire: str = "none",
    ):
        if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
            raise ValueError(f"num_experts={num_experts!r} must be a positive integer")
        if not 1 <= topk <= num_experts:
            raise ValueError(f"topk={topk} must be in [1, num_experts={num_experts}]")
        ep_ranks = _group_ranks(ep_group, "ep_group")
        etp_ranks = _group_ranks(etp_group, "etp_group")
        self.ep_size, self.etp_size = len(ep_ranks), len(etp_ranks)
        if num_experts % self.ep_size:
            raise ValueError(
                f"num_experts={num_experts} is not divisible by the EP group size {self.ep_size}; "
                f"choose parallel.ep among the divisors of {num_experts}"
            )
        me = dist.get_rank() if dist.is_initialized() else 0
        shared = set(ep_ranks) & set(etp_ranks)
        if shared != {me}:
            raise ValueError(
                f"ep_group {ep_ranks} and etp_group {etp_ranks} must meet only at this rank "
                f"({me}); they look like the same or mismatched groups: pass "
                f"ParallelState.groups.ep and ParallelState.groups.etp of the same layout"
            )
        self.num_local_experts = num_experts // self.ep_size
        if num_local_experts is not None and num_local_experts != self.num_local_experts:
            raise ValueError(
                f"num_local_experts={num_local_experts} but num_experts/EP = {num_experts}/"
                f"{self.ep_size} = {self.num_local_experts}"
            )
        self.capacity_factor, self.pad_to_capacity = capacity_factor, pad_to_capacity
        self._check_capacity()
        for name, fmt in (("dispatch_wire", dispatch_wire), ("combine_wire", combine_wire), ("grad_wire", grad_wire)):
            check_wire_format(f"moe.{name}", fmt)
        self.num_experts, self.topk = num_experts, topk
        self.ep_group, self.etp_group = ep_group, etp_group
        self.ep_rank, self.etp_rank = group_rank(ep_group), group_rank(etp_group)
        self.dispatch_wire, self.combine_wire, self.grad_wire = dispatch_wire, combine_wire, grad_wire
        self.local_expert_offset = self.ep_rank * self.num_local_experts

    def _check_capacity(self) -> None:
        """The capacity settings as they are now: checked when built, and again by an adapter that
        changes them between calls (never per call)."""
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ValueError(f"capacity_factor={self.capacity_factor!r} must be > 0, or None for dropless")
        if self.pad_to_capacity and self.capacity_factor is None:
            raise ValueError("pad_to_capacity=True needs a capacity_factor (set moe.capacity_factor, e.g. 1.0)")

    @property
    def dropless(self) -> bool:
        """True when no token is ever dropped (``capacity_factor is None``)."""
        return self.capacity_factor is None

    @property
    def counts_hand_over(self) -> bool:
        """Whether a dispatch gathers token counts over EP and hands the baton of an overlap pair over at
        their read (a third hand-over per layer in the forward; the MoE layer then gives the backward a
        third, :func:`folding.overlap.backward_turn.turn_in_backward`). None here; the all-to-all
        dispatchers say when."""
        return False

    def _validate(self, hidden: torch.Tensor, routing_map_TE: torch.Tensor, probs_TE: torch.Tensor) -> int:
        """Check the call's shapes and the wire formats against its dtype and H (before any collective;
        the settings themselves were checked when built); return H."""
        assert not self.pad_to_capacity or self.capacity_factor is not None, "checked by _check_capacity"
        if hidden.dim() not in (2, 3):
            raise ValueError(f"hidden must be [S, B, H] or [T, H], got shape {tuple(hidden.shape)}")
        H = hidden.shape[-1]
        T = hidden.numel() // H
        if routing_map_TE.shape != (T, self.num_experts) or routing_map_TE.dtype != torch.bool:
            raise ValueError(
                f"routing_map must be bool [T={T}, E={self.num_experts}], got "
                f"{routing_map_TE.dtype} {tuple(routing_map_TE.shape)}"
            )
        if probs_TE.shape != (T, self.num_experts):
            raise ValueError(f"probs must be [T={T}, E={self.num_experts}], got {tuple(probs_TE.shape)}")
        for name in ("dispatch_wire", "combine_wire", "grad_wire"):
            check_wire(f"moe.{name}", getattr(self, name), hidden.dtype, H)
        return H

    # ------------------------------------------------------- per-call stages (subclasses)
    def _preprocess(self, hidden, routing_map, probs):  # pragma: no cover - interface
        """Local work before the dispatch communication: ``(rows, probs, call)``, ``call`` the
        :class:`DispatchCall` of this call (its record so far, pending count gather)."""
        raise NotImplementedError

    def _exchange(self, rows, probs, call: DispatchCall):  # pragma: no cover - interface
        """The dispatch communication: ``(rows, probs)``."""
        raise NotImplementedError

    def _postprocess(self, rows, probs, call: DispatchCall):  # pragma: no cover - interface
        """Local work after it: ``(tokens_NH, record, probs_N)``, expert-major."""
        raise NotImplementedError

    def _combine_pre(self, out, record: DispatchRecord):  # pragma: no cover - interface
        """Local work on the experts' output before the combine communication."""
        raise NotImplementedError

    def _combine_exchange(self, out, record: DispatchRecord):  # pragma: no cover - interface
        """The combine communication."""
        raise NotImplementedError

    def _combine_post(self, out, record: DispatchRecord):  # pragma: no cover - interface
        """Local work after it: the shape ``hidden`` had (unweighted sum of each token's rows)."""
        raise NotImplementedError

    # ------------------------------------------------------------------- dispatch / combine
    def dispatch(
        self, hidden: torch.Tensor, routing_map_TE: torch.Tensor, probs_TE: torch.Tensor
    ) -> Tuple[torch.Tensor, DispatchRecord, torch.Tensor]:
        """Move this rank's tokens to their experts: ``(tokens_NH, record, probs_N)``, the rows
        expert-major. ``record`` (:class:`DispatchRecord`) carries the per-expert counts
        (``record.tokens_per_expert`` on the device, ``record.tokens_per_expert_host`` as a tuple)
        and everything :meth:`combine` needs; nothing of the call stays on the dispatcher."""
        rows, probs, call = self._preprocess(hidden, routing_map_TE, probs_TE)
        rows, probs = self._exchange(rows, probs, call)
        return self._postprocess(rows, probs, call)

    def combine(self, out_NH: torch.Tensor, record: DispatchRecord) -> torch.Tensor:
        """Expert output rows back to the input's shape (unweighted sum), for the call of ``record``."""
        out = self._combine_exchange(self._combine_pre(out_NH, record), record)
        return self._combine_post(out, record)
