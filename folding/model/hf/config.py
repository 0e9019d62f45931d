"""Hugging Face ``config.json`` <-> :class:`ModelConfig` for Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE
(DeepSeek-V3: :mod:`folding.model.hf.deepseek`).

Both rope spellings are read: transformers 4's top-level ``rope_theta`` and transformers 5's
``rope_parameters = {"rope_type": "default", "rope_theta": ...}``. Features the engine does not
implement (other rope types, sliding-window attention, activations other than SiLU) are rejected
with an error naming the field instead of being silently ignored.

The load-balancing loss coefficient is ``router_aux_loss_coef``, whatever ``output_router_logits`` says:
that flag only tells transformers whether to return router logits (and so add the loss) in a forward, and
``save_pretrained`` writes it ``false`` for most models, whose training used the loss all the same (a model
trained on from such a config without it loses its balance within a few steps). Override it with
``from_hf(path, config_overrides={"moe": {"aux_loss_coeff": ...}})`` or ``moe.aux_loss_coeff=...``; the
export writes the coefficient the run used and keeps the source's ``output_router_logits``.

Qwen2-MoE's router maps to ``moe.pre_softmax = not norm_topk_prob`` (softmax over all experts, then
top-k; renormalizing the k probabilities equals the softmax of the k selected logits, which is
``pre_softmax=False``); Mixtral's to post-softmax (``pre_softmax=False``). Qwen3-MoE and OLMoE route
like Qwen2-MoE (softmax over all experts, top-k, ``norm_topk_prob``) and have no shared expert.
Qwen3-MoE normalizes q and k per head (``qk_norm="head"``), OLMoE over each token's whole q and k
projection outputs (``qk_norm="full"``); neither has q/k/v biases (``attention_bias=true``, which
would also bias ``o_proj``, is rejected, as is OLMoE's ``clip_qkv``).

Usage::

    cfg = config_from_hf(json.load(open("ckpt/config.json")))
    hf_dict = config_to_hf(cfg)
"""

from __future__ import annotations

from typing import Any, Dict, Optional

from ...moe.config import MoEConfig
from ..config import ModelConfig
from .deepseek import ARCHITECTURE, deepseek_config_from_hf, deepseek_config_to_hf
from .errors import CheckpointError

ARCHITECTURES = {
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "deepseek_v3": ARCHITECTURE,
}


def _rope_theta(hf: Dict[str, Any]) -> float:
    params = hf.get("rope_parameters")
    scaling = hf.get("rope_scaling")
    if params:
        rtype = params.get("rope_type", params.get("type", "default"))
        if rtype != "default":
            raise CheckpointError(
                f"config.json rope_parameters.rope_type={rtype!r} is not supported (only 'default' RoPE)"
            )
        if "rope_theta" in params:
            return float(params["rope_theta"])
    if scaling:
        raise CheckpointError(f"config.json rope_scaling={scaling!r} is not supported (only default RoPE)")
    return float(hf.get("rope_theta", 10000.0))


