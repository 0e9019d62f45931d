"""The recipe classes of the TransformerEngine stand-in (``tests/te_standin.py``), field for field TE's.

Each recipe has TE 2.20.2's dataclass fields in TE's order with TE's defaults (the conformance test
parses this file and compares it with ``tests/data/te_api_2.20.2.json``) and TE's class predicates
(``delayed()``, ``mxfp8()``, ...). The classes claim TE's module name, so a pickled payload names
them as TE's own payloads do.

Usage::

    from tests.te_standin_recipes import DelayedScaling
    DelayedScaling().amax_history_len   # 1024
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass
from typing import Callable, Literal, Optional, Union

RECIPE_MODULE = "transformer_engine.common.recipe"
"""TE's module of the recipes."""


class Format(enum.Enum):
    """FP8 formats (TE's ``Format``)."""

    E4M3 = "E4M3"
    E5M2 = "E5M2"
    HYBRID = "HYBRID"


@dataclass(frozen=True)
class MMParams:
    """GEMM settings (TE's ``MMParams``)."""

    use_split_accumulator: bool = True


class Recipe:
    """Base recipe with TE's class predicates."""

    @classmethod
    def delayed(cls):
        """Whether this is delayed scaling."""
        return issubclass(cls, DelayedScaling)

    @classmethod
    def mxfp8(cls):
        """Whether this is MXFP8."""
        return issubclass(cls, MXFP8BlockScaling)

    @classmethod
    def float8_current_scaling(cls):
        """Whether this is per-tensor current scaling."""
        return issubclass(cls, Float8CurrentScaling)

    @classmethod
    def float8_block_scaling(cls):
        """Whether this is FP8 block scaling."""
        return issubclass(cls, Float8BlockScaling)

    @classmethod
    def nvfp4(cls):
        """Never NVFP4 here (the engine uses no NVFP4 recipe)."""
        return False

    @classmethod
    def custom(cls):
        """Never a custom recipe here."""
        return False


@dataclass(repr=False)
class DelayedScaling(Recipe):
    """TE's ``DelayedScaling`` fields."""

    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: Union[Literal["max", "most_recent"], Callable] = "max"
    scaling_factor_compute_algo: Optional[Callable] = None
    reduce_amax: bool = True
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: Optional[str] = os.getenv("NVTE_BACKWARD_OVERRIDE", None)


@dataclass(repr=False)
class Float8CurrentScaling(Recipe):
    """TE's ``Float8CurrentScaling`` fields."""

    use_power_2_scales: bool = os.getenv("NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES", "0") == "1"
    fp8_format: Format = Format.HYBRID
    fp8_gemm_fprop: MMParams = MMParams(use_split_accumulator=False)
    fp8_gemm_dgrad: MMParams = MMParams(use_split_accumulator=True)
    fp8_gemm_wgrad: MMParams = MMParams(use_split_accumulator=True)
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: Optional[str] = os.getenv("NVTE_BACKWARD_OVERRIDE", None)


@dataclass(repr=False)
class Float8BlockScaling(Recipe):
    """TE's ``Float8BlockScaling`` fields."""

    use_f32_scales: bool = os.getenv("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", "0") == "1"
    fp8_format: Format = Format.E4M3
    x_block_scaling_dim: int = 1
    w_block_scaling_dim: int = 2
    grad_block_scaling_dim: int = 1
    fp8_gemm_fprop: MMParams = MMParams(use_split_accumulator=True)
    fp8_gemm_dgrad: MMParams = MMParams(use_split_accumulator=True)
    fp8_gemm_wgrad: MMParams = MMParams(use_split_accumulator=True)
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: Optional[str] = os.getenv("NVTE_BACKWARD_OVERRIDE", None)


@dataclass(repr=False)
class MXFP8BlockScaling(Recipe):
    """TE's ``MXFP8BlockScaling`` fields."""

    margin: int = 0
    fp8_format: Format = Format.E4M3
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: Optional[str] = os.getenv("NVTE_BACKWARD_OVERRIDE", None)
    enable_2d_quantization: bool = False


for _cls in (Format, MMParams, Recipe, DelayedScaling, Float8CurrentScaling, Float8BlockScaling, MXFP8BlockScaling):
    _cls.__module__ = RECIPE_MODULE  # pickled payloads name TE's module, as TE's do
