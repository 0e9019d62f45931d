"""Folding's token dispatchers inside Megatron-Core's ``MoELayer``: one call replaces the layer's own.

:func:`replace_dispatcher` reads the layer's ``TransformerConfig`` and the EP / expert-TP groups its
dispatcher was built with, builds the matching folding dispatcher (all-to-all or all-gather, dropless,
dropping or pad-to-capacity), hands it the shared expert when Megatron-Core's
``moe_shared_expert_overlap`` is on (the layer then expects the dispatcher to compute it), and sets
it as ``layer.token_dispatcher``. Everything Megatron-Core asks of a dispatcher is there: the six
stages (the all-to-all dispatcher with its ETP all-gather / reduce-scatter in ``dispatch_postprocess`` /
``combine_preprocess``, as Megatron-Core places them), ``set_shared_experts``, the CUDA-graph
attributes, and the inference toggles (``drop_and_pad``, ``moe_expert_capacity_factor``). A setting
folding's dispatchers do not implement fails here, naming it, instead of giving other numbers later.
Megatron-Core is not imported: the layer is read by attribute.

Usage::

    layer = MoELayer(config, submodules, ...)                # Megatron-Core
    replace_dispatcher(layer)                                # folding's, same groups and settings
    replace_dispatcher(layer, dispatch_wire="mxfp8")         # with a quantized dispatch wire
"""

from __future__ import annotations

from typing import Optional

from ...moe.dispatch.build import build_dispatcher
from .stages import MegatronDispatcher

UNSUPPORTED = {
    "moe_router_padding_for_quantization": "padding the routing map to the FP8 alignment",
    "moe_latent_size": "latent projections around the dispatch",
    "moe_enable_deepep": "DeepEP kernels",
    "moe_flex_dispatcher_backend": None,  # only meaningful with the flex dispatcher, checked below
}


def _unsupported(config) -> Optional[str]:
    if getattr(config, "moe_token_dispatcher_type", "alltoall") not in ("alltoall", "allgather"):
        return f"moe_token_dispatcher_type={config.moe_token_dispatcher_type!r} (folding has alltoall and allgather)"
    for key, what in UNSUPPORTED.items():
        if what and getattr(config, key, None):
            return f"{key}={getattr(config, key)!r} ({what})"
    scope = [str(getattr(s, "name", s)) for s in (getattr(config, "cuda_graph_scope", None) or [])]
    if getattr(config, "cuda_graph_impl", "none") != "none" and (not scope or "moe_preprocess" in scope):
        if not getattr(config, "moe_pad_expert_input_to_capacity", False):
            return (
                f"cuda_graph_impl={config.cuda_graph_impl!r} capturing the MoE preprocess step (scope "
                f"{scope or 'whole layer'}): folding's dropless/dropping dispatch reads its split sizes on "
                "the host; capture other scopes or use moe_pad_expert_input_to_capacity"
            )
    return None


def replace_dispatcher(
    layer,
    *,
    kind: Optional[str] = None,
    megatron_stages: bool = True,
    node_group=None,
    rail_group=None,
    nvlink_domain: Optional[int] = None,
    **wires,
) -> MegatronDispatcher:
    """Set ``layer.token_dispatcher`` (a Megatron-Core ``MoELayer``) to folding's dispatcher with the
    layer's settings and groups, behind Megatron-Core's six-stage interface
    (:class:`~folding.interop.megatron.stages.MegatronDispatcher`); returns it. ``kind`` defaults to the layer's
    ``moe_token_dispatcher_type``; ``wires`` are ``dispatch_wire`` / ``combine_wire`` / ``grad_wire``.
    ``megatron_stages`` (all-to-all only) puts the ETP all-gather / reduce-scatter in
    ``dispatch_postprocess`` / ``combine_preprocess`` as Megatron-Core does (the default here, so that
    code overlapping work with a stage sees the same split); ``False`` keeps them next to the EP
    all-to-all (:class:`~folding.moe.dispatch.alltoall.AllToAllDispatcher`). ``kind="hierarchical"``
    takes the layer's EP group split by node, ``node_group`` and ``rail_group``
    (:func:`folding.parallel.build_node_split_groups`), or ``nvlink_domain`` alone: the first layer of
    the process creates them (collective over the world) and every later layer shares them
    (:func:`folding.parallel.shared_node_split_groups`; a different EP group or ``nvlink_domain`` is
    refused), so pipeline stages with different numbers of MoE layers create them alike
    (:class:`~folding.moe.dispatch.hierarchical.HierarchicalDispatcher`; its ETP exchange stays
    inside ``token_dispatch`` / ``token_combine``).
    Raises ``ValueError`` naming the setting for a feature folding's dispatchers do not implement."""
    config = layer.config
    why = _unsupported(config)
    if why:
        raise ValueError(f"replace_dispatcher: {why} is not supported by folding's dispatchers")
    old = layer.token_dispatcher
    kind = kind or config.moe_token_dispatcher_type
    engine = build_dispatcher(
        kind,
        num_experts=config.num_moe_experts,
        topk=config.moe_router_topk,
        ep_group=old.ep_group,
        etp_group=old.tp_group,  # Megatron-Core's dispatcher holds the expert-TP group as tp_group
        num_local_experts=getattr(old, "num_local_experts", None),
        capacity_factor=config.moe_expert_capacity_factor,
        pad_to_capacity=bool(config.moe_pad_expert_input_to_capacity),
        **({"megatron_stages": megatron_stages} if kind == "alltoall" else {}),
        **(
            {"node_group": node_group, "rail_group": rail_group, "nvlink_domain": nvlink_domain}
            if kind == "hierarchical"
            else {}
        ),
        **wires,
    )
    d = MegatronDispatcher(engine)
    if getattr(layer, "shared_expert_overlap", False) and getattr(layer, "shared_experts", None) is not None:
        d.set_shared_experts(layer.shared_experts)
    layer.token_dispatcher = d
    return d