def config_from_hf(hf: Dict[str, Any], name: Optional[str] = None) -> ModelConfig:
    """The :class:`ModelConfig` of a Hugging Face Mixtral / Qwen2-MoE / Qwen3-MoE / OLMoE ``config.json`` dict."""
    mtype = hf.get("model_type")
    if mtype not in ARCHITECTURES:
        raise CheckpointError(
            f"config.json model_type={mtype!r} (architectures={hf.get('architectures')}) is not "
            f"supported; supported: {sorted(ARCHITECTURES)}"
        )
    if mtype == "deepseek_v3":  # MLA, sigmoid router with correction bias, YaRN: folding.model.hf.deepseek
        return deepseek_config_from_hf(hf, name)
    if hf.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"config.json hidden_act={hf['hidden_act']!r} is not supported (only 'silu')")
    common = dict(
        name=name or f"hf_{mtype}",
        family=mtype,
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"],
        num_attention_heads=hf["num_attention_heads"],
        num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        head_dim=hf.get("head_dim"),
        rope_theta=_rope_theta(hf),
        max_position_embeddings=hf.get("max_position_embeddings", 4096),
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        init_std=float(hf.get("initializer_range", 0.02)),
    )
    moe = dict(
        topk=hf["num_experts_per_tok"],
        # the model's own balancing: output_router_logits only says whether a transformers forward returns
        # router logits (save_pretrained writes it false for models trained with the loss)
        aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.0)),
    )
    if mtype == "mixtral":
        if hf.get("sliding_window") is not None:
            raise CheckpointError(
                f"config.json sliding_window={hf['sliding_window']} is not supported; "
                "set it to null (full causal attention)"
            )
        moe.update(num_experts=hf["num_local_experts"], ffn_hidden_size=hf["intermediate_size"])
        return ModelConfig(**common, moe=MoEConfig(**moe, pre_softmax=False))
    if mtype in ("qwen3_moe", "olmoe"):
        return _qwen3_or_olmoe(hf, mtype, common, moe)
    if hf.get("use_sliding_window"):
        raise CheckpointError("config.json use_sliding_window=true is not supported; set it to false")
    shared = hf.get("shared_expert_intermediate_size") or None
    moe.update(
        num_experts=hf["num_experts"],
        ffn_hidden_size=hf["moe_intermediate_size"],
        shared_expert_ffn_hidden_size=shared,
        shared_expert_gate=shared is not None,
        # softmax over all experts then top-k; renormalizing the k probabilities (norm_topk_prob) gives
        # exactly the softmax of the k selected logits, i.e. pre_softmax=False
        pre_softmax=not hf.get("norm_topk_prob", False),
    )
    return ModelConfig(
        **common,
        moe=MoEConfig(**moe),
        ffn_hidden_size=hf.get("intermediate_size", 0),
        decoder_sparse_step=hf.get("decoder_sparse_step", 1),
        mlp_only_layers=tuple(hf.get("mlp_only_layers") or ()),
        qkv_bias=bool(hf.get("qkv_bias", True)),
    )


def _qwen3_or_olmoe(hf: Dict[str, Any], mtype: str, common: dict, moe: dict) -> ModelConfig:
    if hf.get("attention_bias"):
        raise CheckpointError(
            f"config.json attention_bias=true is not supported for {mtype} (it also biases o_proj); set it to false"
        )
    if hf.get("use_sliding_window"):
        raise CheckpointError("config.json use_sliding_window=true is not supported; set it to false")
    # softmax over all experts then top-k, renormalized with norm_topk_prob: as Qwen2-MoE (module docstring)
    moe["pre_softmax"] = not hf.get("norm_topk_prob", False)
    experts = hf.get("num_experts", hf.get("num_local_experts"))
    if mtype == "qwen3_moe":
        moe.update(num_experts=experts, ffn_hidden_size=hf["moe_intermediate_size"])
        return ModelConfig(
            **common,
            moe=MoEConfig(**moe),
            qk_norm="head",
            ffn_hidden_size=hf.get("intermediate_size", 0),
            decoder_sparse_step=hf.get("decoder_sparse_step", 1),
            mlp_only_layers=tuple(hf.get("mlp_only_layers") or ()),
        )
    if hf.get("clip_qkv") is not None:
        raise CheckpointError(f"config.json clip_qkv={hf['clip_qkv']} is not supported; set it to null")
    heads = common["num_attention_heads"]
    if common["head_dim"] is not None and common["head_dim"] * heads != common["hidden_size"]:
        raise CheckpointError(
            f"config.json head_dim={common['head_dim']} differs from hidden_size/num_attention_heads="
            f"{common['hidden_size'] / heads:g}; OLMoE's q/k norms assume they are equal: remove head_dim"
        )
    moe.update(num_experts=experts, ffn_hidden_size=hf["intermediate_size"])
    return ModelConfig(**common, moe=MoEConfig(**moe), qk_norm="full")


