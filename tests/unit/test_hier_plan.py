"""The hierarchical dispatcher's pure planning: de-duplicated counts, rows and both stages' splits,
on small hand-worked cases (expected values explained in the comments), and the node split of the
EP groups (:func:`folding.parallel.rank_math.node_split_groups`)."""

import pytest
import torch

from folding.moe.dispatch.hier_plan import dedup_counts, dedup_rows, plan_hierarchical
from folding.parallel import ParallelLayout
from folding.parallel.rank_math import LayoutError, node_split_groups


def _map(T, E, pairs):
    m = torch.zeros(T, E, dtype=torch.bool)
    for t, e in pairs:
        m[t, e] = True
    return m


def test_dedup_counts_counts_a_token_once_per_rank_and_node():
    # EP4 as 2 nodes of 2 ranks, L = 2: rank d owns experts 2d, 2d+1; node n owns ranks 2n, 2n+1.
    # token 0 -> experts 0, 1 (rank 0 twice), token 1 -> 1, 6 (ranks 0 and 3), token 2 -> 4, 7 (ranks 2, 3)
    m = _map(3, 8, [(0, 0), (0, 1), (1, 1), (1, 6), (2, 4), (2, 7)])
    c = dedup_counts(m, num_nodes=2, ranks_per_node=2).tolist()
    per_expert, per_rank, per_node = c[:8], c[8:12], c[12:]
    assert per_expert == [1, 2, 0, 0, 1, 0, 1, 1]
    assert per_rank == [2, 0, 1, 2]  # token 0 counted once on rank 0
    assert per_node == [2, 2]  # node 0: tokens 0, 1; node 1: tokens 1, 2 (token 2 once, not twice)
    # de-duplication: 6 (token, expert) pairs, 5 (token, rank) rows, 4 (token, node) rows
    assert (sum(per_expert), sum(per_rank), sum(per_node)) == (6, 5, 4)


def test_dedup_rows_group_major_in_token_order():
    # 3 tokens, 2 groups of 2 columns; any-per-group = [[1, 1], [0, 1], [1, 0]]
    m = _map(3, 4, [(0, 1), (0, 2), (1, 3), (2, 0), (2, 1)]).view(3, 2, 2)
    tok, grp = dedup_rows(m, 4)
    assert tok.tolist() == [0, 2, 0, 1]  # group 0: tokens 0, 2; group 1: tokens 0, 1
    assert grp.tolist() == [0, 0, 1, 1]


def _counts(vectors):
    """counts[s][j] from per-rank maps (one ETP rank)."""
    return [[dedup_counts(m, num_nodes=2, ranks_per_node=2).tolist()] for m in vectors]


def test_plan_two_nodes_of_two():
    # EP4 = 2 nodes x 2 ranks, L = 2, 2 tokens per rank. EP index d = 2n + i.
    maps = [
        _map(2, 8, [(0, 0), (0, 5), (1, 6), (1, 7)]),  # rank 0: t0 -> ranks 0, 2; t1 -> rank 3 (twice)
        _map(2, 8, [(0, 2), (0, 3), (1, 4), (1, 2)]),  # rank 1: t0 -> rank 1 (twice); t1 -> ranks 2, 1
        _map(2, 8, [(0, 0), (0, 2), (1, 5), (1, 7)]),  # rank 2: t0 -> ranks 0, 1; t1 -> ranks 2, 3
        _map(2, 8, [(0, 1), (0, 6), (1, 3), (1, 4)]),  # rank 3: t0 -> ranks 0, 3; t1 -> ranks 1, 2
    ]
    counts = _counts(maps)
    kw = dict(num_nodes=2, ranks_per_node=2, etp_size=1, etp_rank=0, num_local_experts=2)
    p = plan_hierarchical(counts, ep_rank=0, **kw)  # node 0, position 0; its rail peer is rank 2
    # stage A sends (distinct nodes per token): rank 0: t0 -> nodes 0, 1; t1 -> node 1 => [1, 2]
    assert p.rail_send == [1, 2] and p.own_node == 0 and p.remote_rail_rows == 2
    # stage A receives node-0 rows from rank 0 (its own: 1) and rank 2 (t0 -> node 0: 1)
    assert p.rail_recv == [1, 1]
    # stage B: forwarder 0 holds rows of ranks 0 and 2 for node 0; rank 0's t0 needs rank 0,
    # rank 2's t0 needs ranks 0 and 1 => sends [2, 1] to ranks (0, 0) and (0, 1)
    assert p.node_send == [2, 1]
    # stage B receives for rank 0 from forwarder 0 (sources 0 and 2: 1 + 1) and forwarder 1 (sources 1
    # and 3: rank 1 has none for rank 0, rank 3's t0 does: 1)
    assert p.node_recv == [2, 1] and p.etp_sizes == [3]
    # experts 0, 1: expert 0 from ranks 0 and 2, expert 1 from rank 3
    assert p.tokens_per_expert == [2, 1]
    p3 = plan_hierarchical(counts, ep_rank=3, **kw)  # node 1, position 1; rail peer rank 1
    assert p3.rail_send == [2, 2]  # rank 3: t0 -> ranks 0, 3 (nodes 0, 1); t1 -> ranks 1, 2 (nodes 0, 1)
    assert p3.rail_recv == [1, 2]  # from rank 1 (t1 -> node 1) and itself
    # forwarder 3 holds node-1 rows of rank 1 (t1: ranks 2) and rank 3 (t0: rank 3; t1: rank 2)
    assert p3.node_send == [2, 1]
    assert sum(p3.node_recv) == p3.etp_sizes[0] == 3  # rank 3: rank 0 t1, rank 2 t1, rank 3 t0


