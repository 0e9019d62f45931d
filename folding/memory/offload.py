"""Fine-grained activation offloading: what named modules keep for backward waits in host memory.

``train.offload_modules`` names modules with Megatron-Core's names (``--offload-modules``):
``attn_norm``, ``qkv_linear``, ``core_attn``, ``attn_proj``, ``mlp_norm``, ``expert_fc1``, ``moe_act``
(:data:`OFFLOAD_MODULES`, where each region is). Each module's forward marks its region
(:func:`offload_region`); inside the forward of a transformer layer whose model offloads that module, the
tensors the region saves for backward go to host memory as the forward passes and come back one layer
ahead in backward:

- **Forward** (pack): on CUDA, a side stream waits for the compute stream, copies the tensor into a pinned
  host buffer (``non_blocking``) and records an event; the device tensor is handed to the side stream
  (``record_stream``), so the caching allocator reuses its memory only once the copy has finished, and
  the graph keeps the host copy instead. No host synchronization. On CPU the host tier is a separate
  storage (a copy), counted apart (:meth:`Offloader.host_tensors`).
- **Backward** (prefetch, unpack): when backward reaches a layer (the gradient of its output is computed),
  the previous layer's tensors are copied back on the side stream; a tensor's unpack makes the compute
  stream wait for its copy's event, so nothing is read before it arrives. A layer whose tensors were not
  prefetched (the first one backward reaches) copies them back at its first unpack.
- Parameters, tensor subclasses (TransformerEngine's quantized tensors, which own their storages) and tensors
  saved inside an activation checkpoint (which keeps only the region's inputs) stay where they are. What
  moves is storages: one saved twice in a layer (two views of one buffer, or by two regions) is copied once
  and comes back as one, its views rebuilt on it.

The values come back bit for bit, so offloading changes no number; only where bytes wait.

Usage::

    off = Offloader(frozenset({"expert_fc1"}))      # one per model chunk, built with the model
    with off.layer(out_holder):                     # a transformer layer's forward (see TransformerLayer)
        with offload_region("expert_fc1"):          # inside the experts' forward
            y = fc1(x)
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Callable, Dict, FrozenSet, Iterator, List, Optional

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from .offload_modules import OFFLOAD_MODULES

__all__ = ["OFFLOAD_MODULES", "Offloader", "offload_region"]


_state = threading.local()  # .group: the layer forward this thread runs; .previous: the layer before it


def offload_region(name: str):
    """Context manager marking the region of offload module ``name``: inside the forward of a layer whose
    model offloads ``name``, the tensors saved for backward in it are offloaded; elsewhere (another module,
    no autograd, inside an activation checkpoint, which keeps only its inputs) nothing happens."""
    group = getattr(_state, "group", None)
    if group is None or name not in group.offloader.modules or not torch.is_grad_enabled():
        return contextlib.nullcontext()
    if torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
        return contextlib.nullcontext()  # a checkpoint's (or another) saved-tensor hooks own these saves
    return torch.autograd.graph.saved_tensors_hooks(group.pack, group.unpack)


class _Handle:
    """One offloaded storage: its host copy (bytes), the event its copy-out recorded, the copy back and its
    event, and how many saves still have to unpack it (the device copy is dropped after the last)."""

    __slots__ = ("host", "out_event", "device", "in_event", "uses", "source", "version")

    def __init__(self, host, out_event, source: StorageWeakRef, version: int):
        self.host, self.out_event = host, out_event
        self.device = self.in_event = None
        self.uses = 0
        self.source, self.version = source, version
        """The device storage it copies (weakly: it is freed once offloaded) and its tensor's version then."""

    def copies(self, t: torch.Tensor) -> bool:
        """Whether this handle holds ``t``'s storage as it is now: the same storage, still alive (a freed
        storage's address is reused by the next allocation), not modified in place since."""
        return (
            not self.source.expired()
            and self.source.cdata == StorageWeakRef(t.untyped_storage()).cdata
            and (self.version == t._version)
        )


class _Saved:
    """One save of an offloaded storage: which storage, and the tensor's place in it."""

    __slots__ = ("handle", "dtype", "offset", "shape", "stride")

    def __init__(self, handle: _Handle, t: torch.Tensor):
        self.handle, self.dtype = handle, t.dtype
        self.offset, self.shape, self.stride = t.storage_offset(), tuple(t.shape), tuple(t.stride())


def _bytes_of(storage) -> torch.Tensor:
    """A ``uint8`` tensor over every byte of ``storage``."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class LayerGroup:
    """The tensors one layer's forward offloaded (one micro-batch), and their way back."""

    def __init__(self, offloader: "Offloader", previous: Optional["LayerGroup"]):
        self.offloader = offloader
        self.previous = previous
        self.handles: Dict[int, _Handle] = {}  # by the device storage's address (checked: _Handle.copies)

    def pack(self, t: torch.Tensor):
        """Saved-tensor pack hook: where to find ``t`` in a host copy of its storage, or ``t`` itself when it
        stays (a parameter, an empty tensor)."""
        off = self.offloader
        if type(t) is not torch.Tensor:  # a parameter, or a tensor subclass (TE's quantized tensors) that
            return t  # owns its storages: it stays
        s = t.untyped_storage()
        if not s.nbytes() or s.data_ptr() in off.param_storages:
            return t
        handle = self.handles.get(s.data_ptr())
        if handle is None or not handle.copies(t):
            handle = self.handles[s.data_ptr()] = off._copy_out(t)
        handle.uses += 1
        return _Saved(handle, t)

    def unpack(self, saved):
        """Saved-tensor unpack hook: the tensor back on its device (waiting for its copy on CUDA)."""
        if not isinstance(saved, _Saved):
            return saved
        handle = saved.handle
        if handle.device is None:
            self.offloader._copy_in(handle)
        storage = self.offloader._ready(handle)
        handle.uses -= 1
        if handle.uses <= 0:  # the last save read it: the device copy lives as long as autograd holds it
            handle.device = handle.in_event = None
        return torch.empty(0, dtype=saved.dtype, device=storage.device).set_(
            storage, saved.offset, saved.shape, saved.stride
        )

    def prefetch(self) -> None:
        """Start copying every handle of this group back (the side stream on CUDA)."""
        for handle in self.handles.values():
            if handle.device is None and handle.uses > 0:
                self.offloader._copy_in(handle)


