"""Load and save Hugging Face Mixtral / Qwen2-MoE / Qwen3-MoE / OLMoE / DeepSeek-V3 checkpoints in any layout.

``from_hf(path)`` builds a 1-rank fp32 CPU model whose ``model(input_ids_BS)`` returns logits
``[B, S, V]``. ``from_hf(path, parallel_state=ps)`` builds the sharded model directly: every rank
reads, lazily and shard file by shard file (``safetensors.safe_open``), only the slices of the
tensors it holds. ``to_hf(model, out_dir)`` writes ``config.json`` and ``model.safetensors``, or
safetensors shards with their index beyond ``max_shard_bytes`` (gathering the pieces to global
rank 0); HF -> engine -> HF gives bit-identical tensors. A padded vocabulary
(``model.make_vocab_size_divisible_by``) is not in the Hugging Face tensors: the import fills the padded
rows with zeros, the export writes the first ``vocab_size`` rows and ``config.json``'s unpadded
``vocab_size``.

The mapping is driven by each parameter's :class:`~folding.parallel.params.ParamSpec` record (its
full shape and this rank's slice; a parameter without one is an error) and by
:func:`folding.model.hf.names.hf_components`,
which says which HF tensors make up the full tensor of an engine parameter: ``experts.fc1_weight``
is the stack ``[E, 2, F, H]`` of every expert's (gate, up) weights, ``experts.fc2_weight`` the stack
``[E, H, F]`` of the down weights.

Usage::

    model = from_hf("Mixtral-8x7B-v0.1", parallel_state=ps)
    to_hf(model, "out_dir")
"""

from __future__ import annotations

import json
import math
import os
import warnings
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from ...moe.settings import LayerSettings
from ...parallel.params import materialize, require_spec, shard_index
from ..config import ModelConfig
from ..transformer import MoETransformer
from .config import CheckpointError, config_from_hf, config_to_hf
from .deepseek import deepseek_buffers, deepseek_has_mtp, deepseek_mtp_copies
from .names import hf_components, hf_tensor_names

VOCAB_TABLES = ("embedding.weight", "output_weight")
"""The engine parameters with a row per vocabulary id: under ``model.make_vocab_size_divisible_by`` they
have ``padded_vocab_size`` rows, of which the Hugging Face tensors hold the first ``vocab_size``."""


def _hf_part(name: str, cfg: ModelConfig, shape: Tuple[int, ...], index: Tuple[slice, ...]):
    """``(hf shape, hf index, rows)`` of the part of an engine tensor (full ``shape``, this rank's ``index``)
    that the Hugging Face tensor holds: all of it (``rows`` ``None``), or for a padded vocabulary table
    the ``rows`` first rows of the slice (0: the slice is all padding)."""
    V = cfg.vocab_size
    if name not in VOCAB_TABLES or shape[0] == V:
        return shape, index, None
    stop = min(index[0].stop, V)
    rows = max(0, stop - index[0].start)
    return (V, *shape[1:]), (slice(index[0].start, index[0].start + rows), *index[1:]), rows


class _Reader:
    """Lazy access to the tensors of a checkpoint directory (single file or sharded with an index)."""

    def __init__(self, path: str):
        from safetensors import safe_open

        self._open, self.path, self._handles = safe_open, path, {}
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.exists(index):
            self.weight_map: Dict[str, str] = json.load(open(index))["weight_map"]
        elif os.path.exists(os.path.join(path, "model.safetensors")):
            with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
                self.weight_map = {k: "model.safetensors" for k in f.keys()}
        else:
            raise CheckpointError(f"{path} holds neither model.safetensors nor model.safetensors.index.json")
        missing = sorted({f for f in self.weight_map.values() if not os.path.exists(os.path.join(path, f))})
        if missing:
            raise CheckpointError(
                f"checkpoint {path} is missing shard files {missing} listed in its index; download them again"
            )

    def _file(self, name: str):
        fname = self.weight_map[name]
        if fname not in self._handles:
            self._handles[fname] = self._open(os.path.join(self.path, fname), "pt")
        return self._handles[fname]

    def close(self, fname: str) -> None:
        """Release the handle of shard file ``fname``."""
        self._handles.pop(fname, None)

    def read(self, name: str, shape: Tuple[int, ...], index: Tuple[slice, ...]) -> torch.Tensor:
        """Slice ``index`` of tensor ``name``, whose full shape must be ``shape``."""
        if name not in self.weight_map:
            raise CheckpointError(f"checkpoint {self.path} has no tensor {name!r}")
        sl = self._file(name).get_slice(name)
        got = tuple(sl.get_shape())
        if got != tuple(shape):
            raise CheckpointError(f"tensor {name!r} in {self.path} has shape {got}, the config implies {tuple(shape)}")
        return sl[index] if index else sl[:]


