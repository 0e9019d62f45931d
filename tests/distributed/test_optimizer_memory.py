"""Measured per-rank parameter, gradient and optimizer bytes match folding/planning/memory.py.

On 8 gloo ranks, for several folded layouts with ZeRO-1 on and off and fp32/bf16 parameters, this
rank's real model chunks (:func:`folding.model.chunks.build_stage_chunks`, as the trainer builds
them: Mixtral-, Qwen2-MoE- and DeepSeek-V3-shaped tiny presets, the last with multi-head latent
attention and multi-token prediction on a 2-stage pipeline) and the optimizer's own buffers
(``FoldedOptimizer.memory_bytes``) are measured on every rank and compared with the analytic model
of the rank's stage. Gradient and sharded-state buffers are padded to a multiple of the data-parallel
size per bucket, so measured - model must lie in [0, padding bound]; parameters are exact. At a fixed
world of 8, expert parameters and gradients per rank must fall as 1/EP (and so must the expert
optimizer state without ZeRO-1; with it, it stays total/world).
"""

import torch
import torch.distributed as dist

from folding.model.chunks import build_stage_chunks
from folding.model.presets import get_preset
from folding.moe.settings import LayerSettings
from folding.optim import FoldedOptimizer, OptimConfig
from folding.parallel import ParallelLayout, build_parallel_state
from folding.parallel.params import param_spec
from folding.planning.memory import memory_per_rank

CASES = [  # (preset, layout with ETP written, ZeRO-1, parameter dtype)
    *[("mixtral_tiny", dict(ep=ep, etp=1), d, torch.float32) for ep in (1, 2, 4, 8) for d in (False, True)],
    ("mixtral_tiny", dict(tp=2, ep=2, etp=2), True, torch.bfloat16),
    ("qwen2_moe_tiny", dict(tp=2, cp=2, ep=8, etp=1), False, torch.bfloat16),
    ("qwen2_moe_tiny", dict(tp=4, ep=2, etp=1), True, torch.float32),
    ("deepseek_v3_tiny", dict(tp=2, pp=2, ep=2, etp=1), True, torch.bfloat16),
]


def _measure(cases):
    out = []
    for preset, layout_kwargs, distributed, dtype in cases:
        cfg = get_preset(preset)
        lay = ParallelLayout(world_size=dist.get_world_size(), num_experts=cfg.moe.num_experts, **layout_kwargs)
        ps = build_parallel_state(lay)
        try:
            model = torch.nn.ModuleList(
                build_stage_chunks(model_config=cfg, parallel_state=ps, settings=LayerSettings(params_dtype=dtype))
            )
            params = {"dense": 0, "expert": 0}
            for p in model.parameters():
                params["expert" if param_spec(p).expert else "dense"] += p.numel() * p.element_size()
            opt = FoldedOptimizer(
                model, OptimConfig(distributed=distributed, decay_style="constant"), parallel_state=ps
            )
            m = opt.memory_bytes()
            m["stage"] = ps.coords.pp.rank
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
    for i, (preset, layout_kwargs, distributed, dtype) in enumerate(CASES):
        layout = ParallelLayout(world_size=8, **layout_kwargs)
        pb = torch.tensor([], dtype=dtype).element_size()
        dsize = {"dense": layout.dp * layout.cp, "expert": layout.edp}
        for rank, per_rank in enumerate(results):
            m = per_rank[i]
            est = memory_per_rank(get_preset(preset), layout, param_bytes=pb, distributed=distributed, stage=m["stage"])
            for kind in ("dense", "expert"):
                want_p = getattr(est, f"params_{kind}")
                assert m[f"model_params_{kind}"] == want_p, (preset, layout_kwargs, rank, kind)
                assert m[f"params_{kind}"] - want_p in range(0, pb * dsize[kind] * m[f"buckets_{kind}"]), kind
                pad = m[f"grads_{kind}"] - getattr(est, f"grads_{kind}")
                assert 0 <= pad < 4 * dsize[kind] * m[f"buckets_{kind}"], (layout_kwargs, rank, kind, pad)
                state = 8 + (4 if pb != 4 else 0)  # padding bound per element (fp32 routers need less)
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
