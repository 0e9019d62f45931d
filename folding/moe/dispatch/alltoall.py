"""The all-to-all token dispatcher: EP all-to-all plus ETP all-gather, the reverse on combine.

Dispatch, on every rank of the ETP×EP domain:

1. count rows per global expert; gather the counts over ETP then over EP (device collectives, on the
   metadata communicators ``ProcessGroups.etp_meta`` and ``ep_meta`` when given);
2. permute local tokens expert-major (``folding.moe.dispatch.permute.permute``), so the rows for each EP rank
   are contiguous;
3. read the gathered counts on the host (the single device-to-host sync per layer, deferred to
   here, just before the split sizes are needed; none with pad-to-capacity, where all splits are
   static; :func:`~folding.moe.dispatch.host_sync.read_counts`: the lane's deferred shared expert
   is issued first, and in an overlap pair the other lane runs while the counts travel) and send the
   rows over EP,
   then all-gather them over ETP (ETP ranks hold different tokens under folding, so they must see
   each other's);
4. sort the received chunks from rank-major to expert-major.

With ``per_expert_exchange``, without ETP (and with several local experts, dropless or dropping,
without ``megatron_stages``) steps 2-4 fold into the exchange: the tokens are permuted in (local
expert, destination rank) order and the EP all-to-all runs as one call per local expert index, each
receiving straight into its expert's block of the expert-major buffer, so no sort (and on combine no
unsort) copies the rows. The probabilities (one value per row) still travel as a single all-to-all,
reordered rank-major before it and sorted expert-major after it like the default's: small copies
that save ``L - 1`` calls each way.

Combine reverses it: unsort, reduce-scatter the ETP partial outputs, EP all-to-all back, and sum
each token's expert rows (unweighted; the experts applied the probabilities).

Shape suffixes (docs/shapes.md): ``T`` local tokens, ``H`` hidden, ``E`` experts, ``L`` local experts, ``N``
rows (permuted pairs), ``R`` ranks.

Usage::

    d = AllToAllDispatcher(num_experts=8, topk=2, ep_group=ps.groups.ep, etp_group=ps.groups.etp)
    tokens_NH, record, probs_N = d.dispatch(hidden_SBH, routing_map_TE, probs_TE)
    y_SBH = d.combine(experts(tokens_NH, record, probs_N), record)   # record: this call's state
"""

from __future__ import annotations

import torch

from ...overlap.exchange import COUNTS, Exchange
from ...parallel.collectives import all_gather_nograd, gather_counts_start
from . import host_sync
from .base import DispatchCall, DispatchRecord, TokenDispatcher
from .permute import (
    check_dropless,
    expert_order,
    inverse_order,
    padded_rows_per_expert,
    permute,
    plan_alltoall,
    sort_chunks_by_idxs,
    unpermute,
)
from .wire import (
    ExchangeSpec,
    combine_exchange,
    dispatch_exchange,
    etp_gather,
    etp_reduce_scatter,
    padded_chunks,
    payload_bytes_per_row,
    to_padded_blocks,
)


