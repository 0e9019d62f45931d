"""Which expert shapes an FP8 recipe's grouped GEMMs accept, checked when the job is configured.

Every expert GEMM operand is quantized along both of its dimensions at some point (forward: rows of
the input and of the weight along the contraction dimension; backward: the transposes). So each
dimension of ``fc1`` (``H`` and ``2·F/etp``) and ``fc2`` (``F/etp`` and ``H``) must be a multiple of the
recipe's block:

- ``mxfp8``: 32 (MXFP8 scales blocks of 32 along both dimensions; TransformerEngine's
  ``MXFP8Quantizer.is_quantizable`` and ``MXFP8_BLOCK_SCALING_SIZE``);
- the FP8 recipes ``delayed``, ``tensorwise``, ``blockwise``, ``rowwise``: 16 (FP8 GEMMs need the last
  dimension of each operand divisible by 16: TE's ``assert_dim_for_fp8_exec``, and
  ``torch._scaled_grouped_mm``'s 16-byte strides).

The token dimension is padded per expert at run time (``FP8_ROW_ALIGN`` in
:mod:`folding.moe.experts.te`), so it is not checked here. The ``emulated`` backend (the CPU oracle)
and ``loop`` take any shape and are not checked. A bad shape otherwise fails deep inside a kernel on
the cluster; :func:`check_fp8_shapes` says so when the job is validated, naming the keys and a fix.

Usage::

    check_fp8_shapes("mxfp8", hidden_size=4096, ffn_hidden_size=14336, etp=2)   # raises ValueError
"""

from __future__ import annotations

from typing import List, Optional

FP8_DIM_MULTIPLE = {"delayed": 16, "tensorwise": 16, "blockwise": 16, "rowwise": 16, "mxfp8": 32}
"""Multiple that every expert GEMM dimension (other than the padded token rows) needs, per recipe."""

CHECKED_BACKENDS = ("auto", "te", "torch")
"""``moe.expert_backend`` values whose kernels impose the multiples (``auto`` may resolve to ``te``)."""


def fp8_shape_problems(recipe: Optional[str], *, hidden_size: int, ffn_hidden_size: int, etp: int) -> List[str]:
    """The dimensions ``recipe`` cannot quantize, each as ``"<keys> = <value>"``; empty when all fit
    (or when ``recipe`` is None or unknown here)."""
    m = FP8_DIM_MULTIPLE.get(recipe)
    if m is None:
        return []
    fl = ffn_hidden_size // etp
    dims = [
        ("model.hidden_size", hidden_size),
        (f"moe.ffn_hidden_size/parallel.etp = {ffn_hidden_size}/{etp}", fl),
        (f"2*moe.ffn_hidden_size/parallel.etp = 2*{ffn_hidden_size}/{etp}", 2 * fl),
    ]
    return [f"{name} = {value}" if "/" in name else f"{name}={value}" for name, value in dims if value % m]


def check_fp8_shapes(
    recipe: Optional[str], *, hidden_size: int, ffn_hidden_size: int, etp: int, backend: str = "auto"
) -> None:
    """Raise ``ValueError`` naming ``model.hidden_size`` / ``moe.ffn_hidden_size`` / ``parallel.etp``
    and a fix when ``recipe``'s kernels (on ``backend``) cannot take these expert shapes."""
    if backend not in CHECKED_BACKENDS:
        return
    bad = fp8_shape_problems(recipe, hidden_size=hidden_size, ffn_hidden_size=ffn_hidden_size, etp=etp)
    if not bad:
        return
    m = FP8_DIM_MULTIPLE[recipe]
    good_etp = [
        d for d in range(1, ffn_hidden_size + 1) if ffn_hidden_size % d == 0 and (ffn_hidden_size // d) % m == 0
    ]
    fixes = []
    if hidden_size % m:
        fixes.append(f"model.hidden_size to a multiple of {m}")
    if (ffn_hidden_size // etp) % m:
        fixes.append(
            f"parallel.etp among {good_etp}" if good_etp else f"moe.ffn_hidden_size to a multiple of {m}*parallel.etp"
        )
    why = "MXFP8 scales blocks of 32 along both dimensions" if recipe == "mxfp8" else "FP8 GEMMs need 16-aligned sizes"
    raise ValueError(
        f"moe.fp8_recipe={recipe!r} needs every expert GEMM dimension divisible by {m} ({why}); "
        f"{'; '.join(bad)} {'is' if len(bad) == 1 else 'are'} not: set {' and '.join(fixes)}, "
        "or run moe.expert_backend=emulated (any shape)"
    )
