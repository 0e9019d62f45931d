"""One record per parameter: how it is parallelized, which slice of which full tensor it holds, and
how that full tensor is drawn. Initialization, gradient reduction, clipping, checkpoints and Hugging
Face conversion all read this record and nothing else.

A module describes each parameter when it creates it:

- :func:`mark_param` sets its parallel nature (the fields gradient reduction and clipping read):
  ``expert`` (sharded over EP, gradient reduced over EDP), ``tp_sharded`` (over the
  view's TP group: attention TP for dense parameters, ETP for experts), ``sequence_parallel``
  (replicated over TP but fed by sequence-sharded activations: partial gradients summed over TP),
  ``embedding_tied`` (word embedding / output weight tied across the first and last pipeline
  stage).
- :func:`set_init_spec` sets its value: the *full* (1-rank) shape, the ``(dim, index, count)``
  chunks this rank keeps, the init law (``normal`` with ``std``, ``ones``, ``zeros``) and, for
  expert weights, ``chunk_dim``: the full tensor is drawn one slice along that dimension at a time
  (one expert at a time), so a rank draws only the experts it holds.

:func:`initialize_parameters` fills every parameter from its record with a generator seeded by
:func:`param_seed` ``(init_seed, parameter name)`` (``name#i`` for chunk ``i``): the one seed
function. Names do not depend on the layout, so 1 rank and every TP/EP/ETP/PP layout hold exactly the
same numbers. Parameters on the ``meta`` device are skipped; :func:`materialize` allocates a
meta-built model on a real device and initializes it. A parameter without a value record is an error
wherever one is needed (:func:`require_spec`).

Usage::

    w = mark_param(nn.Parameter(torch.empty(out // tp, inp, device=device)), tp_sharded=True)
    set_init_spec(w, full_shape=(out, inp), shards=((0, tp_rank, tp),), std=0.02)
    fc1 = set_init_spec(mark_param(p, expert=True, tp_sharded=True), full_shape=(E, 2, F, H),
                        shards=((0, ep_rank, ep), (2, etp_rank, etp)), std=0.02, chunk_dim=0)
    initialize_parameters(model, init_seed=1234)
    param_spec(w).tp_sharded, require_spec(w, "w").full_shape
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from typing import Optional, Sequence, Tuple

import torch

_ATTR = "_folding_param"
KINDS = ("normal", "ones", "zeros")


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """The record of one parameter (see the module docstring)."""

    expert: bool = False
    """Expert parameter: sharded over EP; gradients reduced over EDP, not over DP×CP."""
    tp_sharded: bool = False
    """Sharded over the view's TP group (TP for dense, ETP for expert); ``shards`` says along which
    dimension of the full tensor."""
    sequence_parallel: bool = False
    """Replicated over TP with partial gradients under sequence parallelism (summed over TP)."""
    embedding_tied: bool = False
    """Tied between the first and last pipeline stages (gradients summed over the embedding group)."""
    full_shape: Optional[Tuple[int, ...]] = None
    """Shape of the full (1-rank) tensor; ``None`` until :func:`set_init_spec` records the value."""
    shards: Tuple[Tuple[int, int, int], ...] = ()
    """``(dim, index, count)``: split ``dim`` of the full tensor in ``count`` equal chunks and keep chunk
    ``index``, applied in order; the slice is reshaped to the parameter's shape (same number of
    elements), e.g. expert ``fc1`` of full shape ``[E, 2, F, H]`` held as ``[E/EP, 2·F/ETP, H]``."""
    kind: str = "normal"
    """Init law: ``normal`` (mean 0, ``std``), ``ones`` or ``zeros``."""
    std: float = 0.02
    """Standard deviation for ``normal``."""
    chunk_dim: Optional[int] = None
    """Draw the full tensor one slice along this dimension at a time (slice ``i`` seeded by
    ``param_seed(init_seed, f"{name}#{i}")``), generating only the slices this rank keeps."""


def param_spec(p: torch.Tensor) -> ParamSpec:
    """The record of ``p`` (defaults, i.e. a dense replicated parameter without a value, if none)."""
    return getattr(p, _ATTR, None) or ParamSpec()


def mark_param(p: torch.nn.Parameter, **tags) -> torch.nn.Parameter:
    """Set the parallel fields of ``p``'s record (keyword arguments among ``expert``, ``tp_sharded``,
    ``sequence_parallel``, ``embedding_tied``); returns ``p``."""
    allowed = ("expert", "tp_sharded", "sequence_parallel", "embedding_tied")
    unknown = sorted(set(tags) - set(allowed))
    if unknown:
        raise TypeError(f"mark_param: unknown field(s) {unknown}; use {allowed}")
    spec = dataclasses.replace(param_spec(p), **tags)
    if spec.sequence_parallel and spec.tp_sharded:
        raise ValueError("a parameter cannot be both tp_sharded and sequence_parallel")
    setattr(p, _ATTR, spec)
    return p


def set_init_spec(
    p: torch.Tensor,
    *,
    full_shape: Sequence[int],
    shards: Sequence[Tuple[int, int, int]] = (),
    kind: str = "normal",
    std: float = 0.02,
    chunk_dim: Optional[int] = None,
) -> torch.Tensor:
    """Set the value fields of ``p``'s record (see :class:`ParamSpec`), checking that ``p`` is the
    slice the shards describe; returns ``p``."""
    if kind not in KINDS:
        raise ValueError(f"init kind {kind!r}: choose one of {KINDS}")
    full = tuple(int(s) for s in full_shape)
    cuts = tuple(tuple(int(v) for v in s) for s in shards)
    expected = list(full)
    for dim, index, count in cuts:
        if expected[dim] % count or not 0 <= index < count:
            raise ValueError(f"cannot take chunk {index} of {count} along dim {dim} of {full}")
        expected[dim] //= count
    if tuple(expected) != tuple(p.shape) and math.prod(expected) != p.numel():
        raise ValueError(f"parameter shape {tuple(p.shape)} is not the slice {tuple(expected)} of {full}")
    if chunk_dim is not None and not 0 <= chunk_dim < len(full):
        raise ValueError(f"chunk_dim={chunk_dim} is not a dimension of {full}")
    spec = dataclasses.replace(param_spec(p), full_shape=full, shards=cuts, kind=kind, std=float(std))
    setattr(p, _ATTR, dataclasses.replace(spec, chunk_dim=chunk_dim))
    return p


def require_spec(p: torch.Tensor, name: str) -> ParamSpec:
    """The record of parameter ``name``, which must hold its value fields (full shape and slice);
    raises ``ValueError`` naming the parameter otherwise (checkpoints and Hugging Face export cannot
    place a tensor they know nothing about)."""
    spec = param_spec(p)
    if spec.full_shape is None:
        raise ValueError(
            f"parameter {name!r} has no init/shard record: the module that creates it must call "
            "folding.parallel.params.set_init_spec(...) so checkpoints know which slice of which full tensor it is"
        )
    return spec


def param_seed(init_seed: int, name: str) -> int:
    """A 63-bit seed derived from ``init_seed`` and a parameter's name (stable across processes): the
    one seed function of the engine."""
    digest = hashlib.blake2b(f"{init_seed}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def shard_index(full_shape: Sequence[int], shards: Sequence[Tuple[int, int, int]]) -> Tuple[slice, ...]:
    """The per-dimension slices of the full tensor that ``shards`` keep."""
    start = [0] * len(full_shape)
    size = list(full_shape)
    for dim, index, count in shards:
        size[dim] //= count
        start[dim] += index * size[dim]
    return tuple(slice(a, a + n) for a, n in zip(start, size))


def take_slice(full: torch.Tensor, shards: Sequence[Tuple[int, int, int]]) -> torch.Tensor:
    """Apply ``(dim, index, count)`` chunking to ``full`` in order."""
    return full[shard_index(full.shape, shards)]


def _draw(shape: Sequence[int], spec: ParamSpec, seed: int) -> torch.Tensor:
    if spec.kind == "ones":
        return torch.ones(tuple(shape))
    if spec.kind == "zeros":
        return torch.zeros(tuple(shape))
    gen = torch.Generator().manual_seed(seed)
    return torch.empty(tuple(shape)).normal_(0.0, spec.std, generator=gen)


def local_value(spec: ParamSpec, init_seed: int, name: str) -> torch.Tensor:
    """This rank's slice (fp32, CPU, in the full tensor's dimensions) of the full initial tensor of
    parameter ``name``. With ``chunk_dim`` only the slices this rank keeps are drawn."""
    index = shard_index(spec.full_shape, spec.shards)
    d = spec.chunk_dim
    if d is None:
        return _draw(spec.full_shape, spec, param_seed(init_seed, name))[index]
    piece = spec.full_shape[:d] + spec.full_shape[d + 1 :]
    held = [_draw(piece, spec, param_seed(init_seed, f"{name}#{i}")) for i in range(index[d].start, index[d].stop)]
    return torch.stack(held, d)[tuple(slice(None) if k == d else s for k, s in enumerate(index))]


@torch.no_grad()
def initialize_parameters(model: torch.nn.Module, init_seed: int) -> None:
    """Fill every parameter of ``model`` that has a value record with its slice of the full tensor
    drawn from ``(init_seed, its name in model)``; meta parameters are skipped."""
    for name, p in model.named_parameters():
        spec = param_spec(p)
        if spec.full_shape is None or p.is_meta:
            continue
        p.copy_(local_value(spec, init_seed, name).reshape(p.shape).to(p.dtype))


@torch.no_grad()
def materialize(model: torch.nn.Module, *, device, init_seed: Optional[int]) -> torch.nn.Module:
    """Allocate every ``meta`` parameter and buffer of ``model`` on ``device`` and, unless
    ``init_seed`` is None (weights about to be loaded), initialize the parameters from their records.

    Parameters keep their record and ``requires_grad`` (``nn.Module.to_empty`` would drop the
    record); buffers are zero-filled. Returns ``model``.
    """
    device = torch.device(device)
    for module in model.modules():
        for key, p in list(module._parameters.items()):
            if p is None or not p.is_meta:
                continue
            new = torch.nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad)
            new.__dict__.update(p.__dict__)
            module._parameters[key] = new
        for key, b in list(module._buffers.items()):
            if b is not None and b.is_meta:
                module._buffers[key] = torch.zeros_like(b, device=device)
    if init_seed is not None:
        initialize_parameters(model, init_seed)
    return model