def _check_exportable(cfg: ModelConfig) -> None:
    """Raise :class:`CheckpointError` naming the setting when ``cfg`` has a feature its family's HF model lacks."""
    want_norm = {"mixtral": "none", "qwen2_moe": "none", "qwen3_moe": "head", "olmoe": "full"}[cfg.family]
    if cfg.qk_norm != want_norm:
        raise CheckpointError(f"{cfg.family} checkpoints have model.qk_norm={want_norm!r}, not {cfg.qk_norm!r}")
    if cfg.family in ("qwen3_moe", "olmoe"):
        if cfg.qkv_bias:
            raise CheckpointError(f"{cfg.family} checkpoints have no q/k/v bias: set model.qkv_bias=false")
        if cfg.moe.shared_expert_ffn_hidden_size:
            raise CheckpointError(
                f"{cfg.family} checkpoints have no shared expert: set moe.shared_expert_ffn_hidden_size=null"
            )
    if cfg.family == "olmoe":
        if cfg.num_moe_layers() != cfg.num_layers:
            raise CheckpointError(
                "OLMoE checkpoints have an MoE block in every layer: set model.decoder_sparse_step=1 "
                "and model.mlp_only_layers=[]"
            )
        if cfg.kv_channels * cfg.num_attention_heads != cfg.hidden_size:
            raise CheckpointError("OLMoE checkpoints need model.head_dim = hidden_size / num_attention_heads")


def config_to_hf(cfg: ModelConfig) -> Dict[str, Any]:
    """A transformers-5 ``config.json`` dict for ``cfg`` (rope written as ``rope_parameters``)."""
    if cfg.family == "deepseek_v3":
        return deepseek_config_to_hf(cfg)
    _check_exportable(cfg)
    hf: Dict[str, Any] = dict(
        architectures=[ARCHITECTURES[cfg.family]],
        model_type=cfg.family,
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_kv_heads,
        hidden_act="silu",
        num_experts_per_tok=cfg.moe.topk,
        max_position_embeddings=cfg.max_position_embeddings,
        rms_norm_eps=cfg.norm_eps,
        tie_word_embeddings=cfg.tie_embeddings,
        router_aux_loss_coef=cfg.moe.aux_loss_coeff,
        output_router_logits=cfg.moe.aux_loss_coeff > 0,
        initializer_range=cfg.init_std,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        dtype="float32",
    )
    if cfg.head_dim is not None:
        hf["head_dim"] = cfg.head_dim
    if cfg.family == "mixtral":
        if cfg.moe.pre_softmax:
            raise CheckpointError("Mixtral checkpoints route with softmax after top-k: set moe.pre_softmax=false")
        hf.update(num_local_experts=cfg.moe.num_experts, intermediate_size=cfg.moe.ffn_hidden_size, sliding_window=None)
    elif cfg.family == "qwen3_moe":
        hf.update(
            head_dim=cfg.kv_channels,
            num_experts=cfg.moe.num_experts,
            moe_intermediate_size=cfg.moe.ffn_hidden_size,
            intermediate_size=cfg.ffn_hidden_size,
            decoder_sparse_step=cfg.decoder_sparse_step,
            mlp_only_layers=list(cfg.mlp_only_layers),
            norm_topk_prob=not cfg.moe.pre_softmax,
            attention_bias=False,
            use_sliding_window=False,
        )
    elif cfg.family == "olmoe":
        hf.update(
            num_experts=cfg.moe.num_experts,
            intermediate_size=cfg.moe.ffn_hidden_size,
            norm_topk_prob=not cfg.moe.pre_softmax,
            attention_bias=False,
            clip_qkv=None,
        )
    else:
        if cfg.moe.shared_expert_ffn_hidden_size and not cfg.moe.shared_expert_gate:
            raise CheckpointError(
                "Qwen2-MoE checkpoints always gate the shared expert: set moe.shared_expert_gate=true"
            )
        hf.update(
            num_experts=cfg.moe.num_experts,
            moe_intermediate_size=cfg.moe.ffn_hidden_size,
            intermediate_size=cfg.ffn_hidden_size,
            shared_expert_intermediate_size=cfg.moe.shared_expert_ffn_hidden_size or 0,
            decoder_sparse_step=cfg.decoder_sparse_step,
            mlp_only_layers=list(cfg.mlp_only_layers),
            norm_topk_prob=not cfg.moe.pre_softmax,
            qkv_bias=cfg.qkv_bias,
            use_sliding_window=False,
        )
    return hf
