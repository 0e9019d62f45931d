"""Hugging Face DeepSeek-V3 (``model_type: deepseek_v3``) <-> the engine: config, tensor names, router bias.

Config (``config.json`` -> :class:`ModelConfig`):

- MLA sizes (``q_lora_rank`` or null, ``kv_lora_rank``, ``qk_nope_head_dim``, ``qk_rope_head_dim``,
  ``v_head_dim``, ``rope_interleave``) -> ``model.mla``; RoPE from ``rope_parameters`` (transformers 5)
  or ``rope_theta`` + ``rope_scaling`` (the released checkpoint's spelling), ``rope_type`` ``default``
  or ``yarn`` (-> ``model.yarn``).
- The first ``first_k_dense_replace`` layers are dense (``model.mlp_only_layers``, width
  ``intermediate_size``); the others MoE.
- Router: sigmoid scores (``moe.score_function``); the selection-only ``e_score_correction_bias`` is
  the engine's aux-loss-free expert bias (``moe.expert_bias=true``; the buffer
  ``router.expert_bias`` is read and written as ``mlp.gate.e_score_correction_bias``); groups
  ``n_group`` / ``topk_group`` -> ``moe.num_groups`` / ``moe.group_topk`` with a group scored by its
  top-2 scores (``moe.group_score_topk=2``; one group means no group limit); ``norm_topk_prob`` must be
  true (the engine renormalizes sigmoid top-k probabilities); ``routed_scaling_factor`` ->
  ``moe.topk_scaling_factor``; ``n_shared_experts · moe_intermediate_size`` -> an ungated shared expert.
- Transformers computes no load-balancing loss for DeepSeek-V3, so none is imported
  (``moe.aux_loss_coeff=0``); set one with ``config_overrides`` for training.
- Rejected by name: ``attention_bias``, ``num_key_value_heads != num_attention_heads``, activations
  other than SiLU, ``norm_topk_prob=false``, rope types other than default/yarn.

Tensors: attention ``model.layers.i.self_attn.<HF name>`` (the engine's ``attention.<HF name>``),
experts ``mlp.experts.e.{gate,up,down}_proj``, shared expert ``mlp.shared_experts.{gate,up,down}_proj``,
router ``mlp.gate.weight``.

Multi-token prediction (``num_nextn_predict_layers`` -> ``model.mtp_num_layers``): module k's tensors
are ``model.layers.{num_hidden_layers + k - 1}.*``: ``enorm``, ``hnorm``, ``eh_proj``,
``shared_head.norm`` (the engine's ``mtp.{k-1}.{enorm,hnorm,eh_proj,head_norm}``), the transformer
layer's tensors under the usual names (the engine's ``mtp.{k-1}.layer.*``), and ``embed_tokens`` /
``shared_head.head``, copies of the model's embedding and output layer, which the engine shares: they
are written on export and not read on import (:func:`deepseek_mtp_copies`). transformers has no MTP
and saves checkpoints without these tensors while its config still says
``num_nextn_predict_layers: 1``: such a checkpoint is imported without MTP
(:func:`folding.model.hf.weights.from_hf`).

Usage::

    cfg = deepseek_config_from_hf(json.load(open("DeepSeek-V3/config.json")))
"""

from __future__ import annotations

import re
from typing import Any, Dict, List, Optional, Tuple

from ...moe.config import MoEConfig
from ..config import ModelConfig
from ..mla_config import MLAConfig
from ..yarn_config import YarnConfig
from .errors import CheckpointError

ARCHITECTURE = "DeepseekV3ForCausalLM"
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")


def _error(msg: str) -> Exception:
    return CheckpointError(msg)


