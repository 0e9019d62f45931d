"""``train.compile`` (``LayerSettings.compile_dense``, :mod:`folding.model.compile`) changes no loss and no gradient.

On 2 gloo ranks, for TP2 (sequence parallel), CP2 and TP2 with selective recompute (the compiled
sublayer checkpointed), the same model is built twice from the same seed, one eager and one with
its dense parts compiled, and both run one forward and backward on the same batch: the losses and
every gradient must agree to fp32 round-off.
"""

import torch
import torch.distributed as dist

from folding.model.block import TransformerLayer
from folding.model.presets import get_preset
from folding.model.transformer import MoETransformer
from folding.moe.settings import LayerSettings
from folding.parallel import ParallelLayout, build_parallel_state

CASES = [(dict(tp=2, ep=2, etp=1), "none"), (dict(cp=2, ep=2, etp=1), "none"), (dict(tp=2, ep=2, etp=1), "selective")]


def _run(model, ids):
    loss = model(ids, labels=torch.roll(ids, -1, 1)).sum()
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _eager_and_compiled(cases):
    torch.set_num_threads(1)
    cfg = get_preset("mixtral_tiny", num_layers=2, init_std=0.02)  # the scale its tolerances were set at
    ids = torch.randint(0, cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(3))
    out = []
    for layout_kw, recompute in cases:
        ps = build_parallel_state(ParallelLayout(world_size=dist.get_world_size(), **layout_kw))
        try:
            results = []
            for compiled in (False, True):
                settings = LayerSettings(init_seed=7, recompute=recompute, compile_dense=compiled)
                model = MoETransformer(cfg, parallel_state=ps, settings=settings)
                layers = [m for m in model.modules() if isinstance(m, TransformerLayer)]
                assert len(layers) == cfg.num_layers and all(m.dense_compiled == compiled for m in layers)
                results.append(_run(model, ids))
            out.append(results)
        finally:
            ps.destroy()
    torch._dynamo.reset()  # the compiled code's guards hold the modules, and through them the groups
    return out


def test_compiled_dense_parts_match_eager(ranks):
    for per_rank in ranks(2).run(_eager_and_compiled, CASES):
        for (case, recompute), ((loss_e, grads_e), (loss_c, grads_c)) in zip(CASES, per_rank):
            assert torch.allclose(loss_e, loss_c, rtol=1e-6, atol=1e-5), (case, recompute, loss_e, loss_c)
            for name, g in grads_e.items():
                assert torch.allclose(g, grads_c[name], rtol=1e-4, atol=1e-6), (case, recompute, name)
            # the gradients are not vacuous
            assert max(g.abs().max().item() for g in grads_e.values()) > 1e-3
