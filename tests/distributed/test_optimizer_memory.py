"""Measured per-rank parameter, gradient and optimizer bytes match folding/planning/memory.py.

On 8 gloo ranks, for several folded layouts with ZeRO-1 on and off and fp32/bf16 parameters, the
optimizer's own buffers (``FoldedOptimizer.memory_bytes``) and the model's parameters are measured on
every rank and compared with the analytic model. Gradient and sharded-state buffers are padded to a
multiple of the data-parallel size per bucket, so measured - model must lie in [0, padding bound].
At a fixed world of 8, expert parameters and gradients per rank must fall as 1/EP (and so must the
expert optimizer state without ZeRO-1; with it, it stays total/world).
"""

import torch
import torch.distributed as dist

from folding.optim import FoldedOptimizer, OptimConfig
from folding.parallel import ParallelLayout, build_parallel_state
from folding.parallel.params import param_spec
from folding.planning.memory import ModelSizes, memory_per_rank
from tests.distributed.test_grad_reduction import FE, FF, Coords, E, H, TinyFolded, V, global_params

SIZES = ModelSizes(
    vocab_size=V,
    hidden_size=H,
    num_layers=1,
    num_experts=E,
    moe_ffn_hidden_size=FE,
    top_k=2,
    dense_ffn_hidden_size=FF,
    dense_gated=False,
    dense_bias=True,
    tied_embeddings=True,
)

CASES = [  # (layout with ETP written, ZeRO-1, parameter dtype)
    *[(dict(ep=ep, etp=1), dist_opt, torch.float32) for ep in (1, 2, 4, 8) for dist_opt in (False, True)],
    (dict(tp=2, ep=2, etp=2), True, torch.bfloat16),
    (dict(tp=2, cp=2, ep=8, etp=1), False, torch.bfloat16),
    (dict(tp=4, ep=2, etp=1), True, torch.float32),
]


def _measure(cases):
    out = []
    for layout_kwargs, distributed, dtype in cases:
        ps = build_parallel_state(ParallelLayout(world_size=dist.get_world_size(), **layout_kwargs))
        try:
            model = TinyFolded(global_params(0, True), Coords(ps), True, dtype=dtype)
            params = {"dense": 0, "expert": 0}
            for p in model.parameters():
                params["expert" if param_spec(p).expert else "dense"] += p.numel() * p.element_size()
            opt = FoldedOptimizer(
                model, OptimConfig(distributed=distributed, decay_style="constant"), parallel_state=ps
            )
            m = opt.memory_bytes()
            m["model_params_dense"], m["model_params_expert"] = params["dense"], params["expert"]
            m["buckets_dense"] = sum(len(b.buckets) for b in opt.buffers if not b.cls.expert)
            m["buckets_expert"] = sum(len(b.buckets) for b in opt.buffers if b.cls.expert)
            out.append(m)
        finally:
            ps.destroy()
    return out


def test_measured_memory_matches_model(ranks):
    results = ranks(8).run(_measure, CASES)
    model_expert = {}
    for i, (layout_kwargs, distributed, dtype) in enumerate(CASES):
        layout = ParallelLayout(world_size=8, **layout_kwargs)
        pb = torch.tensor([], dtype=dtype).element_size()
        est = memory_per_rank(SIZES, layout, param_bytes=pb, distributed=distributed)
        dsize = {"dense": layout.dp * layout.cp, "expert": layout.edp}
        for rank, per_rank in enumerate(results):
            m = per_rank[i]
            for kind in ("dense", "expert"):
                want_p = getattr(est, f"params_{kind}")
                assert m[f"model_params_{kind}"] == want_p, (layout_kwargs, rank, kind)
                assert m[f"params_{kind}"] - want_p in range(0, pb * dsize[kind] * m[f"buckets_{kind}"]), kind
                pad = m[f"grads_{kind}"] - getattr(est, f"grads_{kind}")
                assert 0 <= pad < 4 * dsize[kind] * m[f"buckets_{kind}"], (layout_kwargs, rank, kind, pad)
                state = 8 + (4 if pb != 4 else 0)
                opt_bound = state * m[f"buckets_{kind}"] * (1 if distributed else dsize[kind])
                pad = m[f"optimizer_{kind}"] - getattr(est, f"optimizer_{kind}")
                assert 0 <= pad <= opt_bound, (layout_kwargs, distributed, rank, kind, pad)
        if layout.tp == 1 and layout.cp == 1:
            model_expert[(layout.ep, distributed)] = results[0][i]
    for ep in (2, 4, 8):
        for distributed in (False, True):
            base, m = model_expert[(1, distributed)], model_expert[(ep, distributed)]
            assert m["model_params_expert"] * ep == base["model_params_expert"]
            assert m["grads_expert"] * ep == base["grads_expert"]
        # without ZeRO-1 the expert state falls as 1/EP; with it, it is total/world whatever EP
        assert model_expert[(ep, False)]["optimizer_expert"] * ep == model_expert[(1, False)]["optimizer_expert"]
        assert model_expert[(ep, True)]["optimizer_expert"] == model_expert[(1, True)]["optimizer_expert"]