def test_plan_etp_sizes_sum_over_etp_ranks():
    # EP2 = 2 nodes of 1 rank, ETP2, L = 1: counts[s][j] for the two ETP ranks of each EP rank
    m0 = [_map(1, 2, [(0, 0), (0, 1)]), _map(1, 2, [(0, 1)])]
    m1 = [_map(1, 2, [(0, 0)]), _map(1, 2, [(0, 0), (0, 1)])]
    counts = [[dedup_counts(m, num_nodes=2, ranks_per_node=1).tolist() for m in ms] for ms in (m0, m1)]
    p = plan_hierarchical(counts, num_nodes=2, ranks_per_node=1, etp_size=2, ep_rank=1, etp_rank=0, num_local_experts=1)
    # rows at EP rank 1 from ETP rank 0: EP0/ETP0's token; ETP rank 1: EP0/ETP1's and EP1/ETP1's
    assert p.etp_sizes == [1, 2] and p.tokens_per_expert == [3]
    # rail: EP1/ETP0's token goes to node 0 only; it receives EP0/ETP0's token (nodes 0 and 1)
    assert p.rail_send == [1, 0] and p.rail_recv == [1, 0]
    # one rank per node: the node stage passes the one received row to this rank itself
    assert p.node_send == [1] and p.node_recv == [1]


def test_plan_rejects_malformed_counts():
    with pytest.raises(ValueError, match="EP=4"):
        plan_hierarchical(
            [[[0] * 14]], num_nodes=2, ranks_per_node=2, etp_size=1, ep_rank=0, etp_rank=0, num_local_experts=2
        )


def test_node_split_groups_worked_example():
    node, rail = node_split_groups([[0, 2, 4, 6], [1, 3, 5, 7]], 4)
    assert node == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert rail == [[0, 4], [2, 6], [1, 5], [3, 7]]
    g = ParallelLayout(world_size=8, tp=2, ep=8, etp=1, nvlink_domain=4).groups()["expert"]
    assert g["ep-node"] == [[0, 1, 2, 3], [4, 5, 6, 7]] and g["ep-rail"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # no nvlink_domain: one node
    g = ParallelLayout(world_size=8, ep=8).groups()["expert"]
    assert g["ep-node"] == [list(range(8))] and g["ep-rail"] == [[r] for r in range(8)]


def test_node_split_refuses_uneven_nodes():
    # EP4 over ranks 0..3 with 3 ranks per node: 3 on node 0, 1 on node 1
    with pytest.raises(LayoutError, match="parallel.nvlink_domain=3"):
        node_split_groups([[0, 1, 2, 3]], 3)
    with pytest.raises(LayoutError, match="parallel.nvlink_domain=3 does not divide"):
        ParallelLayout(world_size=8, ep=8, nvlink_domain=3)
    with pytest.raises(LayoutError, match="nvlink_domain"):
        ParallelLayout(world_size=8, ep=8, nvlink_domain=0)


def _job(dispatcher, **par):
    from folding.job.config import JobConfig, ParallelConfig, TrainConfig
    from folding.model.presets import get_preset

    model = get_preset("mixtral_tiny", hidden_size=32, moe={"ffn_hidden_size": 16, "dispatcher": dispatcher})
    return JobConfig(
        model=model,
        parallel=ParallelConfig(**par),
        train=TrainConfig(steps=2, global_batch_size=8, micro_batch_size=1, seq_length=16),
    )


def test_nvlink_domain_default_and_refusals(monkeypatch):
    from folding.job.config import ConfigError
    from folding.job.validate import validate_job

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert validate_job(_job("hierarchical", ep=8), world_size=8).nvlink_domain == 8  # the world: one node
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # torchrun's ranks per node
    lay = validate_job(_job("hierarchical", ep=8), world_size=8)
    assert lay.nvlink_domain == 4 and lay.groups()["expert"]["ep-rail"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert validate_job(_job("hierarchical", ep=8, nvlink_domain=2), world_size=8).nvlink_domain == 2
    # the other dispatchers do not split EP by node (a layout uneven across nodes stays legal for them)
    assert validate_job(_job("alltoall", ep=8), world_size=8).nvlink_domain is None
    # nodes of 3 ranks: the EP group [0, 1, 2, 3] holds 3 ranks on node 0 and 1 on node 1: refused
    with pytest.raises(ConfigError, match=r"parallel.nvlink_domain=3"):
        validate_job(_job("hierarchical", ep=4, nvlink_domain=3), world_size=12)
    with pytest.raises(ConfigError, match=r"parallel.nvlink_domain=0: must be an integer >= 1"):
        validate_job(_job("hierarchical", ep=8, nvlink_domain=0), world_size=8)
    with pytest.raises(ValueError, match=r"moe.expert_replicas=1.*moe.dispatcher=alltoall"):
        from folding.moe.config import MoEConfig

        MoEConfig(num_experts=8, topk=2, ffn_hidden_size=8, dispatcher="hierarchical", expert_replicas=1)
