"""Rank every legal folded layout of a model on a cluster by predicted step time (pure arithmetic, no GPUs).

Usage::

    python -m tools.plan --model mixtral_8x22b --world 128 --gpu h100 --seq-length 4096 --global-batch-size 256
    python -m tools.plan --model qwen2_57b_a14b --world 64 --gpu h100 --seq-length 4096 \\
        --global-batch-size 256 --json          # only a JSON list on stdout, best first
    python -m tools.plan ... --top 20 --all-variants --unfolded
    python -m tools.plan ... --overlap-moe-comm [--delay-wgrad]   # MoE exchanges hidden in the steady state
    python -m tools.plan ... --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16   # AdamW state precision

Each line is one parallel mapping (TP, CP, PP, EP, ETP) with its fastest VPP / recompute / distributed
optimizer setting (``--all-variants`` lists every setting), its predicted MFU, step time and per-GPU
memory. Layouts that do not fit in the GPU's memory are dropped. The cost model and its calibration are
described in docs/planner.md. Bad arguments exit with status 2 and a one-line message on stderr. The flags are those of
tools/memory.py and tools/layout.py (``--model``, ``--world``, ``--seq-length``, ``--micro-batch-size``).
"""

from __future__ import annotations

import argparse
import json
import sys

import yaml

from folding.model.presets import get_preset, list_presets
from folding.planning.hardware import get_gpu, list_gpus
from folding.planning.optim_precision import OptimizerPrecision
from folding.planning.planner import COMPUTE_EFFICIENCY, plan_layouts
from folding.planning.step_time import Cluster, TrainingShape


def moe_overrides(items):
    """``["topk=4", "capacity_factor=1.0"]`` -> ``{"topk": 4, "capacity_factor": 1.0}`` (YAML values)."""
    out = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"--moe {item!r}: write KEY=VALUE, e.g. --moe topk=4")
        out[key] = yaml.safe_load(value)
    return out