def read_hf_config(path: str) -> dict:
    """The ``config.json`` dict of a checkpoint directory."""
    f = os.path.join(path, "config.json")
    if not os.path.exists(f):
        raise CheckpointError(f"{path} has no config.json; point at a Hugging Face checkpoint directory")
    return json.load(open(f))


def hf_model_config(path: str) -> ModelConfig:
    """The :class:`ModelConfig` of the Hugging Face checkpoint directory ``path`` (what :func:`from_hf`
    builds): its ``config.json`` through :func:`~folding.model.hf.config.config_from_hf`, without
    multi-token prediction when the checkpoint holds no MTP tensors (as transformers saves them)."""
    cfg = config_from_hf(read_hf_config(path), name=os.path.basename(os.path.normpath(path)))
    if cfg.mtp_num_layers and not deepseek_has_mtp(_Reader(path).weight_map):
        # transformers drops the MTP layers and keeps num_nextn_predict_layers in config.json
        warnings.warn(
            f"{path}: config.json has num_nextn_predict_layers={cfg.mtp_num_layers} but the checkpoint "
            "holds no multi-token-prediction tensors (as transformers saves them); building the model "
            "without MTP (model.mtp_num_layers=0)",
            stacklevel=3,
        )
        cfg = cfg.replace(mtp_num_layers=0)
    return cfg


def _check_names(reader: _Reader, cfg: ModelConfig) -> None:
    """Raise :class:`CheckpointError` unless the checkpoint holds exactly the tensors ``cfg`` implies."""
    expected = set(hf_tensor_names(cfg))
    present = set(reader.weight_map) - {"lm_head.weight"} if cfg.tie_embeddings else set(reader.weight_map)
    if expected - present or present - expected:
        hint = ""
        if any(k.endswith("experts.gate_up_proj") for k in present):
            hint = (
                "; the checkpoint stores fused expert tensors (experts.gate_up_proj): save it with "
                "transformers' save_pretrained, which writes one tensor per expert"
            )
        raise CheckpointError(
            f"checkpoint {reader.path} does not match its config: missing {sorted(expected - present)[:8]}, "
            f"unexpected {sorted(present - expected)[:8]}{hint}"
        )


def check_hf_names(path: str, cfg: ModelConfig) -> None:
    """Check, reading only the index or the safetensors header, that the checkpoint at ``path`` holds
    exactly the tensors of ``cfg`` (:func:`hf_tensor_names`); raise :class:`CheckpointError` otherwise."""
    _check_names(_Reader(path), cfg)


@torch.no_grad()
def load_hf_weights(model: MoETransformer, path: str) -> None:
    """Copy into ``model`` the slices of the checkpoint at ``path`` that this rank holds.

    Reads file by file: each shard file is opened once, its needed slices are read, and it is closed.
    """
    reader, cfg = _Reader(path), model.config
    _check_names(reader, cfg)
    tasks: Dict[str, list] = {}  # file -> [(local buffer, slot, hf name, full shape, index)]
    buffers = []
    for name, p in model.named_parameters():
        spec = require_spec(p, name)
        idx = shard_index(spec.full_shape, spec.shards)
        local = torch.zeros(tuple(s.stop - s.start for s in idx), dtype=p.dtype)  # padded rows stay 0
        buffers.append((p, local))
        for lead, hf_name in hf_components(name, cfg):
            if any(not idx[d].start <= v < idx[d].stop for d, v in enumerate(lead)):
                continue
            slot = tuple(v - idx[d].start for d, v in enumerate(lead))
            shape, index, rows = _hf_part(name, cfg, spec.full_shape[len(lead) :], idx[len(lead) :])
            if rows is not None:  # a padded vocabulary table: its rows inside the vocabulary
                if not rows:
                    continue
                slot = (slice(0, rows),)
            tasks.setdefault(reader.weight_map[hf_name], []).append((local, slot, hf_name, shape, index))
    for fname in sorted(tasks):
        for local, slot, hf_name, shape, index in tasks[fname]:
            local[slot] = reader.read(hf_name, shape, index).to(local.dtype)
        reader.close(fname)
    for p, local in buffers:
        p.copy_(local.reshape(p.shape))
    for _, buf, hf_name in deepseek_buffers(model):  # router correction bias (replicated)
        buf.copy_(reader.read(hf_name, tuple(buf.shape), ()).to(buf.dtype))


