"""Bytes per parameter element of the optimizer's state and gradients for the chosen dtypes.

The planning side of ``optim.exp_avg_dtype``, ``optim.exp_avg_sq_dtype``, ``optim.main_params_dtype``
and ``optim.main_grads_dtype`` (the optimizer's own storage is :mod:`folding.optim.precision`; the
two tables are checked against each other by the tests): fp32 4 bytes, bf16 2, fp8 1 plus one fp32
scale per 128 elements. The memory model, the planner's step time and the dry run read it.

Under ``optim.name=muon`` the hidden weight matrices keep one fp32 momentum (4 bytes, plus the master
copy of 16-bit parameters as AdamW) and the rest keeps AdamW's moments; :func:`muon_transient_bytes`
estimates the Newton–Schulz working set and :func:`muon_flops` its arithmetic.

Usage::

    prec = OptimizerPrecision(exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16")
    prec.state_bytes(param_bytes=2)      # 2 + 2 + 4 (fp32 master of bf16 parameters) = 8
    OptimizerPrecision.of(job.optim)     # from an OptimConfig (any object with the four fields)
"""

from __future__ import annotations

import dataclasses
import math

STATE_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp8": 1.0 + 4.0 / 128}
"""Bytes per element of each state dtype (fp8: the e4m3 code and its share of a per-128 fp32 scale)."""
FIELDS = ("exp_avg_dtype", "exp_avg_sq_dtype", "main_params_dtype", "main_grads_dtype")
"""The ``optim.*`` keys this record mirrors."""
NS_STACK_ELEMENTS = 1 << 25
"""The engine's largest Newton–Schulz stack in full-matrix elements (``folding.optim.muon``'s constant of
the same name, which this layer may not import; ``tests/unit/test_optim_muon.py`` keeps them equal)."""

MUON_MOMENTUM_BYTES = 4.0
"""Bytes per element of Muon's state: one fp32 momentum buffer."""


@dataclasses.dataclass(frozen=True)
class OptimizerPrecision:
    """Storage dtypes of AdamW's state and of the main gradients (``optim.*`` of the same names)."""

    exp_avg_dtype: str = "fp32"
    """First moment: fp32, bf16 or fp8."""
    exp_avg_sq_dtype: str = "fp32"
    """Second moment: fp32, bf16 or fp8."""
    main_params_dtype: str = "fp32"
    """Master weights of 16-bit parameters: fp32 (a copy) or bf16 (the parameter itself)."""
    main_grads_dtype: str = "fp32"
    """Main gradients: fp32 or bf16."""
    name: str = "adamw"
    """The optimizer (``optim.name``): ``adamw``, or ``muon`` (momentum only for the hidden matrices)."""

    def __post_init__(self):
        if self.name not in ("adamw", "muon"):
            raise ValueError(f"name={self.name!r} must be adamw or muon (optim.name)")
        for f in FIELDS:
            allowed = ("fp32", "bf16", "fp8") if f.startswith("exp_avg") else ("fp32", "bf16")
            if getattr(self, f) not in allowed:
                raise ValueError(f"{f}={getattr(self, f)!r} must be one of {', '.join(allowed)} (optim.{f})")

    @classmethod
    def of(cls, optim) -> "OptimizerPrecision":
        """The record of an ``OptimConfig`` (or any object with the four fields; missing ones are fp32)."""
        return cls(**{f: getattr(optim, f, "fp32") for f in FIELDS}, name=getattr(optim, "name", "adamw"))

    def master_bytes(self, param_bytes: float) -> float:
        """Bytes of a separate master copy per element: 4 for 16-bit parameters with fp32 master
        weights, 0 for fp32 parameters (their own master) or bf16 master weights (the parameter)."""
        return 4.0 if param_bytes != 4 and self.main_params_dtype == "fp32" else 0.0

    def state_bytes(self, param_bytes: float) -> float:
        """Optimizer-state bytes per parameter element: both moments plus any master copy."""
        return STATE_BYTES[self.exp_avg_dtype] + STATE_BYTES[self.exp_avg_sq_dtype] + self.master_bytes(param_bytes)

    def muon_state_bytes(self, param_bytes: float) -> float:
        """Optimizer-state bytes per element of a Muon matrix: the fp32 momentum plus any master copy."""
        return MUON_MOMENTUM_BYTES + self.master_bytes(param_bytes)

    def grad_bytes(self) -> int:
        """Bytes per element of the main gradients (and of their reduction on the wire)."""
        return 4 if self.main_grads_dtype == "fp32" else 2

    def update_traffic_bytes(self, param_bytes: float) -> float:
        """Memory traffic of one AdamW update per element: read and write both moments and the
        weights AdamW updates, read the gradient, write the parameter when it is a separate copy
        (fp32 everything with bf16 parameters: 2*(4+4+4) + 4 + 2 = 30 bytes)."""
        master = self.master_bytes(param_bytes)
        weights = master if master else param_bytes
        moments = STATE_BYTES[self.exp_avg_dtype] + STATE_BYTES[self.exp_avg_sq_dtype]
        return 2 * (moments + weights) + self.grad_bytes() + (param_bytes if master else 0.0)

    def describe(self) -> str:
        """``exp_avg fp32, exp_avg_sq fp32, main params fp32, main grads fp32``."""
        return ", ".join(f"{f.removesuffix('_dtype').replace('_', ' ')} {getattr(self, f)}" for f in FIELDS)


