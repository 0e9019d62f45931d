"""Dropout whose masks do not depend on the layout: a counter-based hash of each element's coordinates.

Megatron-LM's placement and names (``model.hidden_dropout``, ``model.attention_dropout``):
``hidden_dropout`` zeroes elements of the embedding output, of the attention output projection and of
the MLP / MoE block output (before the residual add), ``attention_dropout`` elements of the attention
probabilities (after the softmax, before the values). Kept elements are scaled by ``1 / (1 - p)``.

A mask never draws from a random generator. Whether element ``e`` is kept is a pure function of

- the seed (``train.seed``), the layer number (global, not per pipeline stage) and the kind of
  dropout (:data:`KINDS`),
- the sequence's global sample index (``sample_index`` of the data sampler: step ``s`` consumes the
  samples ``[s·GBS, (s+1)·GBS)``, so it is the step and the sequence's place in the global batch),
- the token's position in its sequence (for the attention probabilities: the query's and the key's),
- the hidden column (for the attention probabilities: the head), always the global one, not a
  TP shard's local index,

hashed with SplitMix64 (:func:`mix`) on int64 tensors. TP, CP, PP, EP and DP shard the same
coordinates differently but every element keeps its coordinates, so every layout drops the same
elements as one rank; recompute and the overlap lanes run the same function again and get the same
mask. Nothing is drawn from ``torch``'s generators, whose state would depend on the order ranks and
lanes run. The hash costs about fifteen integer operations per element of the masked tensor.

Attention dropout needs the probabilities: fused attention kernels (SDPA's ``dropout_p``) draw their
own masks from the global generator, so with ``attention_dropout > 0`` the attention core runs as
explicit softmax and matrix products (:func:`folding.model.context_parallel.attention_core`), which
keeps ``[B, heads, S, S]`` probabilities per layer.

Usage::

    keys = DropoutKeys(hidden=0.1, attention=0.1, seed=7, sample_B=mb["sample_index"],
                       positions_S=shard_positions, query_positions_S=cp_positions)
    x_SBH = hidden_dropout(x_SBH, keys.at_layer(3), "mlp_out")
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

KINDS = {"embedding": 1, "attention_out": 2, "mlp_out": 3, "attention_probs": 4}
"""The dropouts of a layer, each hashed with its own constant."""

_MASK64 = (1 << 64) - 1
_GAMMA, _M1, _M2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def _signed(c: int) -> int:
    """The int64 with the bits of the unsigned 64-bit ``c``."""
    return c - (1 << 64) if c >= 1 << 63 else c


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's ``>>`` is arithmetic on signed integers)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def mix(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64 of int64 ``x`` (its bits read as unsigned; multiplication wraps modulo 2^64)."""
    z = x + _signed(_GAMMA)
    z = (z ^ _shr(z, 30)) * _signed(_M1)
    z = (z ^ _shr(z, 27)) * _signed(_M2)
    return z ^ _shr(z, 31)


def mix_int(x: int) -> int:
    """:func:`mix` of one Python integer (exact 64-bit arithmetic); returns the unsigned value."""
    z = (x + _GAMMA) & _MASK64
    z = ((z ^ (z >> 30)) * _M1) & _MASK64
    z = ((z ^ (z >> 27)) * _M2) & _MASK64
    return z ^ (z >> 31)


def keep_mask(h: torch.Tensor, p: float) -> torch.Tensor:
    """Bool mask, True where the element whose final hash is ``h`` is kept: the hash's top 53 bits as a
    uniform number in [0, 1), kept when at least ``p``."""
    return _shr(h, 11) >= int(round(p * (1 << 53)))


@dataclasses.dataclass(frozen=True)
class DropoutKeys:
    """One micro-batch's dropout: the rates and the coordinates of this rank's rows (module docstring).

    Built per micro-batch by :class:`~folding.model.transformer.MoETransformer` in training mode when a
    rate is above zero, and handed to its layers with their forward call."""

    hidden: float
    """``model.hidden_dropout``."""
    attention: float
    """``model.attention_dropout``."""
    seed: int
    """``train.seed``."""
    sample_B: torch.Tensor
    """Global sample index of each sequence of the micro-batch (int64 ``[B]``)."""
    positions_S: torch.Tensor
    """Sequence positions of this rank's hidden-state rows (int64 ``[S/(CP·TP)]``)."""
    query_positions_S: torch.Tensor
    """Sequence positions of this CP rank's attention queries (int64 ``[S/CP]``), keys in sequence order."""
    layer: int = 0
    """The layer the keys are bound to (:meth:`at_layer`)."""

    def at_layer(self, layer: int) -> "DropoutKeys":
        """These keys for layer ``layer`` (global layer number)."""
        return dataclasses.replace(self, layer=layer)

    def _base(self, kind: str) -> torch.Tensor:
        """Hash of (seed, layer, kind) then of each sequence's sample index: int64 ``[B]``."""
        h = mix_int(mix_int(mix_int(self.seed & _MASK64) ^ (self.layer & _MASK64)) ^ KINDS[kind])
        return mix(self.sample_B.to(torch.int64) ^ _signed(h))


def hidden_dropout(x_SBH: torch.Tensor, keys: Optional[DropoutKeys], kind: str) -> torch.Tensor:
    """``x_SBH`` (this rank's hidden rows ``[S/(CP·TP), B, H]``) with ``keys.hidden`` dropout of kind
    ``kind``; unchanged without keys or at rate 0."""
    if keys is None or not keys.hidden:
        return x_SBH
    dev = x_SBH.device
    h_B = keys._base(kind).to(dev)
    h_SB = mix(h_B[None, :] ^ keys.positions_S.to(dev)[:, None])
    h_SBH = mix(h_SB[:, :, None] ^ torch.arange(x_SBH.shape[-1], device=dev))
    return _apply(x_SBH, keep_mask(h_SBH, keys.hidden), keys.hidden)


def probs_dropout(probs_BASSk: torch.Tensor, keys: DropoutKeys, head_offset: int) -> torch.Tensor:
    """Attention probabilities ``[B, A, S, Sk]`` (this rank's heads and queries, every key) with
    ``keys.attention`` dropout; the heads are the global heads ``head_offset ..``, the queries at
    ``keys.query_positions_S`` and the keys at positions ``0 .. Sk-1``."""
    dev = probs_BASSk.device
    A, Sk = probs_BASSk.shape[1], probs_BASSk.shape[3]
    h_B = keys._base("attention_probs").to(dev)
    h_BA = mix(h_B[:, None] ^ torch.arange(head_offset, head_offset + A, device=dev))
    h_BAS = mix(h_BA[:, :, None] ^ keys.query_positions_S.to(dev))
    h_BASSk = mix(h_BAS[..., None] ^ torch.arange(Sk, device=dev))
    return _apply(probs_BASSk, keep_mask(h_BASSk, keys.attention), keys.attention)


def _apply(x: torch.Tensor, keep: torch.Tensor, p: float) -> torch.Tensor:
    """Dropped elements zeroed, kept ones scaled by ``1 / (1 - p)`` (autograd keeps only the bool mask)."""
    return x.masked_fill(~keep, 0.0) * (1.0 / (1.0 - p))