def from_hf(
    path: str,
    *,
    parallel_state=None,
    moe_factory=None,
    dtype=torch.float32,
    device=None,
    config_overrides: Optional[dict] = None,
    compile_dense: bool = False,
) -> MoETransformer:
    """Build the engine model (1 rank, or this rank's shard under ``parallel_state``) from a HF checkpoint.

    Without a layout, ``model(input_ids_BS)`` returns logits ``[B, S, V]``; with one, see
    :class:`~folding.model.transformer.MoETransformer` for what each rank returns.
    ``config_overrides`` replaces :class:`ModelConfig` fields that do not change tensor shapes
    (e.g. ``{"moe": {"aux_loss_coeff": 0.01}}`` for training). The model is built on ``meta`` and its tensors
    allocated directly on ``device`` (default CPU) before the weights are read into them, so nothing
    is initialized only to be overwritten; ``device="meta"`` returns the structure without reading.
    ``compile_dense``: build the layers with their dense sublayers compiled (:mod:`folding.model.compile`).
    """
    hf = read_hf_config(path)
    cfg = hf_model_config(path)
    if config_overrides:
        cfg = cfg.replace(**config_overrides)
    # the experts' backend is the one that runs where the weights go; the structure is built on meta
    settings = LayerSettings(params_dtype=dtype, device=device, compile_dense=compile_dense)
    settings = settings.with_expert_backend(cfg.moe)
    model = MoETransformer(
        cfg, parallel_state=parallel_state, moe_factory=moe_factory, settings=settings.replace(device="meta")
    )
    if torch.device(device or "cpu").type != "meta":  # meta: the structure only, nothing is read
        materialize(model, device=device or "cpu", init_seed=None)
        load_hf_weights(model, path)
    model.hf_config = hf
    return model


def hf_pieces(model: MoETransformer) -> Dict[str, List[Tuple[Tuple[slice, ...], torch.Tensor]]]:
    """This rank's pieces of every HF tensor: ``hf name -> [(index into the full tensor, values)]``."""
    out: Dict[str, list] = {}
    for name, p in model.named_parameters():
        spec = require_spec(p, name)
        idx = shard_index(spec.full_shape, spec.shards)
        local = p.detach().cpu().reshape(tuple(s.stop - s.start for s in idx))
        for lead, hf_name in hf_components(name, model.config):
            if any(not idx[d].start <= v < idx[d].stop for d, v in enumerate(lead)):
                continue
            t = local[tuple(v - idx[d].start for d, v in enumerate(lead))]
            _, index, rows = _hf_part(name, model.config, spec.full_shape[len(lead) :], idx[len(lead) :])
            if rows is not None:  # a padded vocabulary table: the padding is not exported
                if not rows:
                    continue
                t = t[:rows]
            out.setdefault(hf_name, []).append((index, t.clone()))
    for _, buf, hf_name in deepseek_buffers(model):
        out[hf_name] = [(tuple(slice(0, n) for n in buf.shape), buf.detach().cpu().clone())]
    return out


