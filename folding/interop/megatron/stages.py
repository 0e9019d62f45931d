"""Megatron-Core's six-stage dispatcher interface as an adapter over one of the engine's dispatchers.

Megatron-Core's ``MoELayer`` drives its token dispatcher through six calls and keeps the call's state
on the dispatcher between them; the engine's dispatchers keep no call state (``dispatch`` returns a
:class:`~folding.moe.dispatch.base.DispatchRecord` that ``combine`` takes back). This adapter holds
the one call in progress between the stages, and carries what Megatron-Core asks of a dispatcher
besides: ``set_shared_experts`` (its ``SharedExpertMLP`` run inside the stages), the CUDA-graph
attributes, and the inference toggles ``drop_and_pad`` / ``moe_expert_capacity_factor``. Every other
attribute reads through to the wrapped dispatcher.

=============================================  ==============================================
stage                                          returns
=============================================  ==============================================
``dispatch_preprocess(hidden, map, probs)``    ``(hidden, probs)``: local work before communication
``token_dispatch(hidden, probs)``              ``(hidden, probs)``: the dispatch communication
``dispatch_postprocess(hidden, probs)``        ``(tokens_NH, tokens_per_expert_L, probs_N)``
``combine_preprocess(out)``                    local work on the experts' output
``token_combine(out)``                         the combine communication
``combine_postprocess(out)``                   the input's shape (``[S, B, H]`` or ``[T, H]``)
=============================================  ==============================================

Usage::

    stages = MegatronDispatcher(build_dispatcher("alltoall", ..., megatron_stages=True))
    h, p = stages.dispatch_preprocess(hidden, routing_map, probs)
    rows, tokens_per_expert, rows_probs = stages.dispatch_postprocess(*stages.token_dispatch(h, p))
    out = stages.combine_postprocess(stages.token_combine(stages.combine_preprocess(expert_out)))
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

from ...moe.dispatch.base import DispatchCall, DispatchRecord, TokenDispatcher

SHARED_EXPERT_HOOKS = ("pre_forward_comm", "linear_fc1_forward_and_act", "linear_fc2_forward", "post_forward_comm")
"""What Megatron-Core's ``SharedExpertMLP`` offers when built with ``moe_shared_expert_overlap``."""


