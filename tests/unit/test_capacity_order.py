"""Capacity, drop order and filler order, pinned by hand (no megatron-core, no shared helper).

The sizes are large enough (T >= 32) that an unstable sort would reorder equal keys: torch's CPU
sort happens to keep small inputs in order, so hand cases with a few tokens cannot see it.
"""

import pytest
import torch

from folding.moe.dispatch import permute as permute_mod
from folding.moe.routing import functions as routing


@pytest.mark.parametrize(
    "T,k,E,cf,expected",
    [
        (10, 2, 3, 1.0, 7),  # 20/3 = 6.67 -> 7 (ceil, not round or floor)
        (7, 1, 4, 1.5, 3),  # 1.75 * 1.5 = 2.625 -> 3
        (16, 2, 8, 1.0, 4),  # exactly 4: no rounding up
        (5, 1, 4, 0.5, 1),  # 0.625 -> 1: a capacity never rounds to 0 for T > 0
        (12, 2, 4, 1.1, 7),  # 6 * 1.1 = 6.6000000000000005 -> 7
        (3, 2, 2, 4.0, 12),  # above T: capacity itself is not clamped
    ],
)
def test_capacity_is_ceil_of_tokens_times_k_over_experts_times_factor(T, k, E, cf, expected):
    assert routing.expert_capacity(T, topk=k, num_experts=E, capacity_factor=cf) == expected
    assert permute_mod.padded_rows_per_expert(T, k, E, cf) == min(expected, T)


T, E = 40, 4
# expert 0 is over-full: 25 routed tokens; expert 3 is under-full: tokens 30 and 35 only
ROUTED = {0: [t for t in range(T) if t % 8 != 3 and t < 31][:25], 3: [30, 35]}


def _map_and_probs():
    routing_map = torch.zeros(T, E, dtype=torch.bool)
    for e, toks in ROUTED.items():
        routing_map[toks, e] = True
    # probabilities rise with the token index: "probs" keeps the latest, "position" the earliest
    probs = routing_map.float() * (torch.arange(T, dtype=torch.float32).unsqueeze(1) + 1) / (T + 1)
    return routing_map, probs


def test_position_policy_keeps_the_earliest_tokens_of_an_overfull_expert():
    routing_map, probs = _map_and_probs()
    cap = routing.expert_capacity(T, topk=1, num_experts=E, capacity_factor=1.0)  # ceil(40/4) = 10
    new_probs, new_map = routing.apply_capacity(probs, routing_map, topk=1, capacity_factor=1.0, drop_policy="position")
    assert new_map[:, 0].nonzero().squeeze(1).tolist() == ROUTED[0][:cap]  # the first 10 routed
    assert new_map[:, 3].nonzero().squeeze(1).tolist() == ROUTED[3]  # under capacity: all kept
    assert torch.equal(new_probs, probs * new_map)
    by_probs = routing.apply_capacity(probs, routing_map, topk=1, capacity_factor=1.0, drop_policy="probs")[1]
    assert by_probs[:, 0].nonzero().squeeze(1).tolist() == ROUTED[0][-cap:]  # the 10 most probable = latest


def test_pad_to_capacity_fillers_are_the_earliest_unrouted_tokens():
    routing_map, probs = _map_and_probs()
    new_probs, new_map = routing.apply_capacity(
        probs, routing_map, topk=1, capacity_factor=1.0, drop_policy="position", pad_to_capacity=True
    )
    # expert 3: its 2 routed tokens, then the 8 earliest tokens not routed to it (0..7)
    assert new_map[:, 3].nonzero().squeeze(1).tolist() == sorted(ROUTED[3] + list(range(8)))
    assert new_probs[:8, 3].eq(0).all() and new_probs[[30, 35], 3].gt(0).all()
    # expert 1 received nothing: tokens 0..9
    assert new_map[:, 1].nonzero().squeeze(1).tolist() == list(range(10))
    # permute in pad mode: per expert, routed tokens first in token order, then fillers earliest first
    x = torch.arange(T, dtype=torch.float32).unsqueeze(1)
    capped = routing.apply_capacity(probs, routing_map, topk=1, capacity_factor=1.0, drop_policy="position")[1]
    rows, p, token_idx = permute_mod.permute(x, capped, probs * capped, rows_per_expert=10)
    expected = ROUTED[0][:10] + list(range(10)) + list(range(10)) + ROUTED[3] + list(range(8))
    assert token_idx.tolist() == expected
    assert p[30:32].gt(0).all() and p[32:].eq(0).all() and p[10:30].eq(0).all()
