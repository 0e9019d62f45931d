"""Pure token-movement functions: hand-worked cases (expected values explained) and round-trip properties."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from folding.moe.dispatch import host_sync
from folding.moe.dispatch.permute import (
    chunk_permutation,
    expert_order,
    inverse_order,
    padded_rows_per_expert,
    permute,
    plan_alltoall,
    sort_chunks_by_idxs,
    unpermute,
)
from folding.moe.routing.functions import expert_capacity


def _tokens(T, H=2):
    # token t's row is [10t, 10t+1]: a row's source token can be read off its values
    return torch.arange(T * H, dtype=torch.float32).view(T, H) * 5


def test_permute_expert_major_hand_worked():
    # 3 tokens, 3 experts, top-2:  t0 -> {e0, e2}, t1 -> {e1, e2}, t2 -> {e0, e1}
    rmap = torch.tensor([[1, 0, 1], [0, 1, 1], [1, 1, 0]], dtype=torch.bool)
    probs = torch.tensor([[0.6, 0, 0.4], [0, 0.7, 0.3], [0.2, 0.8, 0]])
    rows, p, idx = permute(_tokens(3), rmap, probs, num_out_tokens=6)
    # expert 0 gets t0, t2; expert 1 gets t1, t2; expert 2 gets t0, t1 (token order inside an expert)
    assert idx.tolist() == [0, 2, 1, 2, 0, 1]
    assert p.tolist() == pytest.approx([0.6, 0.2, 0.7, 0.8, 0.4, 0.3])
    assert torch.equal(rows, _tokens(3)[idx])


def test_permute_counts_through_host_sync_when_size_unknown():
    rmap = torch.tensor([[1, 0], [0, 0], [1, 1]], dtype=torch.bool)  # 3 kept pairs, token 1 fully dropped
    before = host_sync.count()
    rows, _, idx = permute(_tokens(3), rmap)
    assert host_sync.count() - before == 1
    assert idx.tolist() == [0, 2, 2]
    # with the size given, no host read
    before = host_sync.count()
    permute(_tokens(3), rmap, num_out_tokens=3)
    assert host_sync.count() == before


def test_unpermute_sums_rows_and_zero_fills_dropped_tokens():
    rows = torch.tensor([[1.0, 1.0], [2.0, 2.0], [4.0, 4.0]])
    idx = torch.tensor([0, 2, 2])
    out = unpermute(rows, idx, num_tokens=3)
    # token 0 <- row 0; token 1 <- nothing (dropped): zeros; token 2 <- rows 1 + 2
    assert out.tolist() == [[1, 1], [0, 0], [6, 6]]
    weighted = unpermute(rows, idx, num_tokens=3, probs_N=torch.tensor([0.5, 0.25, 0.5]))
    assert weighted.tolist() == [[0.5, 0.5], [0, 0], [2.5, 2.5]]


def test_pad_to_capacity_hand_worked():
    # 4 tokens, 2 experts; e0 routed from t1, t3; e1 routed from t2 only. 2 rows per expert:
    # e0 -> t1, t3 (its routed tokens); e1 -> t2 then the first unrouted token t0 as zero-prob filler.
    rmap = torch.tensor([[0, 0], [1, 0], [0, 1], [1, 0]], dtype=torch.bool)
    probs = torch.tensor([[0.9, 0.9], [0.5, 0], [0, 0.6], [0.7, 0]])  # t0's probs would be dropped values
    rows, p, idx = permute(_tokens(4), rmap, probs, rows_per_expert=2)
    assert idx.tolist() == [1, 3, 2, 0]
    assert p.tolist() == pytest.approx([0.5, 0.7, 0.6, 0.0])
    # two chunks of 2 tokens, 1 row per expert per chunk: e0 <- t1 (chunk 0), t3 (chunk 1);
    # e1 <- t0 filler (chunk 0, no routed token), t2 (chunk 1)
    _, p2, idx2 = permute(_tokens(4), rmap, probs, rows_per_expert=1, num_chunks=2)
    assert idx2.tolist() == [1, 3, 0, 2]
    assert p2.tolist() == pytest.approx([0.5, 0.7, 0.0, 0.6])


def test_capacity_formula():
    # ceil(T*k/E*cf): 10 tokens * 2 / 4 experts * 1.0 = 5; * 1.1 = 5.5 -> 6; capped at T when padding
    assert expert_capacity(10, topk=2, num_experts=4, capacity_factor=1.0) == 5
    assert expert_capacity(10, topk=2, num_experts=4, capacity_factor=1.1) == 6
    assert padded_rows_per_expert(10, 2, 4, 4.0) == 10  # capacity 20 > T: every token to every expert
    with pytest.raises(ValueError, match="capacity_factor"):
        expert_capacity(10, topk=2, num_experts=4, capacity_factor=0)


def test_sort_chunks_hand_worked():
    x = torch.arange(6).view(6, 1)
    # chunks [0], [1, 2], [3, 4, 5] reordered 2, 0, 1
    out = sort_chunks_by_idxs(x, [1, 2, 3], [2, 0, 1])
    assert out.view(-1).tolist() == [3, 4, 5, 0, 1, 2]
    perm = chunk_permutation([1, 2, 3], [2, 0, 1])
    assert perm == [3, 4, 5, 0, 1, 2]
    assert [perm[i] for i in inverse_order(perm)] == list(range(6))
    with pytest.raises(ValueError, match="split sizes"):
        sort_chunks_by_idxs(x, [1, 2], [0, 1])


def test_plan_alltoall_hand_worked():
    # EP=2, ETP=2, E=4 (L=2: EP rank 0 owns e0, e1; EP rank 1 owns e2, e3). counts[s][j][e]:
    counts = [
        [[1, 2, 3, 4], [5, 6, 7, 8]],  # ep 0: etp 0, etp 1
        [[9, 10, 11, 12], [13, 14, 15, 16]],
    ]  # ep 1: etp 0, etp 1
    plan = plan_alltoall(counts, ep_size=2, etp_size=2, ep_rank=1, etp_rank=0, num_local_experts=2)
    # this rank (ep 1, etp 0) holds counts [9, 10, 11, 12]: sends 9+10 to ep 0, 11+12 to itself
    assert plan.input_splits == [19, 23]
    # it receives, from each EP source with the same ETP index 0, that source's rows for e2, e3
    assert plan.output_splits == [3 + 4, 11 + 12]
    # ETP rank 0 holds 7 + 23 = 30 rows, ETP rank 1 (etp 1 of ep 0 and ep 1) 7+8 + 15+16 = 46
    assert plan.etp_sizes == [30, 46]
    # gathered layout [j][s][l]: (0,0,e2)=3 (0,0,e3)=4 (0,1,e2)=11 (0,1,e3)=12 (1,0,e2)=7 (1,0,e3)=8 ...
    assert plan.chunk_sizes == [3, 4, 11, 12, 7, 8, 15, 16]
    # expert-major: e2 from (j0,s0),(j0,s1),(j1,s0),(j1,s1) = chunks 0, 2, 4, 6, then e3 = 1, 3, 5, 7
    assert plan.sort_idxs == [0, 2, 4, 6, 1, 3, 5, 7]
    assert plan.sorted_chunk_sizes == [3, 11, 7, 15, 4, 12, 8, 16]
    assert plan.tokens_per_expert == [3 + 11 + 7 + 15, 4 + 12 + 8 + 16]
    assert plan.num_out_tokens == 42 and plan.remote_rows == 19


@settings(max_examples=40, deadline=None)
@given(
    T=st.integers(1, 12), E=st.integers(1, 6), H=st.integers(1, 4), seed=st.integers(0, 10_000), drop=st.floats(0, 1)
)
def test_permute_unpermute_round_trip(T, E, H, seed, drop):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g, dtype=torch.float64)
    rmap = torch.rand(T, E, generator=g) < 0.5
    rmap &= torch.rand(T, E, generator=g) >= drop
    n = int(rmap.sum())
    rows, _, idx = permute(x, rmap, num_out_tokens=n)
    # every kept pair appears once; summing rows back gives x times the token's number of kept experts
    assert rows.shape == (n, H)
    back = unpermute(rows, idx, num_tokens=T)
    torch.testing.assert_close(back, x * rmap.sum(1, keepdim=True).to(x.dtype))
    # probabilities travel with their rows: a weighted unpermute equals the dense weighted sum
    probs = torch.rand(T, E, generator=g, dtype=torch.float64) * rmap
    rows, p, idx = permute(x, rmap, probs, num_out_tokens=n)
    torch.testing.assert_close(unpermute(rows, idx, num_tokens=T, probs_N=p), x * probs.sum(1, keepdim=True))


@settings(max_examples=30, deadline=None)
@given(sizes=st.lists(st.integers(0, 4), min_size=1, max_size=6), seed=st.integers(0, 1000))
def test_sort_chunks_inverse(sizes, seed):
    order = torch.randperm(len(sizes), generator=torch.Generator().manual_seed(seed)).tolist()
    x = torch.randn(sum(sizes), 3)
    perm = chunk_permutation(sizes, order)
    torch.testing.assert_close(sort_chunks_by_idxs(x, sizes, order), x[perm])
    torch.testing.assert_close(x[perm][inverse_order(perm)], x)


def test_expert_slices_deliver_expert_major_rows():
    """EP2, L=2, no ETP. Rank s sends counts[s][0][e] rows to global expert e. Permuted in expert_order
    (0, 2, 1, 3), rank 0's rows form two slices: local expert 0 of ranks 0 and 1 (1 + 3 rows), then
    local expert 1 of ranks 0 and 1 (2 + 4 rows). Rank 0 receives for its expert 0 one row from itself
    and five from rank 1, then for expert 1 two and six: its tokens_per_expert, in that order."""
    counts = [[[1, 2, 3, 4]], [[5, 6, 7, 8]]]
    assert expert_order(4, 2).tolist() == [0, 2, 1, 3]
    assert expert_order(6, 3).tolist() == [0, 2, 4, 1, 3, 5]
    # the inverse permutation: local-expert-major back to global expert order
    assert expert_order(6, 2).tolist() == inverse_order(expert_order(6, 3).tolist()) == [0, 3, 1, 4, 2, 5]
    plan = plan_alltoall(counts, ep_size=2, etp_size=1, ep_rank=0, etp_rank=0, num_local_experts=2)
    assert plan.expert_slices == [([1, 3], [1, 5]), ([2, 4], [2, 6])]
    assert [sum(recv) for _, recv in plan.expert_slices] == plan.tokens_per_expert == [6, 8]
    assert sum(sum(send) for send, _ in plan.expert_slices) == plan.num_out_tokens == 10
    other = plan_alltoall(counts, ep_size=2, etp_size=1, ep_rank=1, etp_rank=0, num_local_experts=2)
    assert other.expert_slices == [([5, 7], [3, 7]), ([6, 8], [4, 8])]
    # with ETP the slices are not used (the ETP all-gather needs rank-major rows)
    etp = plan_alltoall([[[1, 2], [3, 4]]], ep_size=1, etp_size=2, ep_rank=0, etp_rank=0, num_local_experts=2)
    assert etp.expert_slices == []
