"""Layout-independent parameter initialization: every rank holds a slice of the same full tensor.

A parameter records, when its module creates it, how to build its *full* (unsharded) value and
which slice of it this rank holds (:func:`set_init_spec`). :func:`initialize_parameters` then
walks ``model.named_parameters()`` and, for each recorded parameter, draws the full tensor from a
``torch.Generator`` seeded by ``(init_seed, parameter name)`` and copies this rank's slice. The
name is the same in every layout (the module tree does not depend on the layout), so 1 rank and any
TP/EP/ETP layout hold exactly the same numbers. Modules that initialize themselves (the MoE
router, experts and shared expert: per-expert seeds, so a rank draws only its own experts) expose
``init_own_parameters()``, which :func:`initialize_parameters` calls too; parameters on the ``meta``
device are skipped. :func:`materialize` turns a model built on ``meta`` into one on a real device with
the same numbers as building it there (``nn.Module.to_empty`` would drop the parameters' recorded
specs and tags, so it is not used).

The full tensor is generated on CPU on every rank that holds a slice of it (simple and exact; for
a 151936x3584 embedding this is ~2 GiB of transient host memory per rank).

Usage::

    w = nn.Parameter(torch.empty(out // tp, inp))
    set_init_spec(w, full_shape=(out, inp), shards=((0, tp_rank, tp),), kind="normal", std=0.02)
    ...
    initialize_parameters(model, init_seed=1234)

    model = MoETransformer(cfg, parallel_state=ps, device="meta")   # nothing allocated
    materialize(model, device=torch.device("cuda", local_rank), init_seed=1234)
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from typing import Optional, Sequence, Tuple

import torch

_ATTR = "_folding_init"
KINDS = ("normal", "ones", "zeros")


@dataclasses.dataclass(frozen=True)
class InitSpec:
    """How to initialize one parameter: the full tensor and this rank's slice of it."""

    full_shape: Tuple[int, ...]
    """Shape of the full (1-rank) tensor."""
    shards: Tuple[Tuple[int, int, int], ...]
    """``(dim, index, count)`` triples: split ``dim`` in ``count`` equal chunks and keep chunk ``index``,
    applied in order. The slice is then reshaped to the parameter's shape (same number of elements):
    e.g. an expert ``fc1`` of full shape ``[E, 2, F, H]`` (gate; up) held as ``[E/EP, 2*F/ETP, H]``."""
    kind: str = "normal"
    """``normal`` (mean 0, ``std``), ``ones`` or ``zeros``."""
    std: float = 0.02
    """Standard deviation for ``normal``."""


def set_init_spec(
    p: torch.Tensor,
    *,
    full_shape: Sequence[int],
    shards: Sequence[Tuple[int, int, int]] = (),
    kind: str = "normal",
    std: float = 0.02,
) -> torch.Tensor:
    """Record on ``p`` how it is initialized (see :class:`InitSpec`); returns ``p``."""
    if kind not in KINDS:
        raise ValueError(f"init kind {kind!r}: choose one of {KINDS}")
    spec = InitSpec(
        tuple(int(s) for s in full_shape), tuple(tuple(int(v) for v in s) for s in shards), kind, float(std)
    )
    expected = list(spec.full_shape)
    for dim, index, count in spec.shards:
        if expected[dim] % count or not 0 <= index < count:
            raise ValueError(f"cannot take chunk {index} of {count} along dim {dim} of {spec.full_shape}")
        expected[dim] //= count
    if tuple(expected) != tuple(p.shape) and math.prod(expected) != p.numel():
        raise ValueError(f"parameter shape {tuple(p.shape)} is not the slice {tuple(expected)} of {spec.full_shape}")
    setattr(p, _ATTR, spec)
    return p


def init_spec(p: torch.Tensor):
    """The :class:`InitSpec` recorded on ``p``, or ``None``."""
    return getattr(p, _ATTR, None)


def param_seed(init_seed: int, name: str) -> int:
    """A 63-bit seed derived from ``init_seed`` and the parameter's name (stable across processes)."""
    digest = hashlib.blake2b(f"{init_seed}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def full_tensor(spec: InitSpec, seed: int) -> torch.Tensor:
    """The full fp32 CPU tensor described by ``spec`` drawn with ``seed``."""
    if spec.kind == "ones":
        return torch.ones(spec.full_shape)
    if spec.kind == "zeros":
        return torch.zeros(spec.full_shape)
    gen = torch.Generator().manual_seed(seed)
    return torch.empty(spec.full_shape).normal_(0.0, spec.std, generator=gen)


def take_slice(full: torch.Tensor, shards: Sequence[Tuple[int, int, int]]) -> torch.Tensor:
    """Apply ``(dim, index, count)`` chunking to ``full`` in order."""
    for dim, index, count in shards:
        full = full.chunk(count, dim=dim)[index]
    return full


@torch.no_grad()
def initialize_parameters(model: torch.nn.Module, init_seed: int) -> None:
    """Fill every parameter of ``model`` that has an :class:`InitSpec` with its slice of the full
    tensor, and call ``init_own_parameters()`` on every submodule that defines it (the router, the
    experts and the shared expert draw their layout-independent values from seeds they were built
    with). Meta tensors are skipped, so a model built on ``meta`` is initialized after ``to_empty``."""
    for module in model.modules():
        own = getattr(module, "init_own_parameters", None)
        if own is not None and not any(p.is_meta for p in module.parameters(recurse=False)):
            own()
    for name, p in model.named_parameters():
        spec = init_spec(p)
        if spec is None or p.is_meta:
            continue
        full = full_tensor(spec, param_seed(init_seed, name))
        p.copy_(take_slice(full, spec.shards).reshape(p.shape).to(p.dtype))


def shard_index(full_shape: Sequence[int], shards: Sequence[Tuple[int, int, int]]) -> Tuple[slice, ...]:
    """The per-dimension slices of the full tensor that :func:`take_slice` keeps."""
    start = [0] * len(full_shape)
    size = list(full_shape)
    for dim, index, count in shards:
        size[dim] //= count
        start[dim] += index * size[dim]
    return tuple(slice(a, a + n) for a, n in zip(start, size))


@torch.no_grad()
def materialize(model: torch.nn.Module, *, device, init_seed: Optional[int]) -> torch.nn.Module:
    """Allocate every ``meta`` parameter and buffer of ``model`` on ``device`` and, unless
    ``init_seed`` is None (weights about to be loaded), initialize them.

    Parameters keep their Python attributes (init specs, gradient-reduction tags) and their
    ``requires_grad``; buffers are zero-filled, then set by the modules' ``init_own_parameters``.
    Returns ``model``.
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