def _rope(hf: Dict[str, Any]) -> Tuple[float, Optional[YarnConfig]]:
    params = dict(hf.get("rope_parameters") or {})
    scaling = dict(hf.get("rope_scaling") or {})
    p = params or scaling
    rtype = p.get("rope_type", p.get("type", "default")) if p else "default"
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    if rtype == "default":
        return theta, None
    if rtype != "yarn":
        raise _error(f"config.json rope_type={rtype!r} is not supported for deepseek_v3 (only 'default' and 'yarn')")
    orig = p.get("original_max_position_embeddings")
    if orig is None:
        raise _error("config.json yarn RoPE needs original_max_position_embeddings")
    factor = p.get("factor")
    if factor is None:  # transformers' rule: the ratio of the context lengths
        factor = hf["max_position_embeddings"] / orig
    return theta, YarnConfig(
        factor=float(factor),
        original_max_position_embeddings=int(orig),
        beta_fast=float(p.get("beta_fast") or 32),
        beta_slow=float(p.get("beta_slow") or 1),
        mscale=None if p.get("mscale") is None else float(p["mscale"]),
        mscale_all_dim=None if p.get("mscale_all_dim") is None else float(p["mscale_all_dim"]),
        attention_factor=None if p.get("attention_factor") is None else float(p["attention_factor"]),
        truncate=bool(p.get("truncate", True)),
    )


def deepseek_config_from_hf(hf: Dict[str, Any], name: Optional[str] = None) -> ModelConfig:
    """The :class:`ModelConfig` of a Hugging Face DeepSeek-V3 ``config.json`` dict (module docstring)."""
    if hf.get("hidden_act", "silu") != "silu":
        raise _error(f"config.json hidden_act={hf['hidden_act']!r} is not supported (only 'silu')")
    if hf.get("attention_bias"):
        raise _error("config.json attention_bias=true is not supported for deepseek_v3; set it to false")
    heads = hf["num_attention_heads"]
    kv_heads = hf.get("num_key_value_heads") or heads
    if kv_heads != heads:
        raise _error(f"config.json num_key_value_heads={kv_heads}: MLA needs num_attention_heads={heads}")
    if hf.get("norm_topk_prob", True) is False:
        raise _error("config.json norm_topk_prob=false is not supported (the engine renormalizes sigmoid top-k)")
    if hf.get("scoring_func", "sigmoid") != "sigmoid":
        raise _error(f"config.json scoring_func={hf['scoring_func']!r} is not supported for deepseek_v3")
    theta, yarn = _rope(hf)
    groups, group_topk = hf.get("n_group") or 1, hf.get("topk_group") or 1
    grouped = groups > 1
    shared = (hf.get("n_shared_experts") or 0) * hf["moe_intermediate_size"] or None
    moe = MoEConfig(
        num_experts=hf["n_routed_experts"],
        topk=hf["num_experts_per_tok"],
        ffn_hidden_size=hf["moe_intermediate_size"],
        score_function="sigmoid",
        expert_bias=True,
        num_groups=groups if grouped else None,
        group_topk=group_topk if grouped else None,
        group_score_topk=2 if grouped else None,
        topk_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
        shared_expert_ffn_hidden_size=shared,
        aux_loss_coeff=0.0,
    )
    return ModelConfig(
        name=name or "hf_deepseek_v3",
        family="deepseek_v3",
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"],
        num_attention_heads=heads,
        num_kv_heads=heads,
        ffn_hidden_size=hf.get("intermediate_size", 0),
        moe=moe,
        mlp_only_layers=tuple(range(min(hf.get("first_k_dense_replace") or 0, hf["num_hidden_layers"]))),
        rope_theta=theta,
        max_position_embeddings=hf.get("max_position_embeddings", 4096),
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        init_std=float(hf.get("initializer_range", 0.02)),
        mla=MLAConfig(
            q_lora_rank=hf.get("q_lora_rank"),
            kv_lora_rank=hf["kv_lora_rank"],
            qk_nope_head_dim=hf["qk_nope_head_dim"],
            qk_rope_head_dim=hf["qk_rope_head_dim"],
            v_head_dim=hf["v_head_dim"],
            rope_interleave=bool(hf.get("rope_interleave", True)),
        ),
        yarn=yarn,
        mtp_num_layers=int(hf.get("num_nextn_predict_layers") or 0),
    )


