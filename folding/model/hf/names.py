"""Which Hugging Face tensors make up each engine parameter, per model family.

:func:`hf_components` maps an engine parameter name to the HF tensors that form its full tensor (and
where each sits in it); :func:`hf_tensor_names` lists every HF tensor name a checkpoint of a model
config holds. DeepSeek-V3's own names come from :mod:`folding.model.hf.deepseek`. Used by the
loader and the exporter in :mod:`folding.model.hf.weights`.

Usage::

    hf_components("layers.0.mlp.experts.fc1_weight", cfg)   # [((e, 0), "...experts.e.w1.weight"), ...]
"""

from __future__ import annotations

import re
from typing import List, Tuple

from ..config import ModelConfig
from .config import CheckpointError
from .deepseek import deepseek_components, deepseek_mtp_name, deepseek_tensor_names

_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")


def _moe_prefix(cfg: ModelConfig) -> str:
    return "block_sparse_moe" if cfg.family == "mixtral" else "mlp"


def _expert_names(cfg: ModelConfig) -> Tuple[str, str, str]:
    return ("w1", "w3", "w2") if cfg.family == "mixtral" else ("gate_proj", "up_proj", "down_proj")


def hf_components(name: str, cfg: ModelConfig) -> List[Tuple[Tuple[int, ...], str]]:
    """HF tensors forming the full tensor of engine parameter ``name``: ``(leading index, hf name)`` pairs.

    An empty leading index means the HF tensor *is* the full tensor.
    """
    top = {
        "embedding.weight": "model.embed_tokens.weight",
        "output_weight": "lm_head.weight",
        "final_norm.weight": "model.norm.weight",
    }
    if name in top:
        return [((), top[name])]
    if name.startswith("mtp."):  # multi-token prediction: DeepSeek-V3's layout
        if cfg.family != "deepseek_v3":
            raise CheckpointError(
                f"multi-token prediction (model.mtp_num_layers={cfg.mtp_num_layers}) has a Hugging Face "
                f"layout for deepseek_v3 only, not {cfg.family}; set model.mtp_num_layers=0 to convert"
            )
        hf_name, own = deepseek_mtp_name(name, cfg)
        if own:
            return [((), hf_name)]
        name = hf_name  # the module's transformer layer, named like a decoder layer
    special = deepseek_components(name, cfg) if cfg.family == "deepseek_v3" else None
    if special is not None:
        return special
    m = _LAYER.match(name)
    if not m:
        raise CheckpointError(f"engine parameter {name!r} has no Hugging Face counterpart")
    i, rest = int(m.group(1)), m.group(2)
    L = f"model.layers.{i}"
    simple = {
        "input_norm.weight": f"{L}.input_layernorm.weight",
        "post_attention_norm.weight": f"{L}.post_attention_layernorm.weight",
    }
    if rest in simple:
        return [((), simple[rest])]
    if rest.startswith("attention."):
        return [((), f"{L}.self_attn.{rest[len('attention.') :]}")]
    if not cfg.is_moe_layer(i):
        return [((), f"{L}.{rest}")]  # mlp.{gate,up,down}_proj.weight
    P, (g, u, d) = f"{L}.{_moe_prefix(cfg)}", _expert_names(cfg)
    if rest == "mlp.router.weight":
        return [((), f"{P}.gate.weight")]
    if rest == "mlp.experts.fc1_weight":
        return [
            ((e, h), f"{P}.experts.{e}.{w}.weight") for e in range(cfg.moe.num_experts) for h, w in enumerate((g, u))
        ]
    if rest == "mlp.experts.fc2_weight":
        return [((e,), f"{P}.experts.{e}.{d}.weight") for e in range(cfg.moe.num_experts)]
    S = f"{L}.mlp.shared_expert"
    if rest == "mlp.shared_expert.fc1_weight":  # fused [gate; up] (engine MoE layer)
        return [((0,), f"{S}.gate_proj.weight"), ((1,), f"{S}.up_proj.weight")]
    if rest == "mlp.shared_expert.fc2_weight":
        return [((), f"{S}.down_proj.weight")]
    if rest == "mlp.shared_expert.gate_weight":
        return [((), f"{S}_gate.weight")]
    if rest.startswith("mlp.shared_expert"):
        return [((), f"{L}.{rest}")]
    raise CheckpointError(f"engine parameter {name!r} has no Hugging Face counterpart")


def hf_tensor_names(cfg: ModelConfig) -> List[str]:
    """Every tensor name a Hugging Face checkpoint of ``cfg`` holds."""
    if cfg.family == "deepseek_v3":
        return deepseek_tensor_names(cfg)
    if cfg.mtp_num_layers:
        raise CheckpointError(
            f"multi-token prediction (model.mtp_num_layers={cfg.mtp_num_layers}) has a Hugging Face layout "
            f"for deepseek_v3 only, not {cfg.family}; set model.mtp_num_layers=0 to convert"
        )
    H = ["model.embed_tokens.weight", "model.norm.weight"] + ([] if cfg.tie_embeddings else ["lm_head.weight"])
    for i in range(cfg.num_layers):
        L = f"model.layers.{i}"
        H += [f"{L}.input_layernorm.weight", f"{L}.post_attention_layernorm.weight", f"{L}.self_attn.o_proj.weight"]
        H += [
            f"{L}.self_attn.{p}_proj.{k}" for p in "qkv" for k in (("weight", "bias") if cfg.qkv_bias else ("weight",))
        ]
        if cfg.qk_norm != "none":
            H += [f"{L}.self_attn.q_norm.weight", f"{L}.self_attn.k_norm.weight"]
        if not cfg.is_moe_layer(i):
            H += [f"{L}.mlp.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")]
            continue
        P = f"{L}.{_moe_prefix(cfg)}"
        H += [f"{P}.gate.weight"] + [
            f"{P}.experts.{e}.{w}.weight" for e in range(cfg.moe.num_experts) for w in _expert_names(cfg)
        ]
        if cfg.moe.shared_expert_ffn_hidden_size:
            H += [f"{L}.mlp.shared_expert.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")]
            if cfg.moe.shared_expert_gate:
                H.append(f"{L}.mlp.shared_expert_gate.weight")
    return H
