"""Print the analytic per-rank memory of a model and layout, and optionally measure a tiny run.

Usage::

    python -m tools.memory --model mixtral_8x7b --world 64 --pp 4 --ep 8 --etp 1 \\
        --distributed --param-dtype bfloat16 --recompute selective --seq-length 4096 --micro-batch-size 1
    python -m tools.memory --model deepseek_v3_tiny --world 4 --tp 2 --pp 2 --ep 2 --etp 1 --distributed --measure

``--measure`` starts ``--world`` gloo ranks on this machine, builds every rank's model chunks (the
trainer's own) and optimizer, and prints measured bytes next to the model (use a tiny model preset,
e.g. ``mixtral_tiny``; every preset of :mod:`folding.model.presets` has an estimate). An impossible layout
exits with status 2 and a one-line message naming the setting. The flags are those of tools/plan.py
and tools/layout.py (``--model``, ``--world``, ``--seq-length``, ``--micro-batch-size``).
"""

from __future__ import annotations

import argparse
import sys

from folding.model.presets import get_preset, list_presets
from folding.parallel import LayoutError, ParallelLayout
from folding.planning.memory import RECOMPUTE_MODES, memory_per_rank
from folding.testing import RankPool
from tools.memory_measure import measure_on_rank

KINDS = ("params_dense", "params_expert", "grads_dense", "grads_expert", "optimizer_dense", "optimizer_expert")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--model",
        "--preset",
        dest="preset",
        choices=list_presets(),
        required=True,
        help="model preset (--preset is an alias)",
    )
    p.add_argument("--world", type=int, required=True, help="number of ranks")
    for axis in ("tp", "cp", "pp", "ep"):
        p.add_argument(f"--{axis}", type=int, default=1)
    p.add_argument("--vpp", type=int, default=None, help="virtual stages per pipeline rank (interleaved 1F1B)")
    p.add_argument("--etp", type=int, default=None, help="expert TP (default: --tp)")
    p.add_argument("--distributed", action="store_true", help="ZeRO-1 (optim.distributed=true)")
    p.add_argument("--param-dtype", default="bfloat16", choices=("float32", "bfloat16"))
    p.add_argument(
        "--recompute",
        default="none",
        help=f"a recompute setting: a mode ({', '.join(RECOMPUTE_MODES)}) or recompute modules joined by commas "
        "(core_attn,layernorm,moe_act,mla_up_proj,mlp,moe,shared_experts)",
    )
    p.add_argument("--offload", default="", help="offload modules joined by commas (train.offload_modules)")
    p.add_argument(
        "--seq-length",
        "--seq",
        dest="seq",
        type=int,
        default=0,
        help="tokens per sample (0: no activations; --seq is an alias)",
    )
    p.add_argument(
        "--micro-batch-size",
        "--mbs",
        dest="mbs",
        type=int,
        default=1,
        help="samples per micro-batch (--mbs is an alias)",
    )
    p.add_argument(
        "--microbatches",
        type=int,
        default=None,
        help="micro-batches per step and replica (caps the pipeline's in-flight count)",
    )
    p.add_argument(
        "--fused-swiglu",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the experts' weighted SwiGLU is one autograd node keeping 3 F-wide tensors per routed row, "
        "as folding's is (the default; the flag is accepted for older scripts); "
        "--no-fused-swiglu estimates a plain-autograd activation (5 per row)",
    )
    p.add_argument("--measure", action="store_true", help="also measure on --world local gloo ranks (a model preset)")
    return p.parse_args(argv)


def _gib(n):
    return f"{n / 2**30:10.3f} GiB" if n >= 2**20 else f"{n:>10d} B  "


def main(argv=None) -> int:
    a = parse_args(argv)
    cfg = get_preset(a.preset)
    try:
        layout = ParallelLayout(
            world_size=a.world,
            tp=a.tp,
            cp=a.cp,
            pp=a.pp,
            vpp=a.vpp,
            ep=a.ep,
            etp=a.etp,
            num_experts=cfg.moe.num_experts,
        )
        pb = 4 if a.param_dtype == "float32" else 2
        ests = [
            memory_per_rank(
                cfg,
                layout,
                param_bytes=pb,
                distributed=a.distributed,
                recompute=a.recompute,
                offload=a.offload,
                seq_length=a.seq,
                micro_batch_size=a.mbs,
                stage=s,
                num_microbatches=a.microbatches,
                fused_swiglu=a.fused_swiglu,
            )
            for s in range(layout.pp)
        ]
    except (LayoutError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{a.preset}: {layout.describe()}  optim.distributed={a.distributed}  params {a.param_dtype}")
    for e in ests:
        print(
            f"  stage {e.stage}: " + "  ".join(f"{k}={_gib(v).strip()}" for k, v in e.as_dict().items() if k != "stage")
        )
    if a.measure:
        with RankPool(a.world) as pool:
            kw = dict(tp=a.tp, cp=a.cp, pp=a.pp, vpp=a.vpp, ep=a.ep, etp=a.etp)
            res = pool.run(measure_on_rank, cfg, kw, distributed=a.distributed, dtype=a.param_dtype)
        print("measured (bytes; grads/optimizer include bucket padding to the data-parallel size):")
        print(f"  {'rank':>4} {'stage':>5} " + " ".join(f"{k:>24}" for k in KINDS))
        for r in res:
            cells = [f"{r['measured'][k]:>11d} / {r['model'][k]:<11d}" for k in KINDS]
            print(f"  {r['rank']:>4} {r['stage']:>5} " + " ".join(f"{c:>24}" for c in cells))
        print("  (measured / model)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