class AllToAllDispatcher(TokenDispatcher):
    """All-to-all dispatcher (see the module docstring); arguments as :class:`TokenDispatcher`, plus:

    Args:
        megatron_stages: where the ETP exchange runs. ``False`` (default): inside ``token_dispatch`` /
            ``token_combine``, next to the EP all-to-all, so a quantized dispatch wire crosses ETP still
            encoded. ``True``: Megatron-Core's split, the ETP all-gather in ``dispatch_postprocess``
            and the ETP reduce-scatter in ``combine_preprocess`` (``token_dispatch`` / ``token_combine``
            then hold only the EP all-to-all), for code that overlaps work with a given stage; it
            also turns ``per_expert_exchange`` off. The results are bitwise the same; only the stage
            that holds the ETP communication, and with a quantized wire the ETP bytes (decoded
            rows), differ.
        per_expert_exchange: without ETP (and with several local experts, not pad-to-capacity, not
            ``megatron_stages``), run the EP all-to-all as one call per local expert index, received
            expert-major: no sort or unsort copies the rows, for ``L`` calls instead of one (the
            probabilities still go as one call, with two small copies of one value per row). Off by
            default: on CPU with gloo it gains a little with large rows and loses much with small
            ones (measured in ``docs/dispatcher.md``), and on GPUs the sort is a cheap kernel while
            every extra all-to-all costs a launch and smaller messages (not measured: no GPU). It is
            meant for transports on which a copy of the rows costs more than a message.
    """

    def __init__(
        self,
        *,
        megatron_stages: bool = False,
        per_expert_exchange: bool = False,
        counts_group=None,
        etp_counts_group=None,
        **kwargs,
    ):
        """``counts_group``: the group the dropless token counts are all-gathered over, the EP ranks on a
        communicator of their own (``ProcessGroups.ep_meta``: on NCCL, counts on the EP communicator
        would complete only after the token all-to-alls issued before them there); ``None``: the EP
        group. ``etp_counts_group``: the same for the counts' gather over ETP (``ProcessGroups.etp_meta``,
        out of the way of the ETP payloads); ``None``: the ETP group. Other keywords:
        :class:`~folding.moe.dispatch.base.TokenDispatcher`'s."""
        super().__init__(**kwargs)
        self.counts_group = self.ep_group if counts_group is None else counts_group
        self.etp_counts_group = self.etp_group if etp_counts_group is None else etp_counts_group
        self.megatron_stages = bool(megatron_stages)
        self.per_expert_exchange = bool(per_expert_exchange)
        # per_expert_exchange, without ETP and with several local experts: the EP all-to-all runs as
        # one call per local expert index over rows permuted in (local expert, destination) order;
        # each call's received rows land in their expert's block, so the received rows need no
        # expert-major sort (nor the combine an unsort): two copies of the rows fewer each way, for
        # L calls instead of one. A token's expert outputs are then summed in (local expert, EP rank)
        # order instead of global expert order: the same bits for top-2, fp32 round-off beyond. Not
        # with megatron_stages, whose token_dispatch hands on rank-major rows as Megatron-Core's
        # does, nor with pad-to-capacity, where every token has a row at every expert (decided per
        # dispatch: the inference toggle may switch it).
        self._slice_ok = (
            self.per_expert_exchange
            and not self.megatron_stages
            and self.etp_size == 1
            and self.ep_size > 1
            and self.num_local_experts > 1
        )
        # the probabilities of sliced rows go as one all-to-all: their (local expert l, destination d)
        # chunks reordered (d, l), i.e. by the inverse of expert_order (host list, built once)
        self._probs_rank_major = expert_order(self.num_experts, self.num_local_experts).tolist()

    @property
    def counts_hand_over(self) -> bool:
        """True when the counts travel over EP (EP > 1, not pad-to-capacity): their read hands over."""
        return self.ep_size > 1 and not self.pad_to_capacity

    # ------------------------------------------------------------------------------- dispatch
    def _preprocess(self, hidden, routing_map, probs):
        """Validate, count, start the count gathers, permute locally: ``(rows_NH, probs_N, call)``."""
        H = self._validate(hidden, routing_map, probs)
        tokens_TH = hidden.reshape(-1, H)
        T = tokens_TH.shape[0]
        sliced = self._slice_ok and not self.pad_to_capacity
        record = DispatchRecord(
            hidden_shape=tuple(hidden.shape), hidden_size=H, dtype=hidden.dtype, num_tokens=T, sliced=sliced
        )
        call = DispatchCall(record=record)
        E = self.num_experts
        if sliced:  # rows grouped (local expert, destination): see _slice_ok
            cols = expert_order(E, self.ep_size, device=routing_map.device)
            routing_map = routing_map.index_select(1, cols)
            probs = None if probs is None else probs.index_select(1, cols)
        if self.pad_to_capacity:
            rows = padded_rows_per_expert(T, self.topk, E, self.capacity_factor)
            self._set_plan(call, [[[rows] * E for _ in range(self.etp_size)] for _ in range(self.ep_size)])
            out, probs_N, token_idx = permute(tokens_TH, routing_map, probs, rows_per_expert=rows)
            call.learn(token_idx=token_idx)
            return out, probs_N, call
        counts_E = routing_map.sum(0)
        if sliced:  # the counts travel in global expert order (the inverse of cols)
            counts_E = counts_E.index_select(0, expert_order(E, self.num_local_experts, device=counts_E.device))
        counts_ETP_E = all_gather_nograd(counts_E, self.etp_counts_group, stack=True)
        if self.ep_size > 1:  # [EP, ETP, E], left running while the tokens are permuted
            call.counts_dev, work = gather_counts_start(counts_ETP_E.unsqueeze(0), self.counts_group)
            # an overlap point: the other lane runs while the counts travel (read_counts runs the deferred
            # work first); an instrument's link model keeps its place in the counts group's order (NCCL's)
            call.counts_work = Exchange([work], what="ep counts", carries=COUNTS, group=self.counts_group)
        else:
            call.counts_dev = counts_ETP_E.unsqueeze(0)
        if self.dropless:
            num_out = T * self.topk  # static: the sync is deferred to the exchange
        else:
            self._read_counts(call)  # dropping: the row count is needed now
            num_out = call.record.plan.num_out_tokens
        out, probs_N, token_idx = permute(tokens_TH, routing_map, probs, num_out_tokens=num_out)
        call.learn(token_idx=token_idx)
        return out, probs_N, call

    def _read_counts(self, call: DispatchCall) -> None:
        # the shared expert first, then the gather's wait (under a link model, after everything issued
        # before it on its group: NCCL's order), then a pinned non-blocking copy and its event
        counts = host_sync.read_counts(call.counts_dev, work=call.counts_work, reason="alltoall splits")
        call.counts_work = None
        if self.dropless:
            check_dropless(counts, call.record.num_tokens, self.topk)
        self._set_plan(call, counts)

    def _set_plan(self, call: DispatchCall, counts) -> None:
        plan = plan_alltoall(
            counts,
            ep_size=self.ep_size,
            etp_size=self.etp_size,
            ep_rank=self.ep_rank,
            etp_rank=self.etp_rank,
            num_local_experts=self.num_local_experts,
        )
        call.learn(
            plan=plan,
            # chunk reordering by split/cat with the host sizes: no index tensor crosses to the device
            chunks_sorted=plan.sort_idxs == sorted(plan.sort_idxs),  # e.g. one local expert and ETP=1
            # the expert side holds its ETP-exchanged rows in padded blocks (uneven ETP sizes, ETP
            # exchanged in the exchange itself): the expert-major sort drops the padding and the
            # combine's unsort writes it, each in the copy it makes anyway
            etp_padded=not self.megatron_stages and len(set(plan.etp_sizes)) > 1,
        )

    def _spec(self, record: DispatchRecord, wire: str) -> ExchangeSpec:
        p = record.plan
        sliced = record.sliced
        return ExchangeSpec(
            ep_group=self.ep_group,
            etp_group=self.etp_group,
            ep_send=[send for send, _ in p.expert_slices] if sliced else p.input_splits,
            ep_recv=[recv for _, recv in p.expert_slices] if sliced else p.output_splits,
            probs_send=p.input_splits if sliced else None,
            probs_recv=p.output_splits if sliced else None,
            etp_sizes=[p.etp_sizes[self.etp_rank]] if self.megatron_stages else p.etp_sizes,
            wire=wire,
            grad_wire=self.grad_wire,
            hidden_size=record.hidden_size,
            dtype=record.dtype,
            etp_padded=record.etp_padded,
        )

    def _exchange(self, rows, probs, call):
        """EP all-to-all then ETP all-gather of rows and probabilities (the host sync happens here when
        dropless; the all-gather waits for the postprocess with ``megatron_stages``). Returns
        rank-major ``(rows, probs)``."""
        if call.record.plan is None:
            self._read_counts(call)
        record = call.record
        if record.sliced and probs is not None:
            # the rows go as one all-to-all per local expert; the probabilities as one, so reorder them
            # from (local expert l, destination d) to (d, l) chunks, rank-major like the default's
            sizes = [n for send, _ in record.plan.expert_slices for n in send]
            probs = sort_chunks_by_idxs(probs, sizes, self._probs_rank_major)
        return dispatch_exchange(rows, probs, self._spec(record, self.dispatch_wire))

    def _postprocess(self, rows, probs, call):
        """(ETP all-gather with ``megatron_stages``, then) sort rank-major chunks expert-major. Returns
        ``(tokens_NH, record, probs_N)``."""
        record = call.record
        p = record.plan
        if self.megatron_stages:
            rows, probs = etp_gather(rows, probs, self.etp_group, p.etp_sizes)
        sizes, order, padded = p.chunk_sizes, p.sort_idxs, record.etp_padded
        if padded:  # one copy both drops the ETP padding and sorts
            sizes, order = padded_chunks(sizes, order, p.etp_sizes)
        if padded or not (record.chunks_sorted or record.sliced):
            rows = sort_chunks_by_idxs(rows, sizes, order)
        if padded or not record.chunks_sorted:  # sliced: the probabilities came rank-major in one all-to-all
            probs = None if probs is None else sort_chunks_by_idxs(probs, sizes, order)
        call.learn(
            tokens_per_expert=self._device_tokens_per_expert(call, rows.device),
            tokens_per_expert_host=tuple(p.tokens_per_expert),
            stats=self._stats(record),
        )
        return rows, call.record, probs

    def _device_tokens_per_expert(self, call: DispatchCall, device) -> torch.Tensor:
        """Rows per local expert as a device tensor, from the gathered device counts (no host copy)."""
        L, lo = self.num_local_experts, self.local_expert_offset
        if call.counts_dev is None:  # pad-to-capacity: static
            return torch.full((L,), call.record.plan.tokens_per_expert[0], dtype=torch.long, device=device)
        return call.counts_dev[:, :, lo : lo + L].sum((0, 1)).to(torch.long)

    # -------------------------------------------------------------------------------- combine
    def _combine_pre(self, out, record: DispatchRecord):
        """Undo the expert-major sort (back to rank-major chunks, in padded ETP blocks when the ETP
        sizes differ); then, with ``megatron_stages``, the ETP reduce-scatter."""
        p = record.plan
        if record.etp_padded:  # the unsort also lays out the padded ETP blocks the combine reduces
            out = to_padded_blocks(out, p.chunk_sizes, p.sort_idxs, p.etp_sizes)
        elif not (record.chunks_sorted or record.sliced):
            out = sort_chunks_by_idxs(out, [p.chunk_sizes[i] for i in p.sort_idxs], inverse_order(p.sort_idxs))
        if self.megatron_stages:
            out = etp_reduce_scatter(out, self.etp_group, p.etp_sizes)
        return out

    def _combine_exchange(self, out, record: DispatchRecord):
        """ETP reduce-scatter of partial outputs (already done with ``megatron_stages``), then the
        reverse EP all-to-all."""
        return combine_exchange(out, self._spec(record, self.combine_wire))

    def _combine_post(self, out, record: DispatchRecord):
        """Sum each token's expert rows (unweighted) and restore the input shape."""
        y = unpermute(out, record.token_idx, num_tokens=record.num_tokens)
        return y.reshape(record.hidden_shape)

    # ---------------------------------------------------------------------------------- stats
    def _stats(self, record: DispatchRecord) -> dict:
        p, H, dt = record.plan, record.hidden_size, record.dtype
        remote_recv = sum(p.output_splits) - p.output_splits[self.ep_rank]
        disp = payload_bytes_per_row(self.dispatch_wire, H, dt)
        comb = payload_bytes_per_row(self.combine_wire, H, dt)
        elem = torch.empty((), dtype=dt).element_size()
        me = self.etp_rank
        return {
            "rows_sent": p.num_out_tokens,
            "remote_rows_sent": p.remote_rows,
            "remote_rows_received": remote_recv,
            # hidden payload (scales included, probabilities excluded) leaving this rank over EP
            "ep_dispatch_bytes": p.remote_rows * disp,
            "ep_combine_bytes": remote_recv * comb,
            # unquantized floor: one row per remote (token, expert) pair, each way
            "ep_floor_bytes": (p.remote_rows + remote_recv) * H * elem,
            # the encoded rows, or with megatron_stages the decoded ones, plus nothing for probabilities
            "etp_allgather_bytes": p.etp_sizes[me] * (H * elem if self.megatron_stages else disp) * (self.etp_size - 1),
            # the partial outputs of the other ETP ranks' rows (padded to the largest block when uneven)
            "etp_reduce_scatter_bytes": (
                (max(p.etp_sizes) * (self.etp_size - 1)) if record.etp_padded else (sum(p.etp_sizes) - p.etp_sizes[me])
            )
            * H
            * elem,
            "tokens_per_expert": list(p.tokens_per_expert),
        }