class MegatronDispatcher:
    """Megatron-Core's token-dispatcher interface over ``dispatcher`` (see the module docstring).

    Args:
        dispatcher: an engine dispatcher (:func:`folding.moe.dispatch.build.build_dispatcher`).
    """

    def __init__(self, dispatcher: TokenDispatcher):
        if not isinstance(dispatcher, TokenDispatcher):
            raise TypeError(f"MegatronDispatcher wraps an engine TokenDispatcher, got {type(dispatcher).__name__}")
        self.dispatcher = dispatcher
        """The engine dispatcher doing the work."""
        self._call: Optional[DispatchCall] = None  # the call between its dispatch stages
        self._record: Optional[DispatchRecord] = None  # ... and its record until its combine
        self.shared_experts = None
        """A Megatron-Core ``SharedExpertMLP`` run inside the stages (:meth:`set_shared_experts`), or ``None``."""
        self.cudagraph_attrs: list = []
        """Megatron-Core's CUDA-graph interface: names of the dispatcher tensors a graph of the
        preprocess step must return. Empty: the engine's dispatchers keep their split plan on the host,
        so the ``moe_preprocess`` graph scope is refused at replacement
        (:func:`~folding.interop.megatron.replace_dispatcher`)."""
        self.valid_cudagraph_attrs = None
        """Megatron-Core's CUDA-graph interface: the attributes found captured (set by Megatron-Core)."""

    def __getattr__(self, name: str):
        # only reached for names this adapter does not have: the wrapped dispatcher's configuration
        if name == "dispatcher":
            raise AttributeError(name)
        return getattr(self.dispatcher, name)

    # ------------------------------------------------------------------ shared expert
    def set_shared_experts(self, shared_experts) -> None:
        """Run a Megatron-Core ``SharedExpertMLP`` (built with ``moe_shared_expert_overlap``) inside
        the stages, as Megatron-Core's ``MoELayer`` asks of its dispatcher when the overlap is on (the
        layer then no longer computes it): its input all-gather is issued in ``dispatch_preprocess``,
        fc1 and the activation in ``dispatch_postprocess``, fc2 and the reduce-scatter in
        ``combine_postprocess``, which also adds its output (with its gate)."""
        for hook in SHARED_EXPERT_HOOKS:
            if not callable(getattr(shared_experts, hook, None)):
                raise TypeError(
                    f"set_shared_experts: {type(shared_experts).__name__} has no {hook}(); pass a "
                    "Megatron-Core SharedExpertMLP built with moe_shared_expert_overlap=True"
                )
        self.shared_experts = shared_experts

    # ------------------------------------------------------------------ inference toggles
    @property
    def drop_and_pad(self) -> bool:
        """Megatron-Core's name for ``pad_to_capacity`` (its inference code toggles it); setting it
        re-checks the capacity settings before the next call."""
        return self.dispatcher.pad_to_capacity

    @drop_and_pad.setter
    def drop_and_pad(self, value: bool) -> None:
        self.dispatcher.pad_to_capacity = bool(value)
        self.dispatcher._check_capacity()

    @property
    def moe_expert_capacity_factor(self) -> Optional[float]:
        """Megatron-Core's name for ``capacity_factor`` (its inference code sets it)."""
        return self.dispatcher.capacity_factor

    @moe_expert_capacity_factor.setter
    def moe_expert_capacity_factor(self, value: Optional[float]) -> None:
        self.dispatcher.capacity_factor = value
        self.dispatcher._check_capacity()

    # ------------------------------------------------------------------ the six stages
    def dispatch_preprocess(self, hidden, routing_map, probs):
        """Local work before the dispatch communication; returns ``(hidden, probs)``."""
        if self.shared_experts is not None:
            self.shared_experts.pre_forward_comm(hidden)
        rows, probs, self._call = self.dispatcher._preprocess(hidden, routing_map, probs)
        return rows, probs

    def token_dispatch(self, hidden, probs):
        """The dispatch communication; returns ``(hidden, probs)``."""
        return self.dispatcher._exchange(hidden, probs, self._call)

    def dispatch_postprocess(self, hidden, probs):
        """Local work after it; returns ``(tokens_NH, tokens_per_expert_L, probs_N)``, expert-major."""
        if self.shared_experts is not None:
            self.shared_experts.linear_fc1_forward_and_act(hidden)
        tokens, record, probs = self.dispatcher._postprocess(hidden, probs, self._call)
        self._call, self._record = None, record
        return tokens, record.tokens_per_expert, probs

    def combine_preprocess(self, out):
        """Local work on the experts' output before the combine communication."""
        return self.dispatcher._combine_pre(out, self._record)

    def token_combine(self, out):
        """The combine communication."""
        return self.dispatcher._combine_exchange(out, self._record)

    def combine_postprocess(self, out):
        """Local work after it; returns the shape ``hidden`` had in ``dispatch_preprocess``."""
        output = self.dispatcher._combine_post(out, self._record)
        if self.shared_experts is None:
            return output
        self.shared_experts.linear_fc2_forward(out)
        self.shared_experts.post_forward_comm()
        return output + self.shared_experts.get_output()

    @property
    def tokens_per_expert_host(self) -> Optional[Tuple[int, ...]]:
        """Rows per local expert of the latest call through the stages (from its
        ``dispatch_postprocess`` on), as Python ints; ``None`` before the first."""
        return None if self._record is None else self._record.tokens_per_expert_host

    @property
    def last_stats(self) -> Dict[str, Any]:
        """The byte and row counts of the latest call through the stages (``{}`` before the first)."""
        return {} if self._record is None else dict(self._record.stats)
