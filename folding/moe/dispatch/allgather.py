"""The all-gather token dispatcher: every rank of ETP×EP sees every token, keeps its experts' columns.

Dispatch: all-gather tokens, probabilities and routing map over ETP, then over EP (the order does not
depend on how the layout enumerates the ETP×EP domain); keep the columns of the local experts and
permute the kept rows expert-major. Combine: sum each gathered token's expert rows, reduce-scatter
over EP then ETP (the sum also adds the ETP partial outputs). No uneven all-to-all is needed, which
suits small EP or large top-k; every rank receives all ``R·T`` tokens.

Dropless and dropping modes read the local experts' row counts once on the host (the layer's only
device-to-host sync, in ``dispatch_postprocess``); pad-to-capacity needs none. The wire is the
activation dtype (quantized wires are offered by the all-to-all dispatcher).

Shape suffixes (docs/shapes.md): ``T`` local tokens, ``Tg`` gathered tokens (``ETP·EP·T``), ``H``
hidden, ``E`` global experts, ``L`` local experts, ``N`` permuted rows.

Usage::

    d = AllGatherDispatcher(num_experts=8, topk=2, ep_group=ps.groups.ep, etp_group=ps.groups.etp)
    tokens_NH, record, probs_N = d.dispatch(hidden_SBH, routing_map_TE, probs_TE)
    out_SBH = d.combine(expert_out_NH, record)
"""

from __future__ import annotations

import torch

from folding.parallel.collectives import (
    all_gather_nograd,
    gather_from_sequence_region,
    reduce_scatter_to_sequence_region,
)

from . import host_sync
from .base import DispatchCall, DispatchRecord, TokenDispatcher
from .permute import padded_rows_per_expert, permute, unpermute


class AllGatherDispatcher(TokenDispatcher):
    """All-gather dispatcher (see the module docstring); arguments as :class:`TokenDispatcher`."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        for name in ("dispatch_wire", "combine_wire", "grad_wire"):
            if getattr(self, name) != "none":
                raise ValueError(
                    f"moe.{name}={getattr(self, name)!r}: the allgather dispatcher sends the "
                    f"activation dtype only; set moe.dispatcher=alltoall for a quantized wire"
                )

    def _preprocess(self, hidden, routing_map, probs):
        """Validate and flatten to ``[T, H]``: ``(tokens_TH, probs_TE, call)``."""
        H = self._validate(hidden, routing_map, probs)
        tokens_TH = hidden.reshape(-1, H)
        record = DispatchRecord(
            hidden_shape=tuple(hidden.shape), hidden_size=H, dtype=hidden.dtype, num_tokens=tokens_TH.shape[0]
        )
        return tokens_TH, probs, DispatchCall(record=record, routing_map_TE=routing_map)

    def _exchange(self, hidden, probs, call):
        """All-gather tokens and probabilities over ETP then EP (backward: reduce-scatter of the
        gradients); the routing map is gathered alongside without gradient. Returns ``(tokens_GH, probs_GE)``."""
        x, p = hidden, probs
        m = call.routing_map_TE.to(torch.uint8)
        for group in (self.etp_group, self.ep_group):
            x = gather_from_sequence_region(x, group, grad_reduce=True)
            p = gather_from_sequence_region(p, group, grad_reduce=True)
            m = all_gather_nograd(m, group)
        call.map_TgE = m.bool()
        return x, p

    def _postprocess(self, hidden, probs, call):
        """Keep the local experts' columns and permute expert-major (one host read of the counts, none
        with pad-to-capacity). Returns ``(tokens_NH, record, probs_N)``."""
        lo, hi = self.local_expert_offset, self.local_expert_offset + self.num_local_experts
        map_TgL, probs_TgL = call.map_TgE[:, lo:hi], probs[:, lo:hi]
        R, L, T = self.ep_size * self.etp_size, self.num_local_experts, call.record.num_tokens
        if self.pad_to_capacity:
            rows = padded_rows_per_expert(T, self.topk, self.num_experts, self.capacity_factor)
            out, p, token_idx = permute(hidden, map_TgL, probs_TgL, rows_per_expert=rows, num_chunks=R)
            host = [rows * R] * L
            tpe = torch.full((L,), rows * R, dtype=torch.long, device=hidden.device)
        else:
            tpe = map_TgL.sum(0)
            # one host read: the local experts' counts, and each source rank's routed pairs (dropless check)
            per_rank = call.map_TgE.view(R, -1).sum(1)
            counts = host_sync.to_host(torch.cat([tpe, per_rank.to(tpe.dtype)]), reason="allgather counts")
            host = counts[:L]
            want = T * self.topk
            short = [(r, n) for r, n in enumerate(counts[L:]) if n != want]
            if self.dropless and short:
                raise ValueError(
                    f"dropless dispatch expects exactly topk={self.topk} experts per token ({want} "
                    f"pairs per rank) but the routing map holds "
                    + ", ".join(f"{n} on rank {r} of the EPxETP domain" for r, n in short)
                    + "; set capacity_factor if the router drops tokens"
                )
            out, p, token_idx = permute(hidden, map_TgL, probs_TgL, num_out_tokens=sum(host))
        H, elem = hidden.shape[-1], hidden.element_size()
        call.learn(
            token_idx=token_idx,
            tokens_per_expert=tpe,
            tokens_per_expert_host=tuple(host),
            stats={"ep_dispatch_bytes": (R - 1) * T * H * elem, "ep_combine_bytes": (R - 1) * T * H * elem},
            num_gathered=hidden.shape[0],
        )
        return out, call.record, p

    def _combine_pre(self, out, record: DispatchRecord):
        """Sum each gathered token's expert rows (unweighted): ``[G, H]``."""
        return unpermute(out, record.token_idx, num_tokens=record.num_gathered)

    def _combine_exchange(self, out, record: DispatchRecord):
        """Reduce-scatter over EP then ETP (forward); all-gather of the gradient (backward)."""
        for group in (self.ep_group, self.etp_group):
            out = reduce_scatter_to_sequence_region(out, group)
        return out

    def _combine_post(self, out, record: DispatchRecord):
        """Restore the input shape."""
        return out.reshape(record.hidden_shape)