class Offloader:
    """Offloads the saved tensors of ``modules`` (names of :data:`OFFLOAD_MODULES`) for the layers of one
    model chunk; ``params()`` gives the chunk's parameters (never offloaded)."""

    def __init__(self, modules: FrozenSet[str], params: Optional[Callable[[], Iterator[torch.Tensor]]] = None):
        bad = sorted(set(modules) - set(OFFLOAD_MODULES))
        if bad:
            raise ValueError(
                f"train.offload_modules: unknown module(s) {bad}; choose among {', '.join(OFFLOAD_MODULES)}"
            )
        self.modules = frozenset(modules)
        self._params = params
        self._param_storages: Optional[set] = None
        self._stream = None
        self._hosts: List[weakref.ref] = []

    @property
    def param_storages(self) -> set:
        """The data pointers of the parameters' storages (read once, at the first offload)."""
        if self._param_storages is None:
            self._param_storages = {p.untyped_storage().data_ptr() for p in (self._params() if self._params else ())}
        return self._param_storages

    @contextlib.contextmanager
    def forward_pass(self):
        """One forward of the chunk's layers for one micro-batch: each layer's group links to the one
        before it in this pass (the first has none)."""
        saved = getattr(_state, "previous", None)
        _state.previous = None
        try:
            yield
        finally:
            _state.previous = saved

    @contextlib.contextmanager
    def layer(self):
        """The forward of one transformer layer: its regions offload into a new group. Yields a function to
        call on the layer's output, which makes backward prefetch the previous layer's group when it reaches
        this layer (the gradient of its output is computed, before the layer's own backward runs)."""
        if not self.modules or not torch.is_grad_enabled():
            yield lambda out: out
            return
        group = LayerGroup(self, getattr(_state, "previous", None))
        saved, _state.group = getattr(_state, "group", None), group
        try:
            yield lambda out: self._hook(out, group)
        finally:
            _state.group = saved
            _state.previous = group

    @staticmethod
    def _hook(out: torch.Tensor, group: LayerGroup) -> torch.Tensor:
        previous, group.previous = group.previous, None  # the hook keeps the group below, not this one
        if previous is not None and out.requires_grad:

            def prefetch(grad):  # backward reached this layer: bring the one below back meanwhile
                previous.prefetch()
                return grad

            out.register_hook(prefetch)
        return out

    # ------------------------------------------------------------------------------- copies
    def _side(self):
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        return self._stream

    def _copy_out(self, t: torch.Tensor) -> _Handle:
        """A host copy of ``t``'s whole storage (as bytes), started now."""
        src = _bytes_of(t.untyped_storage())
        source, version = StorageWeakRef(t.untyped_storage()), t._version
        if t.device.type != "cuda":  # the host tier is a separate storage
            host = src.clone()
            self._hosts.append(weakref.ref(host))
            return _Handle(host, None, source, version)
        side, compute = self._side(), torch.cuda.current_stream(t.device)
        side.wait_stream(compute)
        host = torch.empty(src.shape, dtype=torch.uint8, pin_memory=True)
        with torch.cuda.stream(side):
            host.copy_(src, non_blocking=True)
            event = side.record_event()
        t.record_stream(side)  # its memory is reused only after the copy
        return _Handle(host, event, source, version)

    def _copy_in(self, handle: _Handle) -> None:
        """Start copying ``handle``'s storage back (a fresh device buffer)."""
        host = handle.host
        if handle.out_event is None:  # CPU: a fresh "device" copy
            handle.device = host.clone()
            return
        side = self._side()
        side.wait_event(handle.out_event)
        with torch.cuda.stream(side):
            handle.device = torch.empty(host.shape, dtype=torch.uint8, device=torch.cuda.current_device())
            handle.device.copy_(host, non_blocking=True)
            handle.in_event = side.record_event()

    def _ready(self, handle: _Handle):
        """The device storage of ``handle``, once the current stream has waited for its copy."""
        dev = handle.device
        if handle.in_event is not None:
            torch.cuda.current_stream().wait_event(handle.in_event)
            dev.record_stream(torch.cuda.current_stream())
        return dev.untyped_storage()

    def host_tensors(self) -> List[torch.Tensor]:
        """The host copies still alive (on CPU, the host tier that a memory census counts apart)."""
        alive = [r() for r in self._hosts]
        self._hosts = [r for r, t in zip(self._hosts, alive) if t is not None]
        return [t for t in alive if t is not None]
