"""Routing statistics as values: the router's record, the MoE layer's sum of its training forwards,
and the step's explicit collection (one process, no process group)."""

import dataclasses

import pytest
import torch

from folding.moe.config import MoEConfig
from folding.moe.layer import build_moe_layer
from folding.moe.routing.balancing import RoutingStats, find_routed_blocks
from folding.moe.settings import LayerSettings
from folding.parallel.groups import ProcessGroups

H = 6


def _layer(**kw):
    cfg = MoEConfig(
        num_experts=4, topk=2, ffn_hidden_size=8, aux_loss_coeff=0.1, z_loss_coeff=0.01, router_dtype="fp64", **kw
    )
    settings = LayerSettings(expert_backend="loop")  # runs in fp64 after .double()
    return build_moe_layer(
        cfg, hidden_size=H, groups=ProcessGroups.single(), layer_number=3, settings=settings
    ).double()


def _stats(layer_number, tokens, dropped, **losses):
    return RoutingStats(
        layer_number=layer_number,
        tokens_per_expert_E=torch.tensor(tokens),
        dropped_per_expert_E=torch.tensor(dropped),
        losses={k: torch.tensor(v, dtype=torch.float32) for k, v in losses.items()},
    )


def test_the_router_keeps_nothing_and_returns_its_record():
    layer = _layer(capacity_factor=0.5, drop_policy="position")
    x = torch.randn(8, H, dtype=torch.float64)
    out = layer.router(x)
    # 8 tokens × top-2 = 16 pairs, each kept at its expert or dropped there
    assert int(out.stats.tokens_per_expert_E.sum() + out.stats.dropped) == 16
    assert torch.equal(out.stats.tokens_per_expert_E, out.routing_map_TE.sum(0))
    assert set(out.stats.losses) == {"aux_loss", "z_loss"} and out.stats.layer_number == 3
    assert not [k for k in vars(layer.router) if k.startswith("last_")]
    with pytest.raises(dataclasses.FrozenInstanceError):
        out.probs_TE = None


def test_the_layer_sums_its_training_forwards_until_taken():
    layer = _layer()
    xs = [torch.randn(5, H, dtype=torch.float64) for _ in range(3)]
    # the router's own records of the same forwards (aux_loss and z-loss keep no state between calls)
    want = [layer.router(x).stats for x in xs]
    for x in xs:
        layer(x)
    got = layer.take_routing_stats()
    assert got.layer_number == 3
    assert torch.equal(got.tokens_per_expert_E, sum(s.tokens_per_expert_E for s in want))
    assert torch.equal(got.tokens_per_expert_E.sum(), torch.tensor(3 * 5 * 2))
    for name in ("aux_loss", "z_loss"):
        assert got.losses[name].dtype == torch.float64
        torch.testing.assert_close(got.losses[name], sum(s.losses[name].double() for s in want))
    assert layer.take_routing_stats() is None  # taken: forgotten
    layer.eval()
    layer(xs[0])
    assert layer.take_routing_stats() is None  # an evaluation forward is no training statistic
    assert find_routed_blocks([torch.nn.Sequential(layer)]) == [layer]


def test_sums_add_counts_and_losses_of_one_layer_only():
    a = _stats(1, [1, 2], [0, 1], aux_loss=0.5, z_loss=0.25)
    b = _stats(1, [3, 0], [2, 0], aux_loss=0.125)
    s = a + b
    assert s.tokens_per_expert_E.tolist() == [4, 2] and s.dropped_per_expert_E.tolist() == [2, 1]
    assert int(s.dropped) == 3
    assert {k: float(v) for k, v in s.losses.items()} == {"aux_loss": 0.625, "z_loss": 0.25}
    assert all(v.dtype == torch.float64 for v in s.losses.values())
    with pytest.raises(ValueError, match="layer 2"):
        a + _stats(2, [0, 0], [0, 0])
