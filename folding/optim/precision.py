"""Optimizer state in fp32, bf16 or fp8: storage, rounding, and bytes per element.

The precision-aware AdamW (``optim.exp_avg_dtype``, ``optim.exp_avg_sq_dtype``,
``optim.main_params_dtype``, ``optim.main_grads_dtype``) keeps each flat state shard of a bucket in
a :class:`StateShard`, which hides the storage format behind ``read()`` (fp32 values) and
``write(x)`` (round and store):

- ``fp32``: a plain fp32 tensor; ``read`` returns it (no copy), so the fused kernel updates it in place;
- ``bf16``: a bf16 tensor; ``write`` rounds to nearest even, or stochastically with ``stochastic=True``
  (:func:`round_bf16_stochastic`: unbiased, ``E[round(x)] = x``);
- ``fp8``: ``float8_e4m3fn`` codes with one fp32 scale per block of :data:`FP8_BLOCK` consecutive
  elements of the shard (``scale = amax/448``, round to nearest). With ``sqrt_domain=True`` (the
  second moment) the shard stores ``sqrt(v)``: AdamW only ever uses ``sqrt(v)``, the square root
  halves the exponent range v spans (so the 2^17.8 range e4m3 covers in a block is 2^35.6 of v), and
  the relative rounding of the denominator is e4m3's own (<= 2^-4) instead of the square root of a
  coarser format's.

Future optimizers (momentum-only ones included) store their buffers through the same class.

Usage::

    m = StateShard(n, "bf16", device)
    x = m.read()                 # fp32 values
    m.write(x * 0.9)             # rounded to the storage dtype
    StateShard.bytes_per_element("fp8")   # 1 + 4/128
"""

from __future__ import annotations

from typing import Optional

import torch

from ..quant import dequantize

STATE_DTYPES = ("fp32", "bf16", "fp8")
"""Names accepted by ``optim.exp_avg_dtype`` and ``optim.exp_avg_sq_dtype``."""
MASTER_DTYPES = ("fp32", "bf16")
"""Names accepted by ``optim.main_params_dtype`` and ``optim.main_grads_dtype``."""
FP8_BLOCK = 128
"""Elements per fp8 scale block (consecutive elements of a bucket's shard)."""
FP8_MAX = 448.0
"""Largest finite ``float8_e4m3fn`` value."""
TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
"""Torch dtype of the fp32 and bf16 storage names."""


def round_bf16_stochastic(x: torch.Tensor, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Round fp32 ``x`` to bf16 stochastically: up with probability equal to the distance to the
    lower bf16 neighbour over the gap between neighbours, so ``E[result] = x`` exactly.

    Adds 16 uniform random bits to the low half of the fp32 pattern and truncates (sign-magnitude:
    works for either sign). NaN and Inf are kept."""
    x = x.float().contiguous()
    bits = x.view(torch.int32)
    noise = torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, device=x.device, generator=generator)
    out = ((bits + noise) & -65536).view(torch.float32)
    out = torch.where(torch.isfinite(x), out, x)
    return out.to(torch.bfloat16)  # exact: the low 16 bits are zero


class StateShard:
    """One flat optimizer-state tensor of ``n`` elements stored as ``fp32``, ``bf16`` or ``fp8``."""

    def __init__(
        self,
        n: int,
        dtype: str,
        device,
        *,
        sqrt_domain: bool = False,
        stochastic: bool = False,
        storage: Optional[torch.Tensor] = None,
    ):
        """``dtype``: a name of :data:`STATE_DTYPES`; ``sqrt_domain``: fp8 stores ``sqrt`` of the
        (non-negative) values; ``stochastic``: bf16 writes round stochastically; ``storage``: use this
        existing tensor of the storage dtype (e.g. the parameter's own storage) instead of zeros."""
        if dtype not in STATE_DTYPES:
            raise ValueError(f"state dtype {dtype!r} must be one of {', '.join(STATE_DTYPES)}")
        self.n, self.dtype, self.sqrt_domain, self.stochastic = n, dtype, sqrt_domain, stochastic
        self.scale: Optional[torch.Tensor] = None
        if dtype == "fp8":
            nb = -(-n // FP8_BLOCK)
            self.data = torch.zeros(nb * FP8_BLOCK, dtype=torch.float8_e4m3fn, device=device)
            self.scale = torch.ones(nb, dtype=torch.float32, device=device)
        elif storage is not None:
            if storage.dtype != TORCH_DTYPES[dtype] or storage.numel() != n:
                raise ValueError(f"storage of {storage.numel()} {storage.dtype} does not hold {n} {dtype}")
            self.data = storage
        else:
            self.data = torch.zeros(n, dtype=TORCH_DTYPES[dtype], device=device)

    @staticmethod
    def bytes_per_element(dtype: str) -> float:
        """Bytes one element costs in ``dtype`` (fp8: the code plus its share of the block scale)."""
        return {"fp32": 4.0, "bf16": 2.0, "fp8": 1.0 + 4.0 / FP8_BLOCK}[dtype]

    def nbytes(self) -> int:
        """Bytes held (codes plus scales)."""
        out = self.data.numel() * self.data.element_size()
        return out + (self.scale.numel() * 4 if self.scale is not None else 0)

    def read(self) -> torch.Tensor:
        """The values in fp32 (for ``fp32`` storage the tensor itself, so writes to it are in place)."""
        if self.dtype == "fp32":
            return self.data
        if self.dtype == "bf16":
            return self.data.float()
        x = dequantize(self.data, self.scale, block=(1, FP8_BLOCK))[: self.n]
        return x.square() if self.sqrt_domain else x

    def write(self, x: torch.Tensor, generator: Optional[torch.Generator] = None) -> None:
        """Store fp32 values ``x`` (``n`` elements) rounded to the storage dtype."""
        if self.dtype == "fp32":
            if x.data_ptr() != self.data.data_ptr():
                self.data.copy_(x)
        elif self.dtype == "bf16":
            self.data.copy_(round_bf16_stochastic(x, generator) if self.stochastic else x)
        else:
            y = x.clamp_min(0).sqrt() if self.sqrt_domain else x
            pad = self.data.numel() - self.n
            blocks = torch.nn.functional.pad(y, (0, pad)).view(-1, FP8_BLOCK)
            amax = blocks.abs().amax(dim=1)
            scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
            self.scale.copy_(scale)
            self.data.copy_((blocks / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).view(-1).to(torch.float8_e4m3fn))

    def saved(self) -> torch.Tensor:
        """The values as a checkpoint stores them: fp32 and bf16 in their own dtype (a copy), fp8
        dequantized to fp32 (exact: code times scale; fp8 blocks follow the bucket layout, so the
        codes themselves do not reshard)."""
        return self.data.clone() if self.dtype != "fp8" else self.read().clone()

    def saved_dtype(self) -> torch.dtype:
        """The torch dtype of :meth:`saved`."""
        return self.data.dtype if self.dtype != "fp8" else torch.float32
