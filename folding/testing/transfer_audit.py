"""Count the host↔device transfers a piece of code would make on a GPU, by running it on a CPU.

On a CPU every tensor lives in host memory, so transfers cannot be observed directly. The audit
models them from how tensors are born (a ``TorchFunctionMode`` sees every torch call):

- **host-born tensors**: a factory call (``arange``, ``zeros``, ``ones``, ``empty``, ``full``,
  ``rand*``, ``linspace``, ``eye``, ...) without a ``device=`` given as a ``torch.device`` (the
  string ``"cpu"`` counts as none) creates a tensor in host memory, as it would on a GPU machine.
  A tensor made from host data (``torch.tensor``, ``as_tensor``, ``asarray``, ``from_numpy``,
  ``new_tensor``) is host-born without ``device=``, and **with** one it is an H2D copy. ``*_like`` /
  ``new_*`` factories and every op whose tensor inputs are all host-born produce host-born results.
- **H2D**: each op that combines a host-born tensor with any other tensor counts one host→device
  copy per host-born input (on a GPU the op would raise or copy, and a blocking copy synchronizes
  the stream); so does ``.to(device)`` / ``.cuda()`` of a host-born tensor to a ``torch.device``.
- **D2H**: ``.item()``, ``.tolist()``, ``.cpu()``, ``.numpy()``, ``.to("cpu")`` and the implicit
  ``bool()``/``int()``/``float()`` of a tensor that is not host-born.

Tensors created before the audit starts (inputs, parameters) count as device tensors. Blind spots:
work inside C++ kernels and autograd's own C++ formulas is not seen (it never crosses by itself);
a ``device=`` given as a ``torch.device`` is trusted to be the computation's device; a factory
with ``device=x.device`` computed from a host-born ``x`` stays host-born only if ``x`` was.

Usage::

    with TransferAudit() as audit:
        loss = layer(x).sum(); loss.backward()
    assert audit.h2d == 0 and audit.d2h <= 1, audit.events
"""

from __future__ import annotations

import os
import traceback
from typing import List, Tuple

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

_FROM_DATA = {torch.tensor, torch.as_tensor, torch.asarray, torch.from_numpy, torch.Tensor.new_tensor}
_FACTORIES = {
    torch.arange,
    torch.zeros,
    torch.ones,
    torch.empty,
    torch.full,
    torch.rand,
    torch.randn,
    torch.randint,
    torch.randperm,
    torch.linspace,
    torch.logspace,
    torch.eye,
    torch.scalar_tensor,
    torch.empty_strided,
    torch.tril_indices,
    torch.triu_indices,
}
_LIKE = {
    torch.zeros_like,
    torch.ones_like,
    torch.empty_like,
    torch.full_like,
    torch.rand_like,
    torch.randn_like,
    torch.randint_like,
}
_NEW = {torch.Tensor.new_zeros, torch.Tensor.new_ones, torch.Tensor.new_empty, torch.Tensor.new_full}
_READS = {
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.cpu,
    torch.Tensor.numpy,
    torch.Tensor.__bool__,
    torch.Tensor.__int__,
    torch.Tensor.__float__,
    torch.Tensor.__index__,
}
_MOVES = {torch.Tensor.to, torch.Tensor.cuda}
_HERE = os.path.dirname(os.path.abspath(__file__))
_TORCH = os.path.dirname(os.path.abspath(torch.__file__))


def _where() -> str:
    """The innermost frame outside torch and this file, as ``file:line``."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        path = os.path.abspath(frame.filename)
        if not path.startswith(_TORCH) and not path.startswith(_HERE):
            return f"{os.path.basename(path)}:{frame.lineno}"
    return "?"


class TransferAudit(TorchFunctionMode):
    """A context manager counting modelled transfers (see the module docstring)."""

    def __init__(self):
        super().__init__()
        self._host = WeakIdKeyDictionary()
        self.d2h = 0
        self.h2d = 0
        self.events: List[Tuple[str, str, str]] = []

    def _is_host(self, t) -> bool:
        return isinstance(t, torch.Tensor) and t in self._host

    def _mark(self, out) -> None:
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._host[t] = True

    def _count(self, kind: str, name: str, n: int = 1) -> None:
        if kind == "D2H":
            self.d2h += n
        else:
            self.h2d += n
        self.events.append((kind, name, _where()))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if func in _READS:
            if not self._is_host(args[0]):
                self._count("D2H", name)
            return func(*args, **kwargs)
        if func in _MOVES:
            src = args[0]
            target = kwargs.get("device", args[1] if len(args) > 1 else None)
            out = func(*args, **kwargs)
            if isinstance(target, str) and target == "cpu":
                if not self._is_host(src):
                    self._count("D2H", name)
                self._mark(out)
            elif self._is_host(src):
                if func is torch.Tensor.cuda or isinstance(target, torch.device):
                    self._count("H2D", name)  # now on the device (on a CPU, possibly the same object)
                    self._host.pop(out, None)
                else:
                    self._mark(out)  # a dtype change stays on the host
            return out
        out = func(*args, **kwargs)
        if func in _FROM_DATA:  # host data: a copy to the device when one is named, else a host tensor
            if isinstance(kwargs.get("device"), torch.device):
                self._count("H2D", name)
            else:
                self._mark(out)
            return out
        if func in _FACTORIES:
            if not isinstance(kwargs.get("device"), torch.device):
                self._mark(out)
            return out
        if func in _LIKE or func in _NEW:
            if self._is_host(args[0]) and not isinstance(kwargs.get("device"), torch.device):
                self._mark(out)
            return out
        host = [t for t in tensors if self._is_host(t)]
        if host and len(host) < len(tensors):
            self._count("H2D", name, len({id(t) for t in host}))
        elif host:
            self._mark(out)
        return out
