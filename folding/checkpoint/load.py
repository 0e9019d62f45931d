"""Checkpoints that reshard across layouts, published atomically.

A checkpoint is a directory ``DIR/step_<8 digits>`` holding

- a ``torch.distributed.checkpoint`` (DCP) save of every parameter (``model/<name>``), persistent
  buffer (``buffer/<name>``) and the AdamW state shaped like its parameter
  (``optim/<name>/exp_avg|exp_avg_sq[|master]``, moments in their ``optim.exp_avg_dtype`` /
  ``optim.exp_avg_sq_dtype``: fp32 or bf16 as stored, fp8 dequantized to fp32; a resume into other
  state dtypes converts them, with a warning; under ``optim.name=muon`` Muon's parameters store
  ``optim/<name>/momentum[|master]`` in fp32 instead, and a resume under the other optimizer name
  fails naming ``optim.name``), each stored by its *full* shape as blocks
  (:mod:`.checkpoint_blocks`); names use global layer indices, so TP, CP, PP, VPP, EP, ETP and
  ``optim.distributed`` may all change between save and load;
- ``meta.json``: step, the data iterators' positions, the model and MoE configs (checked before any
  tensor is read), the layout, optimizer settings and ``data.tokenizer`` (information);
- ``rng/rank_<r>.pt``: each rank's RNG states (restored when the world size is unchanged; read with
  ``torch.load(weights_only=True)``);
- ``fp8/rank_<r>.pt`` (only when experts ran TransformerEngine with ``moe.fp8_recipe=delayed``, the
  one recipe with state): each rank's TE scales and amax histories per expert module, as plain tensors
  (read with ``torch.load(weights_only=True)``; no pickle is handed to TE), copied into the TE meta
  tensors of the modules holding the same experts (same layout); in another layout TE recalibrates
  from the next steps, with a warning;
- ``COMPLETE``: the completion marker.

Save: every rank writes into ``DIR/step_<N>.tmp-<nonce>``; once every rank's data is written, rank 0
writes ``meta.json`` and ``COMPLETE``, syncs, and publishes with one ``rename`` to ``DIR/step_<N>``
(:func:`folding.checkpoint.save.save_checkpoint` waits for the write;
:mod:`folding.checkpoint.async_save` lets training go on and publishes later, the same way).
Only directories named ``step_<N>`` that hold ``COMPLETE`` are ever loaded, so a crash during a save leaves the previous
checkpoint as the latest. ``keep_last`` prunes older complete checkpoints; nothing else in ``DIR``
is touched (left-over ``step_*.tmp-*`` directories of crashed saves are removed by the next save).

Usage::

    path = resolve_resume(job.checkpoint)                      # None, or the checkpoint to resume
    check_compatible(read_meta(path), job)                     # before any process group
    step = load_checkpoint(path, chunks=chunks, optimizer=opt, data=data, job=job)

Saving: :mod:`folding.checkpoint.save` (and :mod:`folding.checkpoint.async_save`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..job.config import ConfigError
from ..job.config import plain_tree as _plain
from ..model.config import ModelConfig
from ..model.transformer import MoETransformer
from ..parallel.params import require_spec
from . import blocks
from .blocks import Block

FORMAT = 1
MARKER = "COMPLETE"
META = "meta.json"
_STEP = re.compile(r"^step_(\d{8})$")
# ModelConfig fields that do not change any tensor: they may differ between save and load.
_FREE_MODEL_FIELDS = ("name", "init_std", "hidden_dropout", "attention_dropout")
SHAPED_MOE_FIELDS = (
    "num_experts",
    "ffn_hidden_size",
    "shared_expert_ffn_hidden_size",
    "shared_expert_gate",
    "expert_bias",  # a buffer exists only when on
)
"""The MoE options that shape tensors (every other MoE option, routing and dispatch alike, may change
between save and load)."""


def step_dir_name(step: int) -> str:
    """``step_00000042`` for step 42."""
    return f"step_{int(step):08d}"


def is_complete(path: str) -> bool:
    """Whether ``path`` is a published checkpoint: named ``step_<N>`` and holding the marker."""
    return bool(_STEP.match(os.path.basename(os.path.normpath(path)))) and os.path.isfile(os.path.join(path, MARKER))


def list_complete(ckpt_dir: str) -> List[Tuple[int, str]]:
    """``(step, path)`` of every complete checkpoint directly under ``ckpt_dir``, oldest first."""
    if not os.path.isdir(ckpt_dir):
        return []
    out = []
    for name in os.listdir(ckpt_dir):
        m = _STEP.match(name)
        if m and is_complete(os.path.join(ckpt_dir, name)):
            out.append((int(m.group(1)), os.path.join(ckpt_dir, name)))
    return sorted(out)


def latest_complete(ckpt_dir: str) -> Optional[str]:
    """The newest complete checkpoint under ``ckpt_dir``, or ``None``."""
    found = list_complete(ckpt_dir)
    return found[-1][1] if found else None


def resolve_resume(config) -> Optional[str]:
    """The checkpoint a job with :class:`~folding.job.config.CheckpointConfig` ``config`` resumes
    from: ``load`` itself when it is a complete checkpoint, the latest complete one when ``load`` is a
    directory of them; with ``load`` unset, the latest complete one in ``dir`` (a restarted job), or
    ``None``. Raises :class:`ConfigError` when ``load`` names nothing loadable."""
    if config.load:
        path = os.path.abspath(config.load)
        if is_complete(path):
            return path
        found = latest_complete(path)
        if found:
            return found
        if os.path.isdir(path) and _STEP.match(os.path.basename(os.path.normpath(path))):
            raise ConfigError(
                f"checkpoint.load={config.load!r} is an incomplete checkpoint (no {MARKER} marker: "
                "its save was interrupted); point at an earlier step or at the directory"
            )
        raise ConfigError(
            f"checkpoint.load={config.load!r} is neither a complete checkpoint nor a directory "
            "holding one; give a step_<N> directory or its parent, or checkpoint.load=null"
        )
    if config.dir:
        return latest_complete(os.path.abspath(config.dir))
    return None


def read_meta(path: str) -> Dict[str, Any]:
    """The ``meta.json`` of checkpoint ``path`` (plain JSON: reading it executes nothing)."""
    try:
        with open(os.path.join(path, META), encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"checkpoint {path} has no readable {META} ({e}); it was not written by this "
            "engine or is damaged: choose another checkpoint.load"
        ) from None
    if meta.get("format") != FORMAT:
        raise ConfigError(f"checkpoint {path} has format {meta.get('format')!r}, this engine reads {FORMAT}")
    return meta


def config_differences(
    reference: Dict[str, Any], model, *, free_model_fields: Sequence[str], moe_fields: Sequence[str]
) -> List[Tuple[str, Any, Any]]:
    """``(key, reference value, model's value)`` for every field of the :class:`ModelConfig` ``model``
    that differs from the plain dict ``reference`` (``dataclasses.asdict`` of a model config, MoE record
    under ``moe``): every ``model.*`` field but ``free_model_fields`` (nested records compared field by
    field, ``model.mla.kv_lora_rank``), and the ``moe.*`` fields in ``moe_fields``."""
    ref, now = dict(reference), _plain(dataclasses.asdict(model))
    ref_moe, now_moe = ref.pop("moe", None) or {}, now.pop("moe")
    # a field the reference lacks (written before the field existed) had its default
    defaults = {f.name: f.default for f in dataclasses.fields(model) if f.default is not dataclasses.MISSING}
    out = []
    for k in sorted(now):
        if k in _FREE_MODEL_FIELDS or k in free_model_fields:
            continue
        a, b = _plain(ref.get(k, defaults.get(k))), now[k]
        if isinstance(a, dict) and isinstance(b, dict):
            out += [(f"model.{k}.{f}", a.get(f), b[f]) for f in sorted(b) if _plain(a.get(f)) != b[f]]
        elif a != b:
            out.append((f"model.{k}", a, b))
    return out + [(f"moe.{k}", ref_moe.get(k), now_moe[k]) for k in moe_fields if _plain(ref_moe.get(k)) != now_moe[k]]


def check_compatible(meta: Dict[str, Any], job) -> None:
    """Fail with :class:`ConfigError` naming every differing ``model.*`` / ``moe.*`` field when the
    checkpoint's model is not ``job``'s (fields that change no tensor, such as ``model.init_std`` or
    ``moe.topk``, may differ), or naming ``optim.name`` when the checkpoint's optimizer is another
    (AdamW moments and Muon momentum do not convert into each other)."""
    diff = [
        f"{k}: checkpoint {a!r}, this job {b!r}"
        for k, a, b in config_differences(meta["model"], job.model, free_model_fields=(), moe_fields=SHAPED_MOE_FIELDS)
    ]
    optim = getattr(job, "optim", None)
    saved = (meta.get("optim") or {}).get("name", "adamw")
    if optim is not None and saved != optim.name:
        raise ConfigError(
            f"checkpoint {meta.get('path', '')} holds {saved} optimizer state and this job sets "
            f"optim.name={optim.name}: resume with optim.name={saved} (the states do not convert), or "
            f"start a new run from its weights"
        )
    if diff:
        raise ConfigError(
            f"checkpoint {meta.get('path', '')} holds another model: "
            + "; ".join(diff)
            + ". Use the model it was trained with, or a checkpoint of this model"
        )


# ---------------------------------------------------------------------------------- state dict
def _model_blocks(chunks: Sequence[torch.nn.Module]) -> Dict[str, Block]:
    out: Dict[str, Block] = {}
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            key = f"model/{name}"
            if key in out:  # tied embedding: first and last chunk
                out[key].mirrors.append(p.data)
                continue
            out[key] = Block.for_spec(p.data, require_spec(p, name))
        params = {n for n, _ in chunk.named_parameters()}
        for name, b in chunk.state_dict(keep_vars=True).items():
            if name not in params and isinstance(b, torch.Tensor) and f"buffer/{name}" not in out:
                out[f"buffer/{name}"] = Block.whole(b.data)
    return out


def _optimizer_names(chunks, optimizer) -> Dict[str, str]:
    """Optimizer parameter name -> the parameter's name inside its chunk (layout-independent)."""
    canon = {id(p): n for c in chunks for n, p in c.named_parameters()}
    return {n: canon[id(p)] for buf in optimizer.buffers for n, p in zip(buf.names, buf.params)}


def _optim_blocks(
    chunks, optimizer, model_blocks: Dict[str, Block], states: Dict[str, Dict[str, torch.Tensor]]
) -> Dict[str, Block]:
    out: Dict[str, Block] = {}
    for oname, name in _optimizer_names(chunks, optimizer).items():
        mb = model_blocks[f"model/{name}"]
        for key, t in states[oname].items():
            k = f"optim/{name}/{key}"
            if k in out:
                out[k].mirrors.append(t)
            else:
                out[k] = Block(t.view(mb.local.shape), mb.full_shape, mb.offsets)
    return out


def _fp8_modules(chunks):
    """``(chunk index, module name) -> module`` for every module holding TransformerEngine FP8 state."""
    return {(i, n): m for i, c in enumerate(chunks) for n, m in c.named_modules() if hasattr(m, "fp8_state")}


def _fp8_states(chunks) -> Dict[Any, dict]:
    """This rank's TransformerEngine ``delayed`` FP8 state (scales, amax histories) per expert module."""
    return {k: st for k, m in _fp8_modules(chunks).items() for st in [m.fp8_state()] if st}


def _load_fp8_states(chunks, path: str) -> None:
    """Restore the FP8 state saved by this rank when it belongs to the same experts (same layout);
    otherwise TransformerEngine recalibrates its scales from the next steps, and the log says so."""
    if not os.path.exists(path):
        return
    saved = torch.load(path, weights_only=True)
    modules = _fp8_modules(chunks)
    restored = sum(1 for k, st in saved.items() if k in modules and modules[k].load_fp8_state(st))
    if restored < len(saved):
        warnings.warn(
            f"checkpoint FP8 state: {restored} of {len(saved)} expert modules restored (the others belong "
            f"to other experts in this layout, or were saved as TransformerEngine's pickled extra state by "
            f"an older version); TransformerEngine recalibrates their scales"
        )


# ---------------------------------------------------------------------------------- load
STATE_DTYPE_KEYS = ("exp_avg_dtype", "exp_avg_sq_dtype", "main_params_dtype", "main_grads_dtype")
"""``optim.*`` keys whose change between save and resume converts the optimizer state."""


def _warn_state_conversion(meta: Dict[str, Any], job) -> None:
    """Warn when the checkpoint's optimizer state dtypes differ from this run's: the states are
    converted on load (widening is exact, narrowing rounds to nearest)."""
    saved = meta.get("optim") or {}
    changed = [
        f"optim.{k}: {saved.get(k, 'fp32')} -> {getattr(job.optim, k)}"
        for k in STATE_DTYPE_KEYS
        if saved.get(k, "fp32") != getattr(job.optim, k)
    ]
    if changed:
        warnings.warn(
            f"checkpoint {meta.get('path')}: optimizer state saved in other dtypes ({'; '.join(changed)}); "
            f"converting it on load (narrowing rounds to nearest; an fp32 master copy that this run "
            f"does not keep is dropped, one it keeps without a saved copy starts from the parameters)"
        )


def _check_saved_shapes(path: str, sd: Dict[str, Block]) -> None:
    """Compare the requested keys and full shapes with the checkpoint's metadata (no tensor read)."""
    import torch.distributed.checkpoint as dcp  # on first use: see folding.checkpoint.blocks

    md = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    missing = sorted(k for k in sd if k not in md)
    wrong = [
        f"{k}: saved {tuple(md[k].size)}, expected {tuple(b.full_shape)}"
        for k, b in sd.items()
        if k in md and tuple(getattr(md[k], "size", ())) != tuple(b.full_shape)
    ]
    if missing or wrong:
        raise ConfigError(
            f"checkpoint {path} does not fit this model: missing {missing[:6]}, "
            f"shape mismatches {wrong[:6]}; load a checkpoint of this model"
        )


@torch.no_grad()
def load_checkpoint(path: str, *, chunks, optimizer, data, job) -> int:
    """Load checkpoint ``path`` into this rank's ``chunks``, ``optimizer`` and ``data`` whatever the
    layout that saved it (collective over the world); return its step. The model config is checked
    first (:func:`check_compatible`), then the tensors' names and full shapes, before any tensor is read.
    """
    meta = read_meta(path)
    meta["path"] = path
    check_compatible(meta, job)
    model = _model_blocks(chunks)
    _warn_state_conversion(meta, job)
    dtypes = optimizer.state_dtypes()
    fp32 = {
        n: {k: torch.empty_like(p.data, dtype=dtypes[k]) for k in optimizer.moment_keys(buf)}
        for buf in optimizer.buffers
        for n, p in zip(buf.names, buf.params)
    }
    if meta.get("master_weights"):
        for buf in optimizer.buffers:
            if not optimizer.has_master_copy(buf):
                continue  # bf16 master weights: the parameter is the master
            for n, p in zip(buf.names, buf.params):
                fp32[n]["master"] = torch.empty_like(p.data, dtype=torch.float32)
    sd: Dict[str, Any] = dict(model)
    sd.update(_optim_blocks(chunks, optimizer, model, fp32))
    _check_saved_shapes(path, sd)
    import torch.distributed.checkpoint as dcp

    dcp.load(sd, checkpoint_id=path, planner=blocks.BlockLoadPlanner())
    for b in sd.values():
        b.sync_mirrors()
    optimizer.load_param_state(fp32, step=int(meta["step"]), updates=meta.get("adam_updates"))
    if data is not None and meta.get("data") is not None:
        data.load_state_dict(meta["data"])
    _load_fp8_states(chunks, os.path.join(path, "fp8", f"rank_{dist.get_rank()}.pt"))
    rng = os.path.join(path, "rng", f"rank_{dist.get_rank()}.pt")
    if meta.get("world_size") == dist.get_world_size() and os.path.exists(rng):
        st = torch.load(rng, weights_only=True)
        torch.set_rng_state(st["cpu"])
        if "cuda" in st and torch.cuda.is_available():
            torch.cuda.set_rng_state(st["cuda"])
    return int(meta["step"])


def load_full_model(path: str, model: torch.nn.Module) -> Dict[str, Any]:
    """Fill a 1-rank ``model`` (every parameter whole) from checkpoint ``path`` without a process
    group (used by export); returns the checkpoint's meta. Optimizer state is not read."""
    meta = read_meta(path)
    sd = _model_blocks([model])
    sd = {k: v for k, v in sd.items() if k.startswith("model/")}
    _check_saved_shapes(path, sd)
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():  # DCP warns that it runs without a process group: intended
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(sd, checkpoint_id=path, planner=blocks.BlockLoadPlanner(), no_dist=True)
    for b in sd.values():
        b.sync_mirrors()
    return meta


def load_model(checkpoint: str) -> MoETransformer:
    """The model of training checkpoint ``checkpoint`` (a checkpoint directory, or a ``checkpoint.dir`` holding
    complete ones: the latest), on one process: every parameter whole, fp32, on CPU, in eval mode, without the
    training-only MoE options (:meth:`ModelConfig.for_inference`). ``model(ids)`` (``ids``: ``[B, S]`` token ids)
    gives the logits ``[B, S, vocab]``; no process group is needed. Whatever layout wrote the checkpoint (blocks
    are read as :func:`load_full_model` reads them); ``ValueError`` naming ``checkpoint`` when it holds none."""
    path = checkpoint if is_complete(checkpoint) else latest_complete(checkpoint)
    if path is None:
        raise ValueError(f"{checkpoint}: neither a complete checkpoint nor a directory holding one")
    model = MoETransformer(ModelConfig.from_dict(read_meta(path)["model"]).for_inference(), initialize=False)
    load_full_model(path, model)
    return model.eval()
