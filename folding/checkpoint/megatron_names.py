"""Which tensors of a Megatron-Core GPT / MoE checkpoint make up each engine parameter.

Megatron-Core's sharded state dict names a layer's tensors ``decoder.layers.<rest>`` stacked over the
layers (leading dimension ``L``, what Megatron-Core 0.16 writes) or ``decoder.layers.<i>.<rest>`` one
per layer; experts as ``mlp.experts.experts.linear_fc{1,2}.weight`` stacked over the experts, or
``mlp.experts.local_experts.<e>.linear_fc{1,2}.weight`` one per expert. :func:`index_keys` turns
either spelling into one index ``(layer, rest, expert) -> (key, leading indices)``, and
:func:`engine_tensor` builds the full tensor of one engine parameter from it:

==============================================================  ==========================================
Megatron-Core (per layer ``i``; ``e`` an expert)                engine (``layers.<i>.`` omitted)
==============================================================  ==========================================
``embedding.word_embeddings.weight``                            ``embedding.weight``
``output_layer.weight`` (absent when tied)                      ``output_weight``
``decoder.final_layernorm.weight``                              ``final_norm.weight``
``self_attention.linear_qkv.layer_norm_weight``                 ``input_norm.weight``
(or ``input_layernorm.weight``)
``self_attention.linear_qkv.weight`` / ``.bias``                ``attention.{q,k,v}_proj.weight`` / ``.bias``
``self_attention.linear_proj.weight``                           ``attention.o_proj.weight``
``self_attention.{q,k}_layernorm.weight``                       ``attention.{q,k}_norm.weight``
``mlp.linear_fc1.layer_norm_weight``                            ``post_attention_norm.weight``
(or ``pre_mlp_layernorm.weight``)
``mlp.router.weight``                                           ``mlp.router.weight``
``mlp.router.expert_bias``                                      ``mlp.router.expert_bias`` (buffer)
``mlp.experts.…linear_fc1.weight`` of expert ``e``              ``mlp.experts.fc1_weight[e]`` ([gate; up])
``mlp.experts.…linear_fc2.weight`` of expert ``e``              ``mlp.experts.fc2_weight[e]``
``mlp.shared_experts.linear_fc1.weight`` / ``linear_fc2`` /     ``mlp.shared_expert.fc1_weight`` /
``gate_weight``                                                 ``fc2_weight`` / ``gate_weight``
``mlp.linear_fc1.weight`` / ``mlp.linear_fc2.weight`` (dense)   ``mlp.{gate,up}_proj.weight`` /
                                                                ``mlp.down_proj.weight``
==============================================================  ==========================================

The fused QKV weight holds, for each of the ``G`` query groups in turn, the group's ``heads/G`` query
heads, then its key head, then its value head (``[G, heads/G + 2, head_dim, H]``); the engine's
``q_proj`` holds the query heads in order (head ``j`` in group ``j // (heads/G)``), ``k_proj`` and
``v_proj`` one head per group. SwiGLU's ``linear_fc1`` is ``[gate; up]``, as the engine's.

Keys of optimizer state (``optimizer.*``), RNG state and TransformerEngine ``_extra_state`` entries are
skipped; any other key is refused by name (:func:`unused_keys`): multi-latent attention, multi-token
prediction, learned position embeddings, linear biases and anything unknown.

Usage::

    index = index_keys(store.shapes)
    w = engine_tensor("layers.0.attention.q_proj.weight", cfg, reader(store, index))
"""

from __future__ import annotations

import re
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..model.config import ModelConfig
from ..model.hf.errors import CheckpointError

Canon = Tuple[Optional[int], str, Optional[int]]
"""``(layer, rest, expert)``: a Megatron tensor by layer, name inside the layer and expert (``None`` if none)."""
Get = Callable[[Optional[int], str, Optional[int]], torch.Tensor]
"""``get(layer, rest, expert)``: the Megatron tensor at that place (a read, or a ``meta`` tensor of its shape)."""

TOP = {
    "embedding.word_embeddings.weight": "embedding.weight",
    "output_layer.weight": "output_weight",
    "decoder.final_layernorm.weight": "final_norm.weight",
}
_ALIASES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}
_PER_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_PER_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12]\.weight)$")
_STACKED_EXPERTS = re.compile(r"^mlp\.experts\.experts\.(linear_fc[12]\.weight)$")
_SKIPPED = re.compile(r"(^optimizer\.|^rng_state|^rerun_state_machine|\._extra_state)")
_REFUSED = (
    (
        re.compile(r"linear_q_down_proj|linear_q_up_proj|linear_kv_down_proj|linear_kv_up_proj|kv_layernorm"),
        "multi-latent attention (MLA) is not supported by this conversion",
    ),
    (re.compile(r"^mtp\.|\.mtp\."), "multi-token prediction layers are not supported by this conversion"),
    (re.compile(r"position_embeddings"), "learned absolute position embeddings are not supported (RoPE only)"),
    (re.compile(r"\.bias$"), "linear biases (--add-bias-linear) are not supported; only the q/k/v bias is"),
)