def deepseek_config_to_hf(cfg: ModelConfig) -> Dict[str, Any]:
    """A transformers-5 DeepSeek-V3 ``config.json`` dict for ``cfg``; refuses what the format cannot say."""
    m, moe = cfg.mla, cfg.moe
    dense = tuple(range(len(cfg.mlp_only_layers)))
    problems = []
    if m is None:
        problems.append("model.mla is null (DeepSeek-V3 uses multi-head latent attention)")
    if cfg.mlp_only_layers != dense or cfg.decoder_sparse_step != 1:
        problems.append("dense layers must be the first ones (model.mlp_only_layers=[0..k-1], decoder_sparse_step=1)")
    if moe.score_function != "sigmoid" or not moe.expert_bias or moe.pre_softmax:
        problems.append("the router must be sigmoid with moe.expert_bias=true")
    if moe.num_groups is not None and moe.group_score_topk != 2:
        problems.append("groups are scored by their top 2 scores: set moe.group_score_topk=2")
    sh = moe.shared_expert_ffn_hidden_size
    if moe.shared_expert_gate or (sh and sh % moe.ffn_hidden_size):
        problems.append("the shared expert is ungated and a multiple of moe.ffn_hidden_size wide")
    if problems:
        raise _error("cannot write a DeepSeek-V3 config.json: " + "; ".join(problems))
    rope: Dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.yarn is not None:
        y = cfg.yarn
        rope = dict(
            rope_type="yarn",
            rope_theta=cfg.rope_theta,
            factor=y.factor,
            original_max_position_embeddings=y.original_max_position_embeddings,
            beta_fast=y.beta_fast,
            beta_slow=y.beta_slow,
            truncate=y.truncate,
        )
        rope.update({k: getattr(y, k) for k in ("mscale", "mscale_all_dim", "attention_factor") if getattr(y, k)})
    return dict(
        architectures=[ARCHITECTURE],
        model_type="deepseek_v3",
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.ffn_hidden_size,
        moe_intermediate_size=moe.ffn_hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_attention_heads,
        n_shared_experts=(sh or 0) // moe.ffn_hidden_size,
        n_routed_experts=moe.num_experts,
        num_experts_per_tok=moe.topk,
        routed_scaling_factor=moe.topk_scaling_factor or 1.0,
        n_group=moe.num_groups or 1,
        topk_group=moe.group_topk or 1,
        norm_topk_prob=True,
        first_k_dense_replace=len(dense),
        q_lora_rank=m.q_lora_rank,
        kv_lora_rank=m.kv_lora_rank,
        qk_nope_head_dim=m.qk_nope_head_dim,
        qk_rope_head_dim=m.qk_rope_head_dim,
        v_head_dim=m.v_head_dim,
        rope_interleave=m.rope_interleave,
        hidden_act="silu",
        attention_bias=False,
        max_position_embeddings=cfg.max_position_embeddings,
        rms_norm_eps=cfg.norm_eps,
        tie_word_embeddings=cfg.tie_embeddings,
        initializer_range=cfg.init_std,
        rope_parameters=rope,
        num_nextn_predict_layers=cfg.mtp_num_layers,
        dtype="float32",
    )


# ------------------------------------------------------------------------------------ tensors
def deepseek_components(name: str, cfg: ModelConfig) -> Optional[List[Tuple[Tuple[int, ...], str]]]:
    """``(leading index, hf name)`` pairs of engine parameter ``name`` when DeepSeek-V3 names it
    differently from the shared mapping of :func:`folding.model.hf.names.hf_components`, else ``None``."""
    m = _LAYER.match(name)
    if not m or not cfg.is_moe_layer(int(m.group(1))):
        return None
    S, rest = f"model.layers.{m.group(1)}.mlp.shared_experts", m.group(2)
    if rest == "mlp.shared_expert.fc1_weight":  # fused [gate; up] (engine MoE layer)
        return [((0,), f"{S}.gate_proj.weight"), ((1,), f"{S}.up_proj.weight")]
    if rest == "mlp.shared_expert.fc2_weight":
        return [((), f"{S}.down_proj.weight")]
    return None


_MTP = re.compile(r"^mtp\.(\d+)\.(.+)$")
_MTP_OWN = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight"}
_MTP_OWN["head_norm.weight"] = "shared_head.norm.weight"


