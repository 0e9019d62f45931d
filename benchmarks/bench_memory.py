"""Per-rank memory as EP grows at a fixed world size, folded and non-folded, against folding/planning.

On ``--world`` gloo ranks (``folding.testing.RankPool``, CPU) and a small Mixtral, for EP in
``--eps`` (default 1, 2, 4, 8) and two attention layouts:

- ``non-folded``: attention ``TP1 DP=world``; EP is carved out of DP (EP <= DP), ETP = 1.
- ``folded``: attention ``TP=--tp`` (sequence parallel), ``DP = world/TP``; EP up to the world,
  ETP = 1 (EP > DP is only possible with folding).

What is measured on each rank, exactly:

- ``params``, ``grads``: bytes of this rank's parameter tensors and of their ``.grad`` after one
  backward (fp32, no gradient buffers beyond ``.grad``).
- ``optimizer``: bytes of ``torch.optim.AdamW``'s state tensors after one ``step()`` (both moments;
  the scalar ``step`` counters are included and negligible).
- ``activations (peak)``: the largest total of distinct tensor storages that autograd holds for
  backward during the forward (a ``torch.autograd.graph.saved_tensors_hooks`` pack hook adds each new
  storage, deduplicated by data pointer, parameters and their views excluded; the total only grows during forward, so its value at the end
  of forward is the peak). Transient buffers freed inside the forward (all-to-all staging,
  temporaries) are *not* counted: a CPU allocator exposes no peak-allocated statistic, so this is the
  saved-activation peak, not the process's resident peak.

The analytic column is ``folding.planning.memory.memory_per_rank`` for the same layout, fp32
parameters (``param_bytes=4``), activations at ``act_bytes=4``, no distributed optimizer.

Usage::

    python benchmarks/bench_memory.py --world 8 --seq 128 --out benchmarks/memory_ep_cpu.md
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MiB = 2.0 ** 20


def model_config(a):
    """The benchmark's architecture: the ``mixtral_tiny`` preset at the requested sizes."""
    from folding.model.presets import get_preset
    return get_preset("mixtral_tiny", hidden_size=a.hidden, moe_ffn_hidden_size=a.ffn, num_layers=a.layers,
                      vocab_size=a.vocab, router_aux_loss_coef=0.0)


def _bytes(ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts if t is not None)


def measure(cfg, layout_kw, seq, batch, seed):
    """On every rank: one training step, returning measured and analytic bytes (see module docstring)."""
    import torch.distributed as dist
    from folding.model.transformer import MoETransformer
    from folding.parallel import ParallelLayout, build_parallel_state
    from folding.planning.memory import ModelSizes, memory_per_rank
    torch.set_num_threads(1)
    layout = ParallelLayout(world_size=dist.get_world_size(), **layout_kw)
    ps = build_parallel_state(layout)
    try:
        model = MoETransformer(cfg, parallel_state=ps, init_seed=seed)
        gen = torch.Generator().manual_seed(seed + ps.dp_rank)
        ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=gen)
        # parameters (and views of them, e.g. w.t()) that autograd saves are not activations
        seen, live = {p.untyped_storage().data_ptr() for p in model.parameters()}, [0]

        def pack(t):
            key = t.untyped_storage().data_ptr()
            if key not in seen:
                seen.add(key)
                live[0] += t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(ids, labels=torch.roll(ids, -1, 1)).mean()
        act_peak = live[0]
        loss.backward()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        opt.step()
        params = list(model.parameters())
        state = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
        est = memory_per_rank(ModelSizes.from_model_config(cfg), layout, param_bytes=4, distributed=False,
                              seq_length=seq, micro_batch_size=batch, act_bytes=4)
        return {"params": _bytes(params), "grads": _bytes(p.grad for p in params), "optimizer": _bytes(state),
                "activations": act_peak,
                "est_params": est.params_dense + est.params_expert, "est_grads": est.grads_dense + est.grads_expert,
                "est_optimizer": est.optimizer_dense + est.optimizer_expert, "est_activations": est.activations}
    finally:
        ps.destroy()


