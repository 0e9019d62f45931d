"""Optimizer steps on 8 gloo ranks equal the 1-rank AdamW steps, with and without ZeRO-1.

Uses the model of ``test_grad_reduction.py``. The reference is plain autograd on the full model,
``torch.nn.utils.clip_grad_norm_`` and ``torch.optim.AdamW`` with hand-written decay groups: an
oracle independent of ``folding.optim``. Two steps (warmup then peak LR, weight decay, clipping
active in half of the layouts) are compared parameter by parameter on every rank.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from folding.optim import FoldedOptimizer, OptimConfig, lr_at
from folding.parallel import ParallelLayout, build_parallel_state
from tests.distributed.test_grad_reduction import (
    MICRO,
    NO_DECAY,
    Coords,
    TinyFolded,
    _FakeCoords,
    _null,
    global_batch,
    global_params,
    local_micro_batches,
    reference_grads,
    shard,
)

STEPS = 2
REL, ABS = 1e-5, 1e-6  # parameters: |p - p_ref| <= REL*|p_ref| + ABS (lr = 1e-2)


def make_config(distributed: bool, clip: float) -> OptimConfig:
    return OptimConfig(
        lr=1e-2,
        min_lr=1e-3,
        warmup_steps=2,
        decay_steps=6,
        decay_style="cosine",
        weight_decay=0.1,
        clip_grad=clip,
        distributed=distributed,
        beta1=0.9,
        beta2=0.95,
        eps=1e-8,
        bucket_size=48,
    )


def _train(model, opt, c, steps, poison=False):
    ids, tgt, mask = global_batch()
    n = mask.sum()
    mbs = list(local_micro_batches(c))
    norms = []
    for _ in range(steps):
        opt.zero_grad()
        for i, m in enumerate(mbs):
            with opt.no_sync() if i < len(mbs) - 1 else _null():
                (model(ids[m], tgt[m], mask[m]) / n).backward()
        if poison:
            opt.reduce_gradients()
            if dist.get_rank() == 0:
                model.router.main_grad.view(-1)[0] = float("nan")
        norms.append(opt.clip_and_step())
    return norms


def _step_on_rank(cases, bf16_layout):
    out = []
    for layout_kwargs, tied, distributed, clip in cases:
        ps = build_parallel_state(ParallelLayout(world_size=dist.get_world_size(), **layout_kwargs))
        try:
            c = Coords(ps)
            model = TinyFolded(global_params(0, tied), c, tied)
            opt = FoldedOptimizer(model, make_config(distributed, clip), parallel_state=ps)
            norms = _train(model, opt, c, STEPS)
            out.append(
                {
                    "params": {k: p.detach().clone() for k, p in model.named_parameters()},
                    "norms": norms,
                    "lr": opt.lr,
                    "coords": _coords(c),
                    "mem": opt.memory_bytes(),
                }
            )
        finally:
            ps.destroy()
    if bf16_layout is None:
        return out
    ps = build_parallel_state(ParallelLayout(world_size=dist.get_world_size(), **bf16_layout))
    try:
        c = Coords(ps)
        extra = {"coords": _coords(c)}
        for distributed in (False, True):
            model = TinyFolded(global_params(0, False), c, False, dtype=torch.bfloat16)
            opt = FoldedOptimizer(model, make_config(distributed, 100.0), parallel_state=ps)
            _train(model, opt, c, 1)
            sd = _owned_masters(opt)
            extra[f"bf16_{distributed}"] = {k: p.detach().clone() for k, p in model.named_parameters()}
            extra[f"master_{distributed}"] = sd
        # NaN in one rank's gradient: every rank skips, nothing changes
        model = TinyFolded(global_params(0, False), c, False)
        opt = FoldedOptimizer(model, make_config(True, 1.0), parallel_state=ps)
        before = {k: p.detach().clone() for k, p in model.named_parameters()}
        ((norm, skipped),) = _train(model, opt, c, 1, poison=True)
        extra["skip"] = (
            norm,
            skipped,
            opt.step_count,
            all(torch.equal(before[k], p) for k, p in model.named_parameters()),
        )
        # state_dict round trip: step 2 from a restored optimizer equals step 2 of the original
        for distributed in (False, True):
            m1 = TinyFolded(global_params(0, False), c, False)
            o1 = FoldedOptimizer(m1, make_config(distributed, 1.0), parallel_state=ps)
            _train(m1, o1, c, 1)
            m2 = TinyFolded(global_params(7, False), c, False)  # other weights, then restored
            m2.load_state_dict(m1.state_dict())
            o2 = FoldedOptimizer(m2, make_config(distributed, 1.0), parallel_state=ps)
            o2.load_param_state(o1.param_state(), step=o1.step_count, updates=o1.updates)
            _train(m1, o1, c, 1)
            _train(m2, o2, c, 1)
            extra[f"resume_{distributed}"] = all(torch.equal(a, b) for a, b in zip(m1.parameters(), m2.parameters()))
        out.append(extra)
    finally:
        ps.destroy()
    return out


def _coords(c):
    return {"tp": c.tp, "ep": c.ep, "etp": c.etp, "tp_rank": c.tp_rank, "ep_rank": c.ep_rank, "etp_rank": c.etp_rank}


def reference_steps(tied: bool, clip: float, dtype=torch.float32):
    """Full-model parameters after ``STEPS`` AdamW steps, and the pre-clip norms."""
    model = TinyFolded(global_params(0, tied), Coords(None), tied, dtype=dtype)
    cfg = make_config(False, clip)
    decay = [p for k, p in model.named_parameters() if k not in NO_DECAY]
    no_decay = [p for k, p in model.named_parameters() if k in NO_DECAY]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
    )
    ids, tgt, mask = global_batch()
    n = mask.sum()
    norms = []
    for step in range(STEPS):
        opt.zero_grad()
        for m in range(MICRO):
            (model(ids[m], tgt[m], mask[m]) / n).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg)
        opt.step()
    return {k: p.detach().clone() for k, p in model.named_parameters()}, norms


LOW = 0.5  # below the 1-rank norm (checked below): clipping active

STEP_CASES = [
    # (layout with ETP written, tied, distributed optimizer, clip_grad)
    (dict(tp=1, cp=1, ep=1, etp=1), False, False, 100.0),  # DP8, plain data parallel
    (dict(tp=1, cp=1, ep=1, etp=1), False, True, LOW),  # DP8 with ZeRO-1
    (dict(tp=2, cp=1, ep=2, etp=2), True, True, LOW),  # TP2+SP, ETP2, EDP2 != DP*CP=4, tied
    (dict(tp=2, cp=2, ep=8, etp=1), False, True, 100.0),  # EP8 folded over TP x CP x DP, EDP1
    (dict(tp=2, cp=2, ep=8, etp=1), True, False, LOW),  # same, no ZeRO, tied
    (dict(tp=1, cp=2, ep=4, etp=2), False, True, LOW),  # CP2, ETP2
    (dict(tp=4, cp=1, ep=2, etp=1), False, True, 100.0),  # TP4, EDP4 != DP*CP=2
    (dict(tp=1, cp=1, ep=4, etp=1), True, True, 100.0),  # DP8, EDP2
    (dict(tp=2, cp=1, ep=4, etp=1), False, False, LOW),  # DP4, EDP2, no ZeRO
    (dict(tp=1, cp=2, ep=2, etp=1), False, True, 100.0),  # CP2 DP4, EDP4 != DP*CP=8
]
BF16_LAYOUT = dict(tp=2, cp=1, ep=2, etp=2)


def test_clip_threshold_is_active():
    norms = [reference_grads(tied)[1] for tied in (False, True)]
    assert LOW < min(norms) and max(norms) < 100.0


def _step_on_rank_elementwise(cases):
    """``_step_on_rank`` with the elementwise AdamW (the fallback where a build lacks the fused kernel)."""
    import folding.optim.adamw as adamw_module

    fused, adamw_module.FUSED_ADAMW = adamw_module.FUSED_ADAMW, None
    try:
        return _step_on_rank(cases, None)
    finally:
        adamw_module.FUSED_ADAMW = fused


def test_steps_match_one_rank_adamw(ranks):
    _check_steps(ranks(8).run(_step_on_rank, STEP_CASES, None), STEP_CASES)


def test_elementwise_adamw_fallback_matches(ranks):
    cases = [STEP_CASES[2], STEP_CASES[8]]  # ZeRO-1 and plain, TP/ETP and EP folded
    _check_steps(ranks(8).run(_step_on_rank_elementwise, cases), cases)


def _check_steps(results, cases):
    refs = {}
    for case_i, (layout_kwargs, tied, distributed, clip) in enumerate(cases):
        if (tied, clip) not in refs:
            refs[(tied, clip)] = reference_steps(tied, clip)
        ref_params, ref_norms = refs[(tied, clip)]
        for rank, per_rank in enumerate(results):
            r = per_rank[case_i]
            for (norm, skipped), want in zip(r["norms"], ref_norms):
                assert not skipped
                assert abs(norm - want) <= 1e-5 * want, (layout_kwargs, distributed, rank, norm, want)
            assert math.isclose(r["lr"], lr_at(STEPS, make_config(distributed, clip)))
            fc = _FakeCoords(r["coords"])
            for name, p in r["params"].items():
                want = shard(name, ref_params[name], fc)
                bad = ((p - want).abs() > REL * want.abs() + ABS).sum().item()
                assert bad == 0, (layout_kwargs, distributed, rank, name, (p - want).abs().max().item())
            # parameters did move (the comparison is not vacuous)
            moved = shard("expert_w1", global_params(0, tied)["expert_w1"], fc)
            assert (r["params"]["expert_w1"] - moved).abs().max() > 1e-3


def test_bf16_master_weights_skip_and_resume(ranks):
    results = ranks(8).run(_step_on_rank, [], BF16_LAYOUT)
    ref_one, _ = _one_step_reference()
    owned = 0
    for rank, (r,) in enumerate(results):
        fc = _FakeCoords(r["coords"])
        for distributed in (False, True):
            sd = r[f"master_{distributed}"]
            for name, p in r[f"bf16_{distributed}"].items():
                e = sd[name]
                assert p.dtype == torch.bfloat16 and e["master"].dtype == torch.float32
                lo, hi = e["flat_range"]
                owned += (hi - lo) if distributed else 0
                # the bf16 parameter is its fp32 master rounded
                assert torch.equal(p.reshape(-1)[lo:hi], e["master"].to(torch.bfloat16)), name
                # the master is the fp32 step to within bf16 forward noise (each update is ~lr = 5e-3)
                want = shard(name, ref_one[name], fc).reshape(-1)[lo:hi]
                assert want.numel() == hi - lo
                if hi > lo:
                    assert (e["master"] - want).abs().max() < 2e-2, (name, distributed)
        # ZeRO-1 and plain give the same bf16 parameters up to rare rounding flips
        for name, p in r["bf16_True"].items():
            q = r["bf16_False"][name]
            assert ((p.float() - q.float()).abs() > 1e-2).sum() == 0, name
        norm, skipped, count, unchanged = r["skip"]
        assert math.isnan(norm) and skipped and count == 0 and unchanged
        assert r["resume_False"] and r["resume_True"]
    # ZeRO-1 shards cover every element exactly once per data-parallel group (TP2, ETP2 here:
    # each element of a rank's local parameters lives on one of DP*CP=4 / EDP=2 ranks)
    total = sum(v.numel() for v in results[0][0]["bf16_False"].values())
    assert owned > 0 and owned < 8 * total


def _owned_masters(opt):
    """``name -> {"flat_range", "master"}``: the ``[lo, hi)`` of each flattened local parameter that
    this rank updates (all of it, or its ZeRO-1 shard) and its fp32 master weights there."""
    out = {}
    for buf, st in zip(opt.buffers, opt.state):
        for k, (name, off) in enumerate(zip(buf.names, buf.offsets)):
            b = buf.bucket_of[id(buf.params[k])]
            lo, hi = buf.update_range(b)
            a, z = max(lo, off), min(hi, off + buf.params[k].numel())
            master = st["master"][b.index].read()
            out[name] = {
                "flat_range": (a - off, z - off) if z > a else (0, 0),
                "master": master[a - lo : z - lo].clone() if z > a else master[:0].clone(),
            }
    return out


def _one_step_reference():
    global STEPS
    old, STEPS = STEPS, 1
    try:
        return reference_steps(False, 100.0, dtype=torch.float32)
    finally:
        STEPS = old


def _skip_between_updates(layout_kwargs):
    """Parameters after [update, skipped step, update] and after [update, update], same gradients,
    constant LR; and the update counters."""
    from folding.training.trainer import _skip_update

    ps = build_parallel_state(ParallelLayout(world_size=dist.get_world_size(), **layout_kwargs))
    try:
        c = Coords(ps)
        cfg = OptimConfig(
            lr=1e-2,
            warmup_steps=0,
            decay_style="constant",
            clip_grad=100.0,
            beta1=0.9,
            beta2=0.95,
            eps=1e-8,
            bucket_size=48,
            distributed=True,
        )
        out = []
        for skip in (True, False):
            model = TinyFolded(global_params(0, False), c, False)
            opt = FoldedOptimizer(model, cfg, parallel_state=ps)
            _train(model, opt, c, 1)
            if skip:
                ((_, skipped),) = _train(model, opt, c, 1, poison=True)
                assert skipped
                _skip_update(opt)  # what the trainer does with a skipped step
            _train(model, opt, c, 1)
            out.append(
                (
                    {k: p.detach().clone() for k, p in model.named_parameters()},
                    opt.step_count,
                    opt.updates,
                )
            )
        return out
    finally:
        ps.destroy()


def test_skipped_step_is_not_an_adam_update(ranks):
    for skipped, plain in ranks(4).run(_skip_between_updates, dict(tp=2, ep=2, etp=1)):
        assert skipped[1:] == (3, 2) and plain[1:] == (2, 2)
        # AdamW's bias correction counts updates: the skip leaves no trace in the parameters
        for name, p in skipped[0].items():
            assert torch.equal(p, plain[0][name]), name


def _threads() -> int:
    import os

    return len(os.listdir(f"/proc/{os.getpid()}/task"))


def _optimizer_is_freed(layout_kwargs):
    """After a step, dropping the model, the optimizer and the groups frees them all: the gradient
    hooks must not keep the optimizer (and through its buffers the process groups, each with gloo
    threads) alive in a cycle the collector cannot see."""
    import gc
    import weakref

    gc.collect()
    before = _threads()
    ps = build_parallel_state(ParallelLayout(world_size=dist.get_world_size(), **layout_kwargs))
    with ps:
        c = Coords(ps)
        model = TinyFolded(global_params(0, False), c, False)
        opt = FoldedOptimizer(model, make_config(True, 1.0), parallel_state=ps)
        _train(model, opt, c, 1)
        alive = weakref.ref(opt)
    del model, opt, c, ps
    gc.collect()
    return alive() is None, before, _threads()


def test_dropped_optimizer_frees_its_buffers_and_groups(ranks):
    for freed, before, after in ranks(4).run(_optimizer_is_freed, dict(tp=2, ep=2, etp=1)):
        assert freed, "the optimizer outlived every reference to it"
        assert after == before, f"{after - before} threads of destroyed process groups are still alive"