def to_hf(
    model: MoETransformer,
    out_dir: str,
    *,
    dtype: Optional[torch.dtype] = None,
    max_shard_bytes: int = 5 * 2**30,
) -> None:
    """Write ``model`` as a Hugging Face checkpoint: ``config.json`` and ``model.safetensors``, or,
    when the weights exceed ``max_shard_bytes`` (5 GiB by default, as transformers shards),
    ``model-0000i-of-0000n.safetensors`` files with ``model.safetensors.index.json`` (tensors kept
    whole, in the checkpoint's name order; each shard is assembled only when it is written).

    Collective over the world when ``torch.distributed`` is initialized: every rank sends its pieces
    (host copies) to global rank 0, which assembles and writes the full tensors. The pieces travel
    on a gloo group over host memory, never through a GPU (on NCCL, ``gather_object`` would stage
    world × the largest message on rank 0's GPU). ``dtype`` defaults to the parameters' dtype. A
    weights file of the other layout (single file / index) left in ``out_dir`` by an earlier export
    is removed, so that loaders cannot pick the stale one.
    """
    from safetensors.torch import save_file

    if max_shard_bytes < 1:
        raise ValueError(f"to_hf: max_shard_bytes={max_shard_bytes} must be >= 1")
    pieces = hf_pieces(model)
    if dist.is_initialized() and dist.get_world_size() > 1:
        host_group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
        try:
            gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
            dist.gather_object(pieces, gathered, dst=0, group=host_group)
        finally:
            if host_group is not None:
                dist.destroy_process_group(host_group)
        if dist.get_rank() != 0:
            return
    else:
        gathered = [pieces]
    cfg = model.config
    shapes = {}
    for name, p in model.named_parameters():
        spec = require_spec(p, name)
        for lead, hf_name in hf_components(name, cfg):
            full = spec.full_shape[len(lead) :]
            shapes[hf_name] = _hf_part(name, cfg, full, tuple(slice(0, n) for n in full))[0]
    copies = deepseek_mtp_copies(cfg) if cfg.family == "deepseek_v3" else {}
    for copy, source in copies.items():  # DeepSeek-V3 stores the shared embedding/head again per MTP module
        shapes[copy] = shapes[source]
    fp32 = set()  # the router's correction bias stays fp32 (transformers keeps it fp32 too)
    for _, buf, hf_name in deepseek_buffers(model):
        shapes[hf_name] = tuple(buf.shape)
        fp32.add(hf_name)
    default_dtype = dtype or next(model.parameters()).dtype

    def dtype_of(hf_name):
        return torch.float32 if hf_name in fp32 else default_dtype

    def assemble(hf_name):
        hf_name = copies.get(hf_name, hf_name)
        full = torch.empty(shapes[hf_name], dtype=dtype_of(hf_name))
        covered = torch.zeros(shapes[hf_name], dtype=torch.bool)
        for rank_pieces in gathered:
            for index, t in rank_pieces.get(hf_name, []):
                full[index] = t.to(full.dtype)
                covered[index] = True
        if not bool(covered.all()):
            raise RuntimeError(f"export: no rank holds every slice of {hf_name}")
        return full.contiguous()

    names = hf_tensor_names(cfg)
    nbytes = {n: math.prod(shapes[n]) * dtype_of(n).itemsize for n in names}
    shards: List[List[str]] = [[]]
    size = 0
    for n in names:  # greedy, in name order; a tensor larger than the limit gets a shard of its own
        if shards[-1] and size + nbytes[n] > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(n)
        size += nbytes[n]
    os.makedirs(out_dir, exist_ok=True)
    single = os.path.join(out_dir, "model.safetensors")
    index_path = os.path.join(out_dir, "model.safetensors.index.json")
    files = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    umask = os.umask(0)
    os.umask(umask)
    for fname, shard in zip(files, shards):
        weights = os.path.join(out_dir, fname)
        save_file({n: assemble(n) for n in shard}, weights, metadata={"format": "pt"})
        os.chmod(weights, 0o666 & ~umask)  # like config.json (safetensors creates its file 0600)
    stale = index_path if len(shards) == 1 else single
    if os.path.exists(stale):
        os.remove(stale)
    if len(shards) > 1:
        weight_map = {n: f for f, shard in zip(files, shards) for n in shard}
        with open(index_path, "w") as f:
            json.dump({"metadata": {"total_size": sum(nbytes.values())}, "weight_map": weight_map}, f, indent=2)
    hf = dict(getattr(model, "hf_config", None) or config_to_hf(cfg))
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf, f, indent=2, sort_keys=True)