def layouts(a):
    """``(name, ep, layout kwargs)`` for every legal combination of the sweep."""
    out = []
    for ep in a.eps:
        if ep <= a.world:                                              # non-folded: EP carved from DP
            out.append(("non-folded", ep, dict(tp=1, ep=ep, etp=1)))
    for ep in a.eps:
        out.append((f"folded (TP{a.tp})", ep, dict(tp=a.tp, ep=ep, etp=1)))
    return [(n, ep, kw) for n, ep, kw in out if a.world % (ep * kw["etp"]) == 0 and cfg_ok(a, ep)]


def cfg_ok(a, ep) -> bool:
    """EP must divide the 8 experts."""
    return 8 % ep == 0


def main(argv=None):
    """Run the sweep on ``--world`` ranks, print the table last and write the report."""
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, d in (("world", 8), ("tp", 2), ("hidden", 64), ("ffn", 192), ("layers", 2), ("vocab", 512),
                    ("seq", 128), ("batch", 2), ("seed", 0)):
        p.add_argument(f"--{name}", type=int, default=d)
    p.add_argument("--eps", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4, 8])
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    from folding.testing import RankPool
    cfg = model_config(a)
    rows = ["| layout | EP | DP | params MiB (model) | grads MiB (model) | AdamW state MiB (model) | "
            "saved activations peak MiB, max rank (model) | same, mean of ranks | total MiB, max rank |",
            "|---|---|---|---|---|---|---|---|---|"]
    peaks = {}
    with RankPool(a.world) as pool:
        for name, ep, kw in layouts(a):
            res = pool.run(measure, cfg, kw, a.seq, a.batch, a.seed)
            top = max(res, key=lambda r: r["params"] + r["grads"] + r["optimizer"] + r["activations"])
            act = max(r["activations"] for r in res)
            total = top["params"] + top["grads"] + top["optimizer"] + top["activations"]
            peaks.setdefault(name, []).append((ep, act, total))
            rows.append(f"| {name} | {ep} | {a.world // kw['tp']} | {top['params'] / MiB:.2f} ({top['est_params'] / MiB:.2f}) | "
                        f"{top['grads'] / MiB:.2f} ({top['est_grads'] / MiB:.2f}) | "
                        f"{top['optimizer'] / MiB:.2f} ({top['est_optimizer'] / MiB:.2f}) | "
                        f"{act / MiB:.2f} ({top['est_activations'] / MiB:.2f}) | "
                        f"{sum(r['activations'] for r in res) / len(res) / MiB:.2f} | {total / MiB:.2f} |")
            print(rows[-1], flush=True)
    trend = ["Dropless routing with a random router is unbalanced: with EP=8 each rank holds one expert, and "
             "the rank of the busiest expert receives more rows than the mean (the `max rank` vs `mean` "
             "activation columns); with EP=1 every rank averages all eight experts.", ""]
    for name, vals in peaks.items():
        first, last = vals[0], vals[-1]
        trend.append(f"- {name}: saved-activation peak EP{first[0]} -> EP{last[0]}: "
                     f"{100 * (last[1] / first[1] - 1):+.1f}%; total per rank {100 * (last[2] / first[2] - 1):+.1f}%")
    text = "\n".join([
        "# Per-rank memory as EP grows (fixed world size)", "",
        f"- device: CPU gloo, {a.world} ranks ({platform.machine()}), fp32; torch {torch.__version__}",
        f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
        f"- command: `python benchmarks/bench_memory.py {' '.join(argv)}`",
        f"- model: mixtral_tiny with H={a.hidden} F={a.ffn} E=8 top-2 layers={a.layers} vocab={a.vocab}; "
        f"micro-batch {a.batch} x seq {a.seq} per data-parallel rank; torch AdamW (not distributed)",
        "- measured: tensor bytes of parameters, `.grad` and AdamW state; activations = peak of distinct "
        "storages saved for backward (saved-tensor hook), not transient buffers (see the script's docstring)",
        "- in parentheses: `folding.planning.memory.memory_per_rank` for the same layout", "",
        *rows, "", *trend, ""])
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()
