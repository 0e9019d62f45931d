"""What a forward leaves alive for its backward, measured: a storage census and an autograd-graph walk.

:class:`KeptCensus` records every tensor storage created while it is active (a
``TorchDispatchMode`` sees each aten op's outputs), with the op that made it and the innermost module
whose forward was running (forward pre/post hooks on the modules it is given). After the forward,
:meth:`KeptCensus.kept` lists those still alive once Python's garbage is collected, except the
storages of the outputs the caller holds: exactly the bytes the forward keeps for backward, whatever
keeps them (saved tensors, checkpoint inputs, attributes of autograd contexts, an offload tier). A
region run under ``torch.utils.checkpoint`` therefore shows what recompute keeps, and a storage freed
by a discarding recompute shows as freed.

:func:`saved_by_node` walks the autograd graph from outputs and lists, for every node, the tensors it
saved (``_saved_*`` of built-in nodes; ``saved_tensors`` and tensor attributes of custom functions):
which node keeps what, by name. It unpacks every saved tensor, so it is for graphs without
saved-tensor hooks (no recompute, no offloading: unpacking a checkpointed tensor would recompute it).

:func:`cast_copies` finds kept tensors that hold the same values as another kept tensor in another
dtype or storage (an fp32 copy of a bf16 input): a second copy of the same values.

Usage (one process, a layer of a model)::

    with KeptCensus(layer) as census:
        x = census.make(lambda: x0.clone().requires_grad_())    # the input, attributed to "input"
        y = layer(x, rope)
    kept = census.kept(y)                                         # [KeptStorage, ...]
    by_module = bytes_by(kept, lambda k: k.module.split(".")[0])
    nodes = saved_by_node(y)                                      # [SavedTensor, ...]
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import gc
from typing import Callable, Dict, Iterable, List, Tuple

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = [
    "KeptCensus",
    "KeptStorage",
    "SavedTensor",
    "bytes_by",
    "cast_copies",
    "layer_census",
    "layer_term",
    "loss_census",
    "saved_by_node",
]


@dataclasses.dataclass(frozen=True)
class KeptStorage:
    """One storage created by the forward and alive after it."""

    module: str
    """Dotted name (relative to the census's root) of the innermost module whose forward created it;
    ``"input"`` for :meth:`KeptCensus.make`, ``""`` for the root's own code."""
    op: str
    """The aten op that created it (``aten._to_copy.default``, ...)."""
    shape: Tuple[int, ...]
    """Shape of the tensor the op returned."""
    dtype: torch.dtype
    """Its dtype."""
    nbytes: int
    """Bytes of the storage now (a storage freed by a discarding recompute is not listed)."""
    tier: str = "device"
    """``"host"`` for an activation offloader's host copy (:meth:`KeptCensus.kept`'s ``host``), else ``"device"``."""


class _Recorder(TorchDispatchMode):
    def __init__(self, census: "KeptCensus"):
        super().__init__()
        self.census = census

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            StorageWeakRef(t.untyped_storage()).cdata
            for t in tree_flatten((args, kwargs or {}))[0]
            if isinstance(t, torch.Tensor)
        }
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.census._record(t, str(func), inputs)
        return out


