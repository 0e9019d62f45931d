"""Pipelined models (1F1B, interleaved, with recompute) give the 1-rank losses and gradients.

Each rank computes the 1-rank reference (the whole model, the same micro-batches, singleton groups)
and then its share of each pipelined, folded layout: its data-parallel share of the global batch,
its chunks' layers. Gradients are summed as the optimizer does (DP×CP for dense, EDP for experts,
TP for sequence-parallel parameters, the embedding group for tied embeddings) and compared with the
matching slice of the 1-rank gradient.
"""

import torch
import torch.distributed as dist

from folding.model.chunks import build_stage_chunks
from folding.moe.settings import LayerSettings
from folding.parallel import ParallelLayout, build_parallel_state
from folding.parallel.params import param_spec, require_spec, take_slice
from folding.pipeline.stage import run_microbatches
from tests.presets import MIXTRAL, QWEN2_TIED, build, random_batch, variant

B, S = 4, 16
CONFIGS = {"mixtral": MIXTRAL, "qwen_tied": variant(QWEN2_TIED, mlp_only_layers=(1,))}
CASES = [  # (config, layout, recompute)
    ("mixtral", dict(pp=2, tp=2, ep=2, etp=1), "none"),
    ("mixtral", dict(pp=4, ep=2, etp=1), "none"),
    ("mixtral", dict(pp=2, vpp=2, tp=2, ep=4, etp=1), "none"),
    ("mixtral", dict(pp=2, tp=2, cp=2, ep=4, etp=1), "full"),
    ("qwen_tied", dict(pp=2, tp=2, ep=2, etp=2), "selective"),
    ("qwen_tied", dict(pp=4, ep=2, etp=1), "moe"),
    ("qwen_tied", dict(pp=2, vpp=2, cp=2, ep=2, etp=1), "full"),
]


def _microbatches(ids, labels, mask, rows):
    return [dict(tokens=ids[i : i + 1], labels=labels[i : i + 1], loss_mask=mask[i : i + 1]) for i in rows]


def _run(cases):
    world = dist.get_world_size()
    ids, labels, mask = random_batch(B, S, seed=3, masked=0.2)
    count = mask.sum().item()
    out = []
    refs = {}
    for cname, lkw, recompute in cases:
        cfg = build(CONFIGS[cname])
        if cname not in refs:
            ps1 = build_parallel_state(ParallelLayout(world_size=world))
            try:
                (ref,) = build_stage_chunks(model_config=cfg, parallel_state=ps1, settings=LayerSettings(init_seed=5))
                r = run_microbatches(
                    [ref], _microbatches(ids, labels, mask, range(B)), parallel_state=ps1, loss_scale=1.0 / count
                )
                refs[cname] = (
                    r["lm_loss_sum"].item(),
                    {n: (p.detach().clone(), p.grad.clone()) for n, p in ref.named_parameters()},
                )
            finally:
                ps1.destroy()
        ref_loss, ref_params = refs[cname]
        ps = build_parallel_state(ParallelLayout(world_size=world, **lkw))
        try:
            chunks = build_stage_chunks(
                model_config=cfg, parallel_state=ps, settings=LayerSettings(init_seed=5, recompute=recompute)
            )
            dp, r = ps.coords.dp.size, ps.coords.dp.rank
            rows = range(r * B // dp, (r + 1) * B // dp)
            res = run_microbatches(
                chunks, _microbatches(ids, labels, mask, rows), parallel_state=ps, loss_scale=1.0 / count
            )
            total = res["lm_loss_sum"].clone()
            dist.all_reduce(total)  # every token's loss is counted on exactly one rank per TP group
            total = total.item() / ps.coords.tp.size
            worst, seen = 0.0, 0
            for model in chunks:
                for name, p in model.named_parameters():
                    spec = require_spec(p, name)
                    full_p, full_g = ref_params[name]
                    assert torch.equal(
                        p.detach(), take_slice(full_p.reshape(spec.full_shape), spec.shards).reshape(p.shape)
                    ), name
                    g = p.grad.clone()
                    tags = param_spec(p)
                    dist.all_reduce(g, group=ps.groups.edp if tags.expert else ps.groups.dp_cp)
                    if tags.sequence_parallel:
                        dist.all_reduce(g, group=ps.groups.tp)
                    if tags.embedding_tied and ps.groups.embedding is not None:
                        dist.all_reduce(g, group=ps.groups.embedding)
                    want = take_slice(full_g.reshape(spec.full_shape), spec.shards).reshape(p.shape)
                    torch.testing.assert_close(g, want, rtol=1e-4, atol=1e-6, msg=f"{cname} {lkw} {name}")
                    worst = max(worst, (g - want).abs().max().item() / max(want.abs().max().item(), 1e-30))
                    seen += 1
            out.append((cname, ps.layout.describe(), recompute, total, ref_loss, worst, seen))
        finally:
            ps.destroy()
    return out


def test_pipelined_layouts_match_one_rank(ranks):
    results = ranks(8).run(_run, CASES)
    for i, (cname, layout, recompute, total, ref_loss, worst, seen) in enumerate(results[0]):
        print(
            f"{cname:10s} {layout:52s} recompute={recompute:9s} loss sum {total:.6f} "
            f"(1 rank {ref_loss:.6f}) worst rel grad err {worst:.1e}"
        )
        assert abs(total - ref_loss) <= 1e-5 * abs(ref_loss), (CASES[i], total, ref_loss)
        assert seen > 0
        # every rank reports the same global loss
        assert all(abs(r[i][3] - total) <= 1e-9 * abs(total) for r in results)