def deepseek_mtp_name(name: str, cfg: ModelConfig) -> Optional[Tuple[str, bool]]:
    """For an engine parameter of a multi-token-prediction module (``mtp.{j}.*``): ``(hf name, True)``
    for the module's own tensors, ``(engine name of the decoder layer naming, False)`` for its
    transformer layer (``mtp.{j}.layer.X`` -> ``layers.{num_layers + j}.X``); ``None`` for other names."""
    m = _MTP.match(name)
    if not m:
        return None
    j, rest = int(m.group(1)), m.group(2)
    if rest in _MTP_OWN:
        return f"model.layers.{cfg.num_layers + j}.{_MTP_OWN[rest]}", True
    if rest.startswith("layer."):
        return f"layers.{cfg.num_layers + j}.{rest[len('layer.') :]}", False
    raise CheckpointError(f"engine parameter {name!r} has no Hugging Face counterpart")


def deepseek_mtp_copies(cfg: ModelConfig) -> Dict[str, str]:
    """``{copy: source}``: the embedding and output-layer copies a DeepSeek-V3 checkpoint stores for
    each MTP module (``model.layers.{L + j}.embed_tokens`` / ``shared_head.head``), with the model
    tensors they copy."""
    head = "model.embed_tokens.weight" if cfg.tie_embeddings else "lm_head.weight"
    out = {}
    for i in cfg.layer_numbers()[cfg.num_layers :]:
        out[f"model.layers.{i}.embed_tokens.weight"] = "model.embed_tokens.weight"
        out[f"model.layers.{i}.shared_head.head.weight"] = head
    return out


def deepseek_tensor_names(cfg: ModelConfig) -> List[str]:
    """Every tensor name a Hugging Face DeepSeek-V3 checkpoint of ``cfg`` holds (MTP layers last)."""
    m = cfg.mla
    names = ["model.embed_tokens.weight", "model.norm.weight"] + ([] if cfg.tie_embeddings else ["lm_head.weight"])
    attn = ["kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj"]
    attn += ["q_proj"] if m.q_lora_rank is None else ["q_a_proj", "q_a_layernorm", "q_b_proj"]
    copies = deepseek_mtp_copies(cfg)
    for i in cfg.layer_numbers():
        L = f"model.layers.{i}"
        if i >= cfg.num_layers:  # an MTP module: its own tensors, then its layer's
            names += [f"{L}.{n}" for n in _MTP_OWN.values()]
            names += [c for c in copies if c.startswith(f"{L}.")]
        names += [f"{L}.input_layernorm.weight", f"{L}.post_attention_layernorm.weight"]
        names += [f"{L}.self_attn.{a}.weight" for a in attn]
        if not cfg.is_moe_layer(i):
            names += [f"{L}.mlp.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")]
            continue
        names += [f"{L}.mlp.gate.weight", f"{L}.mlp.gate.e_score_correction_bias"]
        names += [
            f"{L}.mlp.experts.{e}.{p}.weight"
            for e in range(cfg.moe.num_experts)
            for p in ("gate_proj", "up_proj", "down_proj")
        ]
        if cfg.moe.shared_expert_ffn_hidden_size:
            names += [f"{L}.mlp.shared_experts.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")]
    return names


def deepseek_has_mtp(weight_names) -> bool:
    """Whether a checkpoint's tensor names include multi-token-prediction modules (an ``eh_proj``)."""
    return any(n.endswith(".eh_proj.weight") for n in weight_names)


def deepseek_buffers(model) -> List[Tuple[str, Any, str]]:
    """``(engine name, buffer, hf name)`` of the router biases: the engine's aux-loss-free
    ``router.expert_bias`` is DeepSeek-V3's ``mlp.gate.e_score_correction_bias``."""
    out = []
    for name, buf in model.named_buffers():
        mtp = deepseek_mtp_name(name, model.config) if name.startswith("mtp.") else None
        m = _LAYER.match(mtp[0] if mtp else name)  # an MTP layer's router: its HF layer number
        if m and m.group(2) == "mlp.router.expert_bias" and buf is not None:
            out.append((name, buf, f"model.layers.{m.group(1)}.mlp.gate.e_score_correction_bias"))
    return out
