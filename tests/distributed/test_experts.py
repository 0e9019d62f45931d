"""GroupedMLP on real EP / ETP process groups equals the 1-rank layer (outputs and gradients)."""

import torch
import torch.distributed as dist

from folding.moe.experts.grouped import GroupedMLP
from folding.moe.experts.select import resolve_backend
from folding.parallel import ParallelLayout, build_parallel_state
from folding.parallel.params import param_spec, shard_index
from tests.reference_collectives import reduce_from_region

E, H, F = 4, 8, 12
COUNTS = [3, 0, 4, 2]  # global rows per expert (expert 1 gets none)
LAYOUTS = [dict(ep=4, etp=1), dict(ep=2, etp=2), dict(ep=1, etp=4), dict(tp=2, ep=2, etp=1)]


def _global_inputs():
    g = torch.Generator().manual_seed(0)
    n = sum(COUNTS)
    return torch.randn(n, H, generator=g), torch.rand(n, generator=g), torch.randn(n, H, generator=g)


def _run_layouts(backend):
    """Each layout: this rank's output rows (ETP-reduced), partial x grad and weight grads."""
    x, p, dy = _global_inputs()
    results = []
    for kw in LAYOUTS:
        ps = build_parallel_state(ParallelLayout(world_size=dist.get_world_size(), **kw))
        try:
            e_local = E // ps.coords.ep.size
            first = ps.coords.ep.rank * e_local
            start = sum(COUNTS[:first])
            rows = slice(start, start + sum(COUNTS[first : first + e_local]))
            mod = GroupedMLP(
                num_experts=E,
                num_local_experts=e_local,
                hidden_size=H,
                ffn_hidden_size=F,
                etp_size=ps.coords.etp.size,
                etp_rank=ps.coords.etp.rank,
                expert_offset=first,
                backend=resolve_backend(backend, None, torch.device("cpu"), torch.float32),  # auto: decided first
                init_std=0.3,
            )
            xl = x[rows].clone().requires_grad_()
            partial = mod(xl, COUNTS[first : first + e_local], p[rows])
            out = reduce_from_region(partial, ps.groups.etp)  # what the dispatcher's reduce-scatter sums
            (out * dy[rows]).sum().backward()
            results.append(
                dict(
                    rows=(rows.start, rows.stop),
                    out=out.detach(),
                    gx_partial=xl.grad,
                    g1=mod.fc1_weight.grad,
                    g2=mod.fc2_weight.grad,
                    ep_rank=ps.coords.ep.rank,
                    specs={k: param_spec(getattr(mod, k)) for k in ("fc1_weight", "fc2_weight")},
                )
            )
        finally:
            ps.destroy()
    return results


def _reference():
    x, p, dy = _global_inputs()
    mod = GroupedMLP(num_local_experts=E, hidden_size=H, ffn_hidden_size=F, backend="loop", init_std=0.3)
    x = x.requires_grad_()
    out = mod(x, COUNTS, p)
    (out * dy).sum().backward()
    return out.detach(), x.grad, mod.fc1_weight.grad, mod.fc2_weight.grad


def _cut(full_grad, spec, like):
    """This rank's slice of a 1-rank gradient, as its parameter record describes it."""
    return full_grad.reshape(spec.full_shape)[shard_index(spec.full_shape, spec.shards)].reshape(like.shape)


def test_ep_etp_layouts_match_one_rank(ranks):
    out_ref, gx_ref, g1_ref, g2_ref = _reference()
    per_rank = ranks(4).run(_run_layouts, "auto")
    for li, kw in enumerate(LAYOUTS):
        gx_sum = torch.zeros_like(gx_ref)
        for rank_res in per_rank:
            r = rank_res[li]
            a, b = r["rows"]
            torch.testing.assert_close(r["out"], out_ref[a:b], msg=f"{kw}: output")
            gx_sum[a:b] += r["gx_partial"]
            s1, s2 = r["specs"]["fc1_weight"], r["specs"]["fc2_weight"]
            torch.testing.assert_close(r["g1"], _cut(g1_ref, s1, r["g1"]), msg=f"{kw}: fc1 grad")
            torch.testing.assert_close(r["g2"], _cut(g2_ref, s2, r["g2"]), msg=f"{kw}: fc2 grad")
        # x gradients: partial over ETP shards; summed over all ranks each row is counted by the
        # ETP ranks of its EP rank and once per replica (world / (EP*ETP) data-parallel copies)
        copies = 4 // (kw.get("ep", 1) * kw["etp"])
        torch.testing.assert_close(gx_sum / copies, gx_ref, msg=f"{kw}: x grad")