def index_keys(shapes: Dict[str, Tuple[int, ...]]) -> Dict[Canon, Tuple[str, Tuple[int, ...]]]:
    """``(layer, rest, expert) -> (key, leading indices)`` for every model tensor of a store whose keys and
    global shapes are ``shapes``, either spelling (stacked over layers / experts, or one key each)."""
    out: Dict[Canon, Tuple[str, Tuple[int, ...]]] = {}
    for key, shape in shapes.items():
        if key in TOP:
            out[(None, key, None)] = (key, ())
            continue
        m = _PER_LAYER.match(key)
        if m:
            places: List[Tuple[int, str, Tuple[int, ...]]] = [(int(m.group(1)), m.group(2), ())]
        elif key.startswith("decoder.layers."):
            rest = key[len("decoder.layers.") :]
            places = [(i, rest, (i,)) for i in range(shape[0])]
        else:
            continue
        for i, rest, lead in places:
            rest = _ALIASES.get(rest, rest)
            e = _PER_EXPERT.match(rest)
            s = _STACKED_EXPERTS.match(rest)
            if e:
                out[(i, f"mlp.experts.{e.group(2)}", int(e.group(1)))] = (key, lead)
            elif s:
                for x in range(shape[len(lead)]):
                    out[(i, f"mlp.experts.{s.group(1)}", x)] = (key, lead + (x,))
            else:
                out[(i, rest, None)] = (key, lead)
    return out


def unused_keys(shapes: Dict[str, Tuple[int, ...]], index, used: Sequence[Canon]) -> List[str]:
    """One sentence per tensor key of the store that no engine parameter takes and that is not skipped
    (optimizer and RNG state, ``_extra_state``): the key and why it is refused."""
    taken = {index[c][0] for c in used if c in index}
    out = []
    for key in sorted(shapes):
        if key in taken or _SKIPPED.search(key):
            continue
        why = next((msg for pat, msg in _REFUSED if pat.search(key)), None)
        if why is None:
            why = "not a tensor of this model (the model config and the checkpoint differ, or a feature not supported)"
        out.append(f"{key}: {why}")
    return out


def _need(get: Get, used: List[Canon], i: Optional[int], rest: str, e: Optional[int] = None) -> torch.Tensor:
    used.append((i, rest, e))
    return get(i, rest, e)


def engine_tensor(name: str, cfg: ModelConfig, get: Get, used: Optional[List[Canon]] = None) -> torch.Tensor:
    """The full tensor of engine parameter (or buffer) ``name`` of a model of ``cfg``, from the Megatron
    tensors ``get`` returns; the places it reads are appended to ``used``. Raises :class:`CheckpointError`
    for a name without a Megatron counterpart."""
    used = [] if used is None else used
    top = {v: k for k, v in TOP.items()}
    if name in top:
        return _need(get, used, None, top[name])
    m = re.match(r"^layers\.(\d+)\.(.+)$", name)
    if not m:
        raise CheckpointError(f"engine parameter {name!r} has no Megatron-Core counterpart")
    i, rest = int(m.group(1)), m.group(2)
    simple = {
        "input_norm.weight": "self_attention.linear_qkv.layer_norm_weight",
        "post_attention_norm.weight": "mlp.linear_fc1.layer_norm_weight",
        "attention.o_proj.weight": "self_attention.linear_proj.weight",
        "attention.q_norm.weight": "self_attention.q_layernorm.weight",
        "attention.k_norm.weight": "self_attention.k_layernorm.weight",
        "mlp.router.weight": "mlp.router.weight",
        "mlp.router.expert_bias": "mlp.router.expert_bias",
        "mlp.shared_expert.fc2_weight": "mlp.shared_experts.linear_fc2.weight",
        "mlp.shared_expert.gate_weight": "mlp.shared_experts.gate_weight",
        "mlp.down_proj.weight": "mlp.linear_fc2.weight",
    }
    if rest in simple:
        return _need(get, used, i, simple[rest])
    qkv = re.match(r"^attention\.([qkv])_proj\.(weight|bias)$", rest)
    if qkv:
        return _split_qkv(_need(get, used, i, f"self_attention.linear_qkv.{qkv.group(2)}"), qkv.group(1), cfg)
    if rest in ("mlp.experts.fc1_weight", "mlp.experts.fc2_weight"):
        fc = "linear_fc1" if rest.endswith("fc1_weight") else "linear_fc2"
        return torch.stack([_need(get, used, i, f"mlp.experts.{fc}.weight", e) for e in range(cfg.moe.num_experts)])
    if rest == "mlp.shared_expert.fc1_weight":
        return _need(get, used, i, "mlp.shared_experts.linear_fc1.weight")
    if rest in ("mlp.gate_proj.weight", "mlp.up_proj.weight"):
        fc1 = _need(get, used, i, "mlp.linear_fc1.weight")
        return fc1.chunk(2, dim=0)[0 if rest.startswith("mlp.gate") else 1]
    raise CheckpointError(f"engine parameter {name!r} has no Megatron-Core counterpart")


def _split_qkv(w: torch.Tensor, which: str, cfg: ModelConfig) -> torch.Tensor:
    """The ``q``, ``k`` or ``v`` rows of Megatron's fused QKV weight ``[G·(heads/G + 2)·d, ...]`` (or bias)."""
    G, heads, d = cfg.num_kv_heads, cfg.num_attention_heads, cfg.kv_channels
    per = heads // G
    if w.shape[0] != G * (per + 2) * d:
        raise CheckpointError(
            f"linear_qkv has {w.shape[0]} rows; model.num_attention_heads={heads}, model.num_kv_heads={G} and "
            f"head dim {d} need {G * (per + 2) * d}: set them to the checkpoint's (Megatron's --num-attention-heads, "
            "--num-query-groups, --kv-channels)"
        )
    g = w.reshape((G, per + 2, d) + tuple(w.shape[1:]))
    part = {"q": g[:, :per], "k": g[:, per : per + 1], "v": g[:, per + 1 :]}[which]
    return part.reshape((-1,) + tuple(w.shape[1:]))