def parse_args(argv=None):
    """Command-line arguments (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help=f"model preset: {', '.join(list_presets())}")
    p.add_argument(
        "--world",
        "--gpus",
        dest="gpus",
        type=int,
        required=True,
        help="number of GPUs (world size; --gpus is an alias)",
    )
    p.add_argument(
        "--moe",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="change the preset's MoE record, as the job's moe.KEY=VALUE does (repeatable; e.g. --moe topk=4)",
    )
    p.add_argument("--gpu", default="h100", help=f"GPU kind: {', '.join(list_gpus())} (default h100)")
    p.add_argument("--seq-length", type=int, required=True, help="tokens per sample")
    p.add_argument("--global-batch-size", type=int, required=True, help="samples per optimizer step")
    p.add_argument("--micro-batch-size", type=int, default=1, help="samples per micro-batch (default 1)")
    p.add_argument(
        "--fused-swiglu",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the experts' weighted SwiGLU is one autograd node keeping 3 F-wide tensors per routed row, "
        "as folding's and Megatron-Core's are (the default; the flag is accepted for older scripts); "
        "--no-fused-swiglu plans for a plain-autograd activation (5 per row)",
    )
    p.add_argument("--nvlink-domain", type=int, default=8, help="GPUs per NVLink domain (default 8)")
    p.add_argument(
        "--tp-comm-overlap",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="chunk all sequence-parallel communication behind the GEMMs (userbuffers, Megatron-Core's "
        "--tp-comm-overlap); off by default, as in Megatron-Core and folding: forward collectives "
        "exposed, backward ones partly overlapped (--no-tp-comm-overlap, the default, is accepted)",
    )
    p.add_argument(
        "--overlap-moe-comm",
        action="store_true",
        help="plan for parallel.overlap_moe_comm=true: in the steady state one micro-batch's forward and "
        "another's backward run paired, each MoE exchange hidden behind the other's compute (bounded by it), "
        "one more micro-batch of one model chunk in flight per pipeline rank",
    )
    p.add_argument(
        "--delay-wgrad",
        action="store_true",
        help="with --overlap-moe-comm: the experts' weight-gradient GEMMs run behind the backward dispatch "
        "(parallel.delay_wgrad=true)",
    )
    p.add_argument(
        "--compute-efficiency",
        type=float,
        default=COMPUTE_EFFICIENCY,
        help=f"fraction of peak BF16 FLOP/s the GEMMs reach (default {COMPUTE_EFFICIENCY}, calibrated)",
    )
    p.add_argument(
        "--unfolded",
        action="store_true",
        help="plan Megatron-Core layouts without folding (ETP=TP, EP inside DP) instead",
    )
    p.add_argument(
        "--all-variants",
        action="store_true",
        help="list every VPP / recompute / optimizer variant, not only the best per mapping",
    )
    for flag, choices, what in (
        ("exp-avg-dtype", ("fp32", "bf16", "fp8"), "AdamW first moment (optim.exp_avg_dtype)"),
        ("exp-avg-sq-dtype", ("fp32", "bf16", "fp8"), "AdamW second moment (optim.exp_avg_sq_dtype)"),
        ("main-params-dtype", ("fp32", "bf16"), "master weights of the bf16 parameters (optim.main_params_dtype)"),
        ("main-grads-dtype", ("fp32", "bf16"), "main gradients and their reduction (optim.main_grads_dtype)"),
    ):
        p.add_argument(f"--{flag}", choices=choices, default="fp32", help=f"{what}; default fp32")
    p.add_argument("--top", type=int, default=10, help="lines to print (text mode; default 10)")
    p.add_argument(
        "--json",
        action="store_true",
        help="print only a JSON list of the fitting layouts, best first (one per mapping unless --all-variants)",
    )
    return p.parse_args(argv)


def _overlap_note(args) -> str:
    if not args.overlap_moe_comm:
        return ""
    return ", MoE exchanges overlapped" + (", expert wgrad delayed" if args.delay_wgrad else "")


def _line(i: int, r) -> str:
    p = r.plan
    vpp = f" VPP{p.vpp}" if p.vpp > 1 else ""
    ends = [(w, n) for w, n in (("first", p.first_stage_layers), ("last", p.last_stage_layers)) if n]
    if ends:
        vpp += " (" + ", ".join(f"{w} stage {n} layers" for w, n in ends) + ")"
    opt = "distopt" if p.distributed_optimizer else "no-distopt"
    return (
        f"{i:>3}  MFU {100 * r.mfu:5.1f}%  step {r.time.step_s:7.3f} s  mem {r.memory_gib:5.1f} GiB  "
        f"TP{p.tp} CP{p.cp} DP{p.dp} PP{p.pp}{vpp} | ETP{p.etp} EP{p.ep} EDP{p.edp}  "
        f"recompute={p.recompute} {opt}"
    )


def main(argv=None) -> int:
    """Run the planner; 0 on success, 2 on bad input, 1 when no layout fits."""
    args = parse_args(argv)
    if args.delay_wgrad and not args.overlap_moe_comm:
        print("error: --delay-wgrad needs --overlap-moe-comm (it moves what that hides)", file=sys.stderr)
        return 2
    try:
        cfg = get_preset(args.model)
        if args.moe:
            cfg = cfg.replace(moe=moe_overrides(args.moe))
        gpu = get_gpu(args.gpu)
        cluster = Cluster(
            gpu=gpu, num_gpus=args.gpus, nvlink_domain=args.nvlink_domain, tp_comm_overlap=args.tp_comm_overlap
        )
        shape = TrainingShape(
            seq_length=args.seq_length,
            global_batch_size=args.global_batch_size,
            micro_batch_size=args.micro_batch_size,
            fused_swiglu=args.fused_swiglu,
            optim_precision=OptimizerPrecision(
                exp_avg_dtype=args.exp_avg_dtype,
                exp_avg_sq_dtype=args.exp_avg_sq_dtype,
                main_params_dtype=args.main_params_dtype,
                main_grads_dtype=args.main_grads_dtype,
            ),
        )
        results = plan_layouts(
            cfg,
            cluster=cluster,
            shape=shape,
            compute_efficiency=args.compute_efficiency,
            folded=not args.unfolded,
            distinct=not args.all_variants,
            overlap_moe_comm=args.overlap_moe_comm,
            delay_wgrad=args.delay_wgrad,
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([r.to_dict() for r in results]))
        return 0 if results else 1
    head = (
        f"{cfg.name} on {args.gpus} x {gpu.name}, seq {args.seq_length}, global batch "
        f"{args.global_batch_size}, micro-batch {args.micro_batch_size}: {len(results)} layouts fit "
        f"(usable memory {gpu.usable_memory_gib:.1f} GiB less {100 * gpu.fragmentation:.0f}% allocator overhead, "
        f"compute efficiency {args.compute_efficiency}{_overlap_note(args)}; optimizer "
        f"{shape.optim_precision.describe()}: {shape.optim_precision.state_bytes(2):g} bytes of state per bf16 "
        f"parameter)"
    )
    print(head)
    if not results:
        print("no legal layout fits in memory: use more GPUs, a GPU with more memory, or a shorter sequence")
        return 1
    for i, r in enumerate(results[: args.top], 1):
        print(_line(i, r))
    best = results[0]
    print("best step breakdown (s): " + ", ".join(f"{k} {v:.3f}" for k, v in best.time.breakdown.items()))
    print("best memory (GiB): " + ", ".join(f"{k} {v / 2**30:.1f}" for k, v in best.memory.by_part().items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
