"""How a layer is built and run, apart from what the model is: one frozen record, passed down whole.

:class:`~folding.model.config.ModelConfig` (and its ``moe`` record) says *what* the model is; a
:class:`LayerSettings` says how this run builds and runs its layers: where and in which dtype the
parameters are created, the seed of their initialization, the activation recompute mode, whether an
MoE layer hides its communication (``overlap_comm``, ``delay_wgrad``) and the expert backend that
runs. The model receives it once (:class:`~folding.model.transformer.MoETransformer`,
:func:`~folding.model.chunks.build_stage_chunks`) and hands it, unchanged, to every layer, MoE
block factory and MoE layer at construction; nothing sets these on a built layer.

The expert backend is decided once: the job boundary resolves ``moe.expert_backend`` for the
training device (:func:`folding.job.machine.check_experts_here`) and passes the name here; a model
built without one resolves it at its build (:meth:`LayerSettings.with_expert_backend`), and the
experts only receive the value.

Usage::

    settings = LayerSettings(init_seed=1, params_dtype=torch.bfloat16, recompute="moe", overlap_comm=True)
    layer = build_moe_layer(moe_cfg, hidden_size=1024, groups=ps.groups, settings=settings)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

from .config import MoEConfig
from .experts.select import BACKENDS, resolve_backend


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayerSettings:
    """The construction settings every layer of a model shares (see the module docstring)."""

    init_seed: Optional[int] = 0
    """Seed of the layout-independent initialization (``train.seed``); ``None`` leaves the values to the
    owner (a model draws every parameter from its name in the model, at once)."""
    params_dtype: torch.dtype = torch.float32
    """dtype of the parameters (``train.precision``; routers keep fp32)."""
    device: Any = None
    """Where parameters and buffers are created (``None``: CPU; ``meta``: nothing is allocated)."""
    recompute: str = "none"
    """What every transformer layer recomputes: a setting string of :mod:`folding.model.recompute` (a
    mode, or recompute modules joined by commas: ``train.recompute`` with ``train.recompute_modules``)."""
    offload_modules: str = ""
    """The offload modules of every transformer layer, joined by commas (``train.offload_modules``,
    :data:`folding.memory.offload.OFFLOAD_MODULES`): what they keep for backward waits in host memory."""
    overlap_comm: bool = False
    """An MoE layer computes its shared expert while its own dispatch is in flight
    (``parallel.overlap_moe_comm``; the numbers do not change, only the order of the work)."""
    delay_wgrad: bool = False
    """The experts, and the dense projections of every layer (attention, shared expert, dense MLP; not
    a compiled attention), compute their weight gradients behind the backward's next exchange
    (``parallel.delay_wgrad``, ``torch`` backend; bitwise the same gradients)."""
    compile_dense: bool = False
    """Every transformer layer runs its input norm and attention sublayer through ``torch.compile``
    (``train.compile``; :mod:`folding.model.compile` says what is compiled and why the MoE block is not)."""
    aux_loss_scale: float = 1.0
    """Gradient weight of every router loss per forward: the objective gains ``aux_loss_scale · loss``
    (training: 1 / (micro-batches per global batch · DP), each rank's per-micro-batch loss averaged)."""
    expert_backend: Optional[str] = None
    """The expert backend that runs (``te``, ``torch``, ``loop`` or ``emulated``): ``moe.expert_backend``
    resolved for the training device; ``None`` until the model build resolves it."""

    def __post_init__(self):
        if self.expert_backend is not None and self.expert_backend not in BACKENDS[1:]:
            raise ValueError(
                f"expert_backend={self.expert_backend!r}: give the backend that runs, one of {BACKENDS[1:]} "
                "(resolve moe.expert_backend=auto with folding.moe.experts.select.resolve_backend)"
            )
        if self.init_seed is not None and (isinstance(self.init_seed, bool) or not isinstance(self.init_seed, int)):
            raise ValueError(f"init_seed={self.init_seed!r} must be an int or None (train.seed)")

    def replace(self, **changes) -> "LayerSettings":
        """A copy with ``changes`` (the record is frozen)."""
        return dataclasses.replace(self, **changes)

    def with_expert_backend(self, moe: MoEConfig) -> "LayerSettings":
        """These settings with the expert backend decided: ``self`` when it is, else ``moe.expert_backend``
        resolved for :attr:`device` (``None`` and ``meta``: CPU; a model built on ``meta`` for another
        device is given the backend resolved for that device) and :attr:`params_dtype`
        (:func:`folding.moe.experts.select.resolve_backend`: ``auto`` picks, a named backend must run)."""
        if self.expert_backend is not None:
            return self
        device = torch.device(self.device or "cpu")
        device = torch.device("cpu") if device.type == "meta" else device
        return self.replace(
            expert_backend=resolve_backend(moe.expert_backend, moe.fp8_recipe, device, self.params_dtype)
        )
