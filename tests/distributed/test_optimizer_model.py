"""One optimizer step of the tiny Mixtral and tiny Qwen2-MoE on 8 gloo ranks equals the 1-rank step.

For each model (fp32, dropless, engine MoE layer, aux losses off) each rank first computes the
1-rank reference on the whole global batch (8 micro-batches of one sample, masked with uneven
valid-token counts): plain autograd, ``torch.nn.utils.clip_grad_norm_`` and ``torch.optim.AdamW``
with decay on matrices only. Then every folded layout runs the same micro-batches (each DP rank its
contiguous share) through :class:`FoldedOptimizer`, ZeRO-1 on or off, and every rank's parameters
after the step must equal its slice of the reference within REL relative + ABS absolute; the
grad norm must equal the 1-rank norm within 1e-5 relative.
"""

import torch
import torch.distributed as dist

from folding.model.transformer import MoETransformer
from folding.moe.settings import LayerSettings
from folding.optim import FoldedOptimizer, OptimConfig
from folding.parallel import ParallelLayout, build_parallel_state
from folding.parallel.params import require_spec, take_slice
from tests.presets import MIXTRAL, QWEN2_TIED, build, random_batch, variant

MODELS = [variant(p, num_layers=2, vocab_size=128, moe=dict(aux_loss_coeff=0.0)) for p in (MIXTRAL, QWEN2_TIED)]
LAYOUTS = [  # (layout with ETP written, ZeRO-1)
    (dict(tp=1, cp=1, ep=1, etp=1), False),  # DP8
    (dict(tp=2, cp=1, ep=1, etp=2), True),  # TP2 + SP, ETP2, EDP4 = DP*CP
    (dict(tp=1, cp=2, ep=2, etp=1), True),  # CP2, EDP4 != DP*CP=8
    (dict(tp=2, cp=2, ep=8, etp=1), True),  # EP8 folded over TP x CP x DP, EDP1
    (dict(tp=2, cp=2, ep=8, etp=1), False),  # same without ZeRO-1
    (dict(tp=2, cp=1, ep=2, etp=2), False),  # ETP2, EDP2 != DP*CP=4
    (dict(tp=1, cp=1, ep=4, etp=1), True),  # DP8, EDP2
    (dict(tp=4, cp=1, ep=2, etp=1), True),  # TP4, EDP4 != DP*CP=2
]
B, S = 8, 16
CFG = dict(
    lr=1e-3, decay_style="constant", weight_decay=0.1, clip_grad=0.5, beta1=0.9, beta2=0.95, eps=1e-4, bucket_size=2000
)


# Tolerance on parameters after the step: 1e-5 relative plus 1e-6 absolute. Adam's first update
# lr*g/(|g|+eps) turns a gradient difference dg into at most lr*dg/eps of parameter difference; the
# gradients agree to ~1e-8 (fp32 reduction order), so eps=1e-4 keeps that below 1e-7. With eps=1e-8
# the comparison is ill-conditioned: near-zero gradients amplify round-off up to lr itself.
REL, ABS = 1e-5, 1e-6


def _data():
    ids, labels, mask = random_batch(B, S, seed=3, masked=0.3, vocab_size=128)
    mask[2, S // 2 :] = 0.0  # end of document
    mask[5] = 0.0  # a fully padded sample
    return ids, labels, mask


def _slice(full, spec, p):
    """This rank's part of a 1-rank tensor (viewed in the spec's full shape, e.g. [E, 2, F, H])."""
    return take_slice(full.reshape(spec.full_shape), spec.shards).reshape(p.shape)


def _decays(name, p):
    return p.dim() >= 2 and "norm" not in name and "bias" not in name.rsplit(".", 1)[-1]


def _reference(cfg, world):
    ps1 = build_parallel_state(ParallelLayout(world_size=world))  # every group a singleton but DP
    try:
        ref = MoETransformer(cfg, parallel_state=ps1, settings=LayerSettings(init_seed=11), moe_factory=None)
        start = {n: p.detach().clone() for n, p in ref.named_parameters()}
        ids, labels, mask = _data()
        count = mask.sum()
        for m in range(B):
            (ref(ids[m : m + 1], labels=labels[m : m + 1], loss_mask=mask[m : m + 1]).sum() / count).backward()
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), CFG["clip_grad"]).item()
        named = list(ref.named_parameters())
        opt = torch.optim.AdamW(
            [
                {"params": [p for n, p in named if _decays(n, p)], "weight_decay": CFG["weight_decay"]},
                {"params": [p for n, p in named if not _decays(n, p)], "weight_decay": 0.0},
            ],
            lr=CFG["lr"],
            betas=(CFG["beta1"], CFG["beta2"]),
            eps=CFG["eps"],
        )
        opt.step()
        return start, {n: p.detach().clone() for n, p in named}, norm
    finally:
        ps1.destroy()


def _step_models(models, layouts):
    world = dist.get_world_size()
    ids, labels, mask = _data()
    count = mask.sum()
    report = []
    for mkw in models:
        cfg = build(mkw)
        start, ref_params, ref_norm = _reference(cfg, world)
        for lkw, distributed in layouts:
            ps = build_parallel_state(ParallelLayout(world_size=world, **lkw))
            try:
                model = MoETransformer(cfg, parallel_state=ps, settings=LayerSettings(init_seed=11), moe_factory=None)
                specs = {n: require_spec(p, n) for n, p in model.named_parameters()}
                with torch.no_grad():  # layout-independent init: each rank holds its slice of the start
                    for n, p in model.named_parameters():
                        assert torch.equal(p, _slice(start[n], specs[n], p)), n
                opt = FoldedOptimizer(model, OptimConfig(distributed=distributed, **CFG), parallel_state=ps)
                per = B // ps.coords.dp.size
                mine = range(ps.coords.dp.rank * per, (ps.coords.dp.rank + 1) * per)
                opt.zero_grad()
                for i, m in enumerate(mine):
                    ctx = opt.no_sync() if i < per - 1 else torch.enable_grad()
                    with ctx:
                        (
                            model(ids[m : m + 1], labels=labels[m : m + 1], loss_mask=mask[m : m + 1]).sum() / count
                        ).backward()
                norm, skipped = opt.clip_and_step()
                assert not skipped
                assert abs(norm - ref_norm) <= 1e-5 * ref_norm, (cfg.name, lkw, norm, ref_norm)
                worst = moved = 0.0
                for name, p in model.named_parameters():
                    moved = max(moved, (p.detach() - _slice(start[name], specs[name], p)).abs().max().item())
                    want = _slice(ref_params[name], specs[name], p)
                    err = (p.detach() - want).abs()
                    bad = (err > REL * want.abs() + ABS).sum().item()
                    assert bad == 0, (cfg.name, lkw, distributed, name, err.max().item())
                    worst = max(worst, err.max().item())
                assert moved > 100 * ABS, moved  # the step really changed weights
                report.append(
                    (cfg.name, ParallelLayout(world_size=world, **lkw).describe(), distributed, norm, ref_norm, worst)
                )
            finally:
                ps.destroy()
    return report


def test_tiny_models_step_matches_one_rank(ranks):
    results = ranks(8).run(_step_models, MODELS, LAYOUTS)
    assert len(results[0]) == len(MODELS) * len(LAYOUTS)
    for name, layout, distributed, norm, ref_norm, worst in results[0]:
        print(
            f"{name:15s} {layout:45s} zero1={distributed!s:5s} grad norm {norm:.7f} "
            f"(1 rank {ref_norm:.7f}) max |dp| {worst:.1e}"
        )
