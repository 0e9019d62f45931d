"""Delayed FP8 scaling, emulated: each operand is quantized with a scale derived from earlier amaxes.

This is how TransformerEngine's ``DelayedScaling`` recipe (defaults: amax history of 1024 steps,
``max`` over the history, margin 0) picks per-tensor scales: a tensor is cast with the scale
computed *before* it was seen, and only then is its amax appended to the history. The first use of
an operand has scale 1, and a tensor whose amax grew since the last step saturates at the format's
max. Holding one object per layer (never a global) keeps the histories of distinct layers apart.

Usage::

    state = DelayedScaling()
    x_hat = state.quant_dequant(x, key=("fc1", 0, "input"), fmt=torch.float8_e4m3fn)
"""

from __future__ import annotations

import torch

from folding.quant.formats import cast_to_fp8, dequantize, fp8_max


def cast_with_scale(x: torch.Tensor, scale: torch.Tensor, fmt: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, scale_inv)`` of ``x`` under the float32 per-tensor ``scale``: ``cast_to_fp8(x * scale)`` and
    ``1 / scale`` (the same ``x`` and ``scale`` give the same bits: a kept scale re-creates a use's codes)."""
    return cast_to_fp8(x.float() * scale, fmt), 1.0 / scale


class DelayedScaling:
    """Amax histories and current scales per operand key (see the module docstring).

    Histories and scales live on the operands' device as float32 tensors, as TE keeps them: using
    an operand reads nothing back to the host and copies nothing to the device."""

    def __init__(self, history_len: int = 1024, margin: int = 0):
        """``history_len``: steps of amax kept per operand; ``margin``: scale divided by 2^margin."""
        if history_len < 1:
            raise ValueError(f"history_len={history_len} must be >= 1")
        self.history_len = history_len
        self.margin = margin
        self._history: dict[tuple, torch.Tensor] = {}
        self._scale: dict[tuple, torch.Tensor] = {}

    def scale(self, key: tuple) -> float:
        """The scale the next use of operand ``key`` will get (1.0 before its first use); a host read,
        for inspection."""
        return float(self._scale[key]) if key in self._scale else 1.0

    def scale_of(self, key: tuple, device) -> torch.Tensor:
        """The float32 scale the next quantization of ``key`` uses (1 before its first use), on ``device``;
        no host read. Each use replaces it with a new tensor: one taken here stays that use's scale."""
        scale = self._scale.get(key)
        return torch.ones((), dtype=torch.float32, device=device) if scale is None else scale

    def quantize(self, x: torch.Tensor, key: tuple, fmt: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(codes, scale_inv)`` of ``x`` with the current scale of ``key`` (:func:`cast_with_scale`), then
        record its amax."""
        scale = self.scale_of(key, x.device)
        data, scale_inv = cast_with_scale(x, scale, fmt)
        if x.numel():
            amax = x.detach().abs().amax().float().reshape(1)
        else:
            amax = torch.zeros(1, dtype=torch.float32, device=x.device)
        old = self._history.get(key)
        hist = amax if old is None else torch.cat([old, amax])[-self.history_len :]
        self._history[key] = hist
        top = hist.max()
        # keep the last scale on 0 / Inf / NaN; float32 arithmetic, as on the GPU
        fresh = torch.full((), fp8_max(fmt), dtype=torch.float32, device=x.device) / top / 2.0**self.margin
        self._scale[key] = torch.where((top > 0) & top.isfinite(), fresh, scale)
        return data, scale_inv

    def quant_dequant(self, x: torch.Tensor, key: tuple, fmt: torch.dtype) -> torch.Tensor:
        """Quantize→dequantize ``x`` with the current scale of ``key``, then record its amax."""
        return dequantize(*self.quantize(x, key, fmt), x.dtype)