def _muon_stacks(cfg, layout, distributed: bool):
    """``(K, M, N)`` of one parameter's owned matrices on a rank (before chunking): routed experts'
    fc1 (gate and up of every local expert, split over EDP owners under ZeRO-1) and fc2, the shared
    expert's fc1 and a dense MLP projection. Attention projections are left out: smaller than these
    in the presets (DeepSeek-V3's largest, o_proj, is 7168x16384 against the dense MLP's 18432x7168)."""
    H, moe = cfg.hidden_size, cfg.moe
    owners = layout.edp if distributed else 1
    out = []
    if moe.num_experts and moe.ffn_hidden_size:
        local = moe.num_experts // layout.ep
        out += [
            (math.ceil(2 * local / owners), moe.ffn_hidden_size, H),
            (math.ceil(local / owners), H, moe.ffn_hidden_size),
        ]
    if moe.shared_expert_ffn_hidden_size:
        out.append((2, moe.shared_expert_ffn_hidden_size, H))
    if cfg.ffn_hidden_size:
        out.append((1, cfg.ffn_hidden_size, H))
    return out


def muon_transient_bytes(cfg, layout, *, distributed: bool, bucket_size: int = 40_000_000) -> int:
    """Peak short-lived bytes of one Muon step on a rank: the largest stack of full fp32 matrices
    (:func:`_muon_stacks`, cut to the engine's chunks of at most :data:`NS_STACK_ELEMENTS` elements,
    at least one matrix) held about four times at once (the gathered direction, the normalized
    iterate, the polynomial's product, the next iterate) plus three ``min(M, N)²`` Gram-sized
    matrices per stack member, and the bucket-sized fp32 update buffer."""
    stacks = [
        (min(k, max(1, NS_STACK_ELEMENTS // (m * n))), m, n) for k, m, n in _muon_stacks(cfg, layout, distributed)
    ]
    ns = max((4 * (4 * k * m * n + 3 * k * min(m, n) ** 2) for k, m, n in stacks), default=0)
    return int(ns + 4 * bucket_size)


def muon_flops(m: int, n: int, steps: int = 5) -> float:
    """Floating-point operations of ``steps`` quintic Newton–Schulz iterations on an ``[m, n]`` matrix
    (``s = min(m, n)``, ``l = max(m, n)``): per iteration the Gram ``2s²l``, its square ``2s³`` and the
    product with the iterate ``2s²l``."""
    s, l = min(m, n), max(m, n)
    return steps * (4.0 * s * s * l + 2.0 * s**3)