class KeptCensus:
    """Context manager: record the storages created inside, by op and module (see the module docstring).

    ``root``: the module whose submodules name the storages (hooks are added on entry, removed on exit).
    """

    def __init__(self, root: nn.Module):
        self.root = root
        self._records: Dict[int, Tuple[StorageWeakRef, KeptStorage]] = {}
        self._stack: List[str] = [""]
        self._handles = []
        self._mode = None

    def __enter__(self) -> "KeptCensus":
        for name, mod in self.root.named_modules():
            self._handles.append(mod.register_forward_pre_hook(self._push(name)))
            self._handles.append(mod.register_forward_hook(self._pop, always_call=True))
        self._mode = _Recorder(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _push(self, name: str):
        def hook(module, args):
            self._stack.append(name)

        return hook

    def _pop(self, module, args, output):
        self._stack.pop()

    def _record(self, t: torch.Tensor, op: str, inputs) -> None:
        s = t.untyped_storage()
        ref = StorageWeakRef(s)
        if ref.cdata in inputs:  # a view of, or an in-place op on, an existing storage
            return
        known = self._records.get(ref.cdata)
        if known is not None and not known[0].expired():
            return
        rec = KeptStorage(self._stack[-1], op, tuple(t.shape), t.dtype, s.nbytes())
        self._records[ref.cdata] = (ref, rec)

    def make(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        """``fn()``, its new storages attributed to ``"input"`` (an input the forward keeps counts)."""
        self._stack.append("input")
        try:
            return fn()
        finally:
            self._stack.pop()

    def kept(self, *held: torch.Tensor, host: Iterable[torch.Tensor] = ()) -> List[KeptStorage]:
        """The recorded storages still alive, except those of the tensors in ``held`` (the outputs the
        caller keeps anyway), largest first; those of ``host`` (an offloader's host copies,
        :meth:`folding.memory.offload.Offloader.host_tensors`) are marked ``tier="host"``."""
        gc.collect()
        skip = {StorageWeakRef(t.untyped_storage()).cdata for t in held if t is not None}
        on_host = {StorageWeakRef(t.untyped_storage()).cdata for t in host}
        alive = []
        for key, (ref, rec) in self._records.items():
            if ref.expired() or key in skip:
                continue
            now = torch.UntypedStorage._new_with_weak_ptr(ref.cdata).nbytes()  # 0 once discarded
            if now:
                alive.append(dataclasses.replace(rec, nbytes=now, tier="host" if key in on_host else "device"))
        return sorted(alive, key=lambda r: -r.nbytes)


def bytes_by(kept: Iterable, key: Callable) -> Dict:
    """Sum of ``nbytes`` per ``key(entry)`` (insertion order of first appearance)."""
    out: Dict = collections.OrderedDict()
    for k in kept:
        out[key(k)] = out.get(key(k), 0) + k.nbytes
    return out


@dataclasses.dataclass(frozen=True)
class SavedTensor:
    """One tensor an autograd node keeps for its backward."""

    node: str
    """The node's class name (``_RMSNormBackward``, ``MmBackward0``, ...)."""
    slot: str
    """Where it keeps it: ``_saved_self``, ``saved_tensors[1]``, a context attribute's name."""
    tensor: torch.Tensor
    """The tensor itself."""
    nbytes: int
    """Bytes of its storage when this is the first entry that keeps that storage, else 0."""

    def describe(self) -> str:
        """``node.slot dtype[shape]`` (for messages)."""
        dt = str(self.tensor.dtype).replace("torch.", "")
        return f"{self.node}.{self.slot} {dt}{list(self.tensor.shape)}"


def _tensors_in(value, name: str, depth: int = 0):
    if isinstance(value, torch.Tensor):
        yield name, value
    elif depth < 2 and isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _tensors_in(v, f"{name}[{i}]", depth + 1)
    elif depth < 2 and dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            yield from _tensors_in(getattr(value, f.name), f"{name}.{f.name}", depth + 1)


def _saved_of(node) -> List[Tuple[str, torch.Tensor]]:
    out = []
    if hasattr(node, "saved_tensors"):  # a custom autograd function's context
        out += [(f"saved_tensors[{i}]", t) for i, t in enumerate(node.saved_tensors) if t is not None]
        for k, v in vars(node).items():
            out += list(_tensors_in(v, k))
    for name in dir(node):
        if name.startswith("_saved_"):
            out += list(_tensors_in(getattr(node, name), name))
    return out


def saved_by_node(*outputs: torch.Tensor, exclude: Iterable[torch.Tensor] = ()) -> List[SavedTensor]:
    """Every tensor the autograd graph behind ``outputs`` keeps, node by node (depth-first from the
    outputs); leaves that require grad (parameters) and the storages of ``exclude`` are left out,
    each storage's bytes go to the first entry that keeps it. For graphs without saved-tensor hooks."""
    skip = {StorageWeakRef(t.untyped_storage()).cdata for t in exclude}
    seen_nodes, seen_storage, out = set(), set(), []
    stack = [o.grad_fn for o in outputs if o is not None and o.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or node in seen_nodes:
            continue
        seen_nodes.add(node)
        for slot, t in _saved_of(node):
            if t.is_leaf and t.requires_grad:
                continue
            key = StorageWeakRef(t.untyped_storage()).cdata
            if key in skip:
                continue
            first = key not in seen_storage
            seen_storage.add(key)
            out.append(SavedTensor(type(node).__name__, slot, t, t.untyped_storage().nbytes() if first else 0))
        stack.extend(f for f, _ in node.next_functions)
    return out


def cast_copies(saved: List[SavedTensor]) -> List[Tuple[SavedTensor, SavedTensor]]:
    """Pairs ``(a, b)`` of entries of ``saved`` on different storages with the same shape whose values
    are equal once ``a`` is cast to ``b``'s dtype, ``a`` being the wider: a copy of ``b`` (``a`` an fp32
    copy of a bf16 ``b``, or the same values twice). Integer and tiny (< 64 elements) tensors are left
    out: indices and scalars repeat by nature."""
    big = [s for s in saved if s.tensor.is_floating_point() and s.tensor.numel() >= 64]
    pairs = []
    for i, a in enumerate(big):
        for b in big[i + 1 :]:
            ta, tb = a.tensor, b.tensor
            if ta.shape != tb.shape or ta.untyped_storage().data_ptr() == tb.untyped_storage().data_ptr():
                continue
            wide, narrow = (a, b) if ta.element_size() >= tb.element_size() else (b, a)
            if torch.equal(wide.tensor.detach().to(narrow.tensor.dtype), narrow.tensor.detach()):
                if torch.equal(wide.tensor.detach(), narrow.tensor.detach().to(wide.tensor.dtype)):
                    pairs.append((wide, narrow))
    return pairs


def layer_term(module: str, is_moe: bool) -> str:
    """The memory model's term (:data:`folding.planning.activations.TERMS`) of a storage that ``module`` (a
    name inside one :class:`~folding.model.block.TransformerLayer`, as :class:`KeptCensus` gives it) made."""
    if module in ("input", ""):
        return "input" if module else "residual"
    if module in ("input_norm", "post_attention_norm"):
        return "norms"
    if module.startswith("attention"):
        return "attention"
    if not is_moe:
        return "mlp"
    for prefix, term in (("mlp.router", "router"), ("mlp.experts", "experts"), ("mlp.shared_expert", "shared_expert")):
        if module.startswith(prefix):
            return term
    return "dispatch"  # the MoE layer's own ops and its dispatcher's


def layer_census(
    layer: nn.Module, x0: torch.Tensor, rope, *, offloader=None
) -> Tuple[List[KeptStorage], torch.Tensor, torch.Tensor]:
    """Run ``layer(x, rope)`` on an input ``x`` made from ``x0`` inside the census and held by nothing but the
    layer (so that the layer's keeping it counts, and offloading it frees it), and return
    ``(kept, output, leaf)``: what the forward keeps for backward (``offloader``: the model's
    :class:`~folding.memory.offload.Offloader`, whose host copies are marked ``tier="host"``), the output, and
    the leaf ``x`` was computed from (its ``.grad`` is the input gradient after a backward)."""
    leaf = x0.clone().requires_grad_()
    pass_ = offloader.forward_pass() if offloader is not None else contextlib.nullcontext()
    with KeptCensus(layer) as census, pass_:
        y = layer(census.make(lambda: leaf * 1), rope)
    return census.kept(y, host=offloader.host_tensors() if offloader is not None else ()), y, leaf


def loss_census(model: nn.Module, tokens: int, *, seed: int = 5) -> int:
    """Bytes a whole model's forward with its loss keeps for backward (one sequence of ``tokens`` random ids
    and labels drawn from ``seed``; the model's parameters and its caller's ids excluded)."""
    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (1, tokens), generator=gen)
    labels = torch.randint(0, vocab, (1, tokens), generator=gen)
    with KeptCensus(model) as census:
        loss = model(ids, labels=labels).sum()
    return sum(k.nbytes for k in census.kept(loss))
