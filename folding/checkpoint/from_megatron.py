"""Megatron-Core checkpoints in: ``tools/convert_megatron.py`` and ``checkpoint.init_from_megatron``.

A Megatron-Core ``torch_dist`` checkpoint of a GPT / MoE model (Mixtral-style, Qwen3-MoE-style,
Qwen2-MoE-style with a gated shared expert; any TP/PP/EP/ETP it was saved with) is read on one process
(:class:`~folding.checkpoint.megatron_store.MegatronStore`) and mapped onto the engine's parameters
(:mod:`folding.checkpoint.megatron_names`: fused QKV, stacked or per-expert experts, router and expert
bias). A torch_dist store holds no engine model config, and one saved by Megatron-Core alone holds
no Megatron-LM ``args`` either: the engine's model config is given (``--model`` and overrides of the
tool, the job's ``model`` for ``init_from_megatron``), and the checkpoint is checked against it by
name and global shape before anything is read or written (:func:`check_megatron`): a missing tensor,
a shape that differs, or a key no parameter takes (multi-latent attention, multi-token prediction,
learned position embeddings, linear biases, anything unknown) fails with a :class:`CheckpointError`
naming each. What the checkpoint cannot say is the model's routing (``moe.topk``,
``moe.pre_softmax``, ``moe.score_function``) and RoPE base: they come from the config.

- :func:`convert_megatron` writes an engine checkpoint ``OUT/step_<iteration>`` (``meta.json`` with the
  model config, the parameters and buffers as DCP blocks, ``COMPLETE``, no optimizer state) that
  :func:`folding.checkpoint.load.load_model` and ``tools/convert_hf.py export --checkpoint`` read; it never
  writes into an existing ``OUT``.
- :func:`check_init_megatron` and :func:`load_megatron_weights` are ``checkpoint.init_from_megatron``:
  checked in ``prepare()`` (no process group), then each rank fills its slices of every parameter
  (:func:`folding.parallel.params.take_slice` of the full tensor the mapping builds). The optimizer
  starts fresh at step 0, as with ``checkpoint.init_from_hf``.

Usage::

    path = convert_megatron("megatron_ckpt", "engine_ckpt", get_preset("mixtral_8x7b"))
    model = load_model("engine_ckpt")
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import time
import warnings
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..job.config import ConfigError
from ..job.config import plain_tree as _plain
from ..model.config import ModelConfig
from ..model.hf.errors import CheckpointError
from ..model.transformer import MoETransformer
from ..moe.settings import LayerSettings
from ..parallel.params import require_spec, take_slice
from . import blocks
from .load import FORMAT, MARKER, META, _model_blocks, step_dir_name
from .megatron_names import Canon, engine_tensor, index_keys, unused_keys
from .megatron_store import MegatronStore

_BUFFERS = ("mlp.router.expert_bias",)
"""Engine buffers read from the checkpoint (the others, such as token counts, start at their initial value)."""


def one_rank_model(cfg: ModelConfig, *, device=None) -> MoETransformer:
    """A 1-rank inference model of ``cfg`` (every parameter whole, uninitialized; on ``device``, default CPU).
    Not inside a ``torch.distributed`` world of several ranks (the model's groups would be the world's)."""
    return MoETransformer(cfg.for_inference(), settings=LayerSettings(device=device), initialize=False)


def _targets(model: torch.nn.Module) -> Dict[str, Tuple[int, ...]]:
    """Engine name -> full shape of every parameter of ``model`` and of the buffers read from Megatron."""
    out = {n: tuple(require_spec(p, n).full_shape) for n, p in model.named_parameters()}
    for n, b in model.named_buffers():
        if b is not None and n.endswith(_BUFFERS):
            out[n] = tuple(b.shape)
    return out


def _fits(t: torch.Tensor, full: Tuple[int, ...]) -> bool:
    """Whether Megatron's tensor ``t`` is the engine's full tensor of shape ``full`` (the same shape, or the
    same elements with the same first and last dimension: ``[E, 2F, H]`` as ``[E, 2, F, H]``)."""
    if tuple(t.shape) == full:
        return True
    return t.numel() == math.prod(full) and t.dim() > 0 and t.shape[0] == full[0] and t.shape[-1] == full[-1]


def _meta_getter(store: MegatronStore, index):
    def get(i, rest, e):
        if (i, rest, e) not in index:
            raise KeyError((i, rest, e))
        key, lead = index[(i, rest, e)]
        return torch.empty(store.shapes[key][len(lead) :], device="meta")

    return get


def _read_getter(store: MegatronStore, index):
    cache: Dict[Tuple[str, Tuple[int, ...]], torch.Tensor] = {}

    def get(i, rest, e):
        key, lead = index[(i, rest, e)]
        if e is not None and len(lead) >= 1 and index.get((i, rest, 0), (None,))[0] == key:
            # experts stacked in one key: read the layer's experts at once, then take expert e
            whole = (key, lead[:-1])
            if whole not in cache:
                cache.clear()
                cache[whole] = store.read(key, lead[:-1])
            return cache[whole][lead[-1]]
        return store.read(key, lead)

    return get


def _place(canon: Canon) -> str:
    i, rest, e = canon
    return ("" if i is None else f"layer {i} ") + rest + ("" if e is None else f" (expert {e})")


def check_megatron(
    store: MegatronStore, cfg: ModelConfig, targets: Optional[Dict[str, Tuple[int, ...]]] = None
) -> Dict[str, Tuple[int, ...]]:
    """Check, reading no tensor, that ``store`` holds exactly the model of ``cfg``: every engine parameter's
    Megatron tensors present with the shapes ``cfg`` implies, and no other model tensor. Returns the engine
    names with their full shapes; raises :class:`CheckpointError` naming every problem. ``targets`` (engine
    name -> full shape) checks only those tensors (a rank's chunks) and not the keys left over; without it
    the whole 1-rank model of ``cfg`` is built on ``meta`` (outside a ``torch.distributed`` world of several
    ranks: see :func:`one_rank_model`)."""
    complete = targets is None
    if complete:
        targets = _targets(one_rank_model(cfg, device="meta"))
    if cfg.mla is not None or cfg.mtp_num_layers:
        raise CheckpointError(
            "this conversion reads GPT models with standard attention and no multi-token prediction; "
            "model.mla and model.mtp_num_layers must be unset"
        )
    index = index_keys(store.shapes)
    get, used = _meta_getter(store, index), []
    problems: List[str] = []
    for name, full in targets.items():
        mine: List[Canon] = []
        try:
            t = engine_tensor(name, cfg, get, mine)
        except KeyError as e:
            problems.append(f"{name}: the checkpoint has no {_place(e.args[0])}")
            continue
        except CheckpointError as e:
            problems.append(f"{name}: {e}")
            continue
        used += mine
        if not _fits(t, full):
            problems.append(f"{name}: the checkpoint gives shape {tuple(t.shape)}, the model config {full}")
    if complete:
        problems += unused_keys(store.shapes, index, used)
    if problems:
        hint = ""
        if any("mlp.router.expert_bias" in p for p in problems):
            hint = " (a router expert bias is read with moe.expert_bias=true)"
        if any("output_layer.weight" in p for p in problems) or any(p.startswith("output_weight") for p in problems):
            hint += " (tied embeddings: model.tie_embeddings must match --untie-embeddings-and-output-weights)"
        raise CheckpointError(
            f"Megatron checkpoint {store.path} does not fit the model config {cfg.name!r}{hint}: "
            + "; ".join(problems[:20])
            + ("" if len(problems) <= 20 else f"; ... and {len(problems) - 20} more")
        )
    return targets


def _full_tensors(store: MegatronStore, cfg: ModelConfig, names: Dict[str, Tuple[int, ...]]):
    """``(engine name, full tensor)`` for each of ``names``, read one engine tensor at a time."""
    get = _read_getter(store, index_keys(store.shapes))
    for name, full in names.items():
        yield name, engine_tensor(name, cfg, get).reshape(full)


def check_init_megatron(path: str, model: ModelConfig) -> str:
    """``checkpoint.init_from_megatron``: check that the Megatron checkpoint at ``path`` fits the job's
    ``model`` (names and shapes, reading no tensor); return the store's absolute path. Raises
    :class:`ConfigError` naming the setting. No process group is needed; inside a world of several ranks
    (a job that prepares after starting its processes) only the store is checked here, and each rank's
    parameters by :func:`load_megatron_weights` before it reads."""
    try:
        store = MegatronStore(path)
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            check_megatron(store, model)
    except CheckpointError as e:
        raise ConfigError(f"checkpoint.init_from_megatron={path!r}: {e}") from None
    return store.path


@torch.no_grad()
def load_megatron_weights(chunks, path: str) -> None:
    """Fill every parameter (and the router expert biases) of this rank's ``chunks`` from the Megatron
    checkpoint at ``path`` (checked by :func:`check_init_megatron`): each engine tensor is assembled whole
    and this rank's slice copied. Local to the rank: no collective."""
    store = MegatronStore(path)
    cfg = chunks[0].config
    for chunk in chunks:
        params = dict(chunk.named_parameters())
        buffers = dict(chunk.named_buffers())
        wanted = check_megatron(store, cfg, _targets(chunk))
        for name, full in _full_tensors(store, cfg, wanted):
            if name in params:
                p = params[name]
                p.copy_(take_slice(full, require_spec(p, name).shards).reshape(p.shape))
            else:
                buffers[name].copy_(full)


def convert_megatron(load: str, out: str, cfg: ModelConfig) -> str:
    """Write the Megatron-Core checkpoint at ``load`` (checked against ``cfg`` first: :func:`check_megatron`)
    as an engine checkpoint ``out/step_<iteration>`` on one process, without a process group; return its
    path. ``out`` must not exist (nothing is overwritten); the directory appears whole or not at all."""
    out = os.path.abspath(os.path.expanduser(out))
    if os.path.exists(out):
        raise CheckpointError(f"--out {out} already exists; choose a new directory (nothing is overwritten)")
    store = MegatronStore(load)
    targets = check_megatron(store, cfg)
    model = one_rank_model(cfg)
    tensors = {**dict(model.named_buffers()), **dict(model.named_parameters())}
    with torch.no_grad():
        for name, full in _full_tensors(store, cfg, targets):
            tensors[name].copy_(full.reshape(tensors[name].shape))
    tmp = f"{out}.tmp-{os.getpid()}-{time.time_ns()}"
    final = os.path.join(tmp, step_dir_name(store.iteration))
    try:
        os.makedirs(final)
        _save_blocks(model, final)
        meta = {
            "format": FORMAT,
            "step": store.iteration,
            "adam_updates": 0,
            "data": None,
            "tokenizer": None,
            "model": _plain(dataclasses.asdict(cfg)),
            "optim": None,
            "layout": "converted from Megatron-Core",
            "world_size": 1,
            "precision": "fp32",
            "master_weights": False,
            "run_dir": None,
            "hf_source_config": None,
            "megatron_source": store.path,
        }
        with open(os.path.join(final, META), "w", encoding="utf-8") as f:
            json.dump(meta, f, indent=1, sort_keys=True)
        with open(os.path.join(final, MARKER), "w") as f:
            f.write("ok\n")
        os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return os.path.join(out, step_dir_name(store.iteration))


def _save_blocks(model: torch.nn.Module, path: str) -> None:
    """DCP-save ``model``'s parameters and buffers as whole blocks (``model/<name>``, ``buffer/<name>``)."""
    import torch.distributed.checkpoint as dcp  # on first use: see folding.checkpoint.blocks

    sd = _model_blocks([model])
    with warnings.catch_warnings():  # DCP warns that it runs without a process group: intended
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(sd, checkpoint_id=path, planner=blocks.BlockSavePlanner(), no_dist=True)
