"""Rank every legal folded layout of a model on a cluster by predicted step time (pure arithmetic, no GPUs).

Usage::

    python -m tools.plan --model mixtral_8x22b --world 128 --gpu h100 --seq-length 4096 --global-batch-size 256
    python -m tools.plan --model qwen2_57b_a14b --world 64 --gpu h100 --seq-length 4096 \\
        --global-batch-size 256 --json          # only a JSON list on stdout, best first
    python -m tools.plan ... --top 20 --all-variants --unfolded
    python -m tools.plan ... --overlap-moe-comm [--delay-wgrad]   # MoE exchanges hidden in the steady state
    python -m tools.plan ... --routing-skew zipf:1.2 --seed 0 --rank-by p99   # imbalanced routing
    python -m tools.plan ... --routing-trace loads.npy                         # counts [steps, layers, experts]
    python -m tools.plan ... --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16   # AdamW state precision
    python -m tools.plan ... --dispatcher hierarchical    # a token crosses the NIC once per remote node
    python -m tools.plan ... --fp8-recipe blockwise [--fp8-dense]   # FP8 expert (and dense) GEMMs
    python -m tools.plan ... --memory-gib [N]   # per layout, the fastest recompute + offload modules that fit

Each line is one parallel mapping (TP, CP, PP, EP, ETP) with its fastest VPP / recompute / distributed
optimizer setting (``--all-variants`` lists every setting), its predicted MFU, step time and per-GPU
memory, and the tokens per second per GPU it predicts; the line under it (``run: model=...
parallel.world_size=... parallel.gpu=... parallel.tp=... optim.distributed=... train.precision=bf16
train.micro_batch_size=... train.recompute=...``) holds the job overrides that run it as planned: the model,
world, GPU kind and node size, the layout, the optimizer and its dtypes, the precision, sequence, batch sizes
and recompute mode, and the ``--moe`` / ``--dispatcher`` / ``--fp8-recipe`` options, so that ``python
examples/pretrain_mixtral.py <those overrides> train.dry_run=true`` predicts the plan's memory and checks it
against the GPU (``--json``: ``overrides``, a list of strings). The line under the header says the precision
the plans assume. The expert half ends with where EP sits: ``EP in DP`` (its ranks all in one attention DP
group, as in Megatron-Core without folding) or ``EP over TP·CP·DP`` (folded across attention TP / CP ranks
too), so that a folded and an ``--unfolded`` line with the same sizes read alike only when they are the same
layout.
Layouts that do not fit in the GPU's memory are dropped. With ``--memory-gib [N]`` each layout gets the
fastest set of recompute and offload modules whose peak fits N GiB of usable memory (default: the GPU's), found
by :func:`folding.planning.planner.cheapest_fit`, and its line says ``recompute=<modules> offload=<modules>``.
With ``--routing-trace`` / ``--routing-skew`` the step time is the one at ``--rank-by``'s quantile of the steps
(each line also shows p50, p99 and the slowest EP rank's tokens over the mean at both, and the drops under a
capacity factor; ``--rank-by`` has no effect without them). The cost model and its calibration are
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
from folding.planning.imbalance import (
    RoutingModel,
    load_routing_trace,
    parse_skew,
    register_trace_reader,
    zipf_loads,
)
from folding.planning.job_memory import precision_summary
from folding.planning.optim_precision import OptimizerPrecision
from folding.planning.planner import (
    COMPUTE_EFFICIENCY,
    describe_plan,
    plan_layouts,
    planned_dispatcher,
)
from folding.planning.step_time import BF16, Cluster, TrainingShape
from folding.training.telemetry.trace_file import read_trace


def moe_overrides(items):
    """``["topk=4", "capacity_factor=1.0"]`` -> ``{"topk": 4, "capacity_factor": 1.0}`` (YAML values)."""
    out = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"--moe {item!r}: write KEY=VALUE, e.g. --moe topk=4")
        out[key] = yaml.safe_load(value)
    return out


GPU_MEMORY = object()
"""``--memory-gib`` without a value: the ``--gpu``'s usable memory."""


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
        help="with --overlap-moe-comm: the weight-gradient GEMMs run behind the backward's exchanges, the "
        "experts' behind the dispatch, attention's behind the combine of the layer below "
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
        "--pipeline-layouts",
        action="store_true",
        help="also plan interleaved pipelines whose PP x VPP virtual stages do not divide the layers, with the "
        "balanced parallel.pipeline_layout that counts the embedding, each MTP module and the loss as one layer "
        "each (e.g. DeepSeek-V3 on PP8 VPP4: Et|(tt|)*30mL)",
    )
    p.add_argument(
        "--all-variants",
        action="store_true",
        help="list every VPP / recompute / optimizer variant, not only the best per mapping",
    )
    p.add_argument(
        "--routing-trace",
        metavar="PATH",
        help="plan for the routed-token counts of a trace instead of balanced routing: a moe.trace_dir the "
        "engine wrote (or its routing_trace.bin), or [steps, MoE layers, experts] counts as .npy or .json "
        '(nested lists or {"counts": ...})',
    )
    p.add_argument(
        "--routing-skew",
        metavar="zipf:S",
        help="plan for synthetic skewed routing: expert popularity proportional to 1/rank^S (no expert "
        "above 1/topk of the routed copies), experts permuted per step and MoE layer from --seed "
        "(zipf:0 is balanced)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of --routing-skew's permutations (default 0)")
    p.add_argument("--skew-steps", type=int, default=100, help="steps drawn for --routing-skew (default 100)")
    p.add_argument(
        "--rank-by",
        choices=("p50", "p99"),
        default="p50",
        help="with --routing-trace / --routing-skew: rank by the step time at the median (default) or the "
        "99th-percentile step of the slowest EP rank's load",
    )
    p.add_argument(
        "--optimizer",
        choices=("adamw", "muon"),
        default="adamw",
        help="optim.name: adamw (default), or muon (one fp32 momentum for the hidden matrices, AdamW for the "
        "rest; Newton-Schulz time and working set counted)",
    )
    for flag, choices, what in (
        ("exp-avg-dtype", ("fp32", "bf16", "fp8"), "AdamW first moment (optim.exp_avg_dtype)"),
        ("exp-avg-sq-dtype", ("fp32", "bf16", "fp8"), "AdamW second moment (optim.exp_avg_sq_dtype)"),
        ("main-params-dtype", ("fp32", "bf16"), "master weights of the bf16 parameters (optim.main_params_dtype)"),
        ("main-grads-dtype", ("fp32", "bf16"), "main gradients and their reduction (optim.main_grads_dtype)"),
    ):
        p.add_argument(f"--{flag}", choices=choices, default="fp32", help=f"{what}; default fp32")
    p.add_argument(
        "--dispatcher",
        choices=("alltoall", "hierarchical"),
        default=None,
        help="moe.dispatcher to plan for (default: the preset's, after --moe): alltoall sends every routed "
        "copy on its own; hierarchical sends a token over the NIC once per distinct remote node and forwards "
        "it over NVLink there (node-limited with --moe num_groups=N --moe group_topk=M)",
    )
    p.add_argument(
        "--fp8-recipe",
        choices=("delayed", "tensorwise", "blockwise", "mxfp8", "rowwise"),
        default=None,
        help="moe.fp8_recipe: the routed experts' GEMMs in FP8, at the GPU's FP8 peak and FP8 efficiency "
        "(hardware.py; one constant for every recipe); default bf16",
    )
    p.add_argument(
        "--fp8-dense",
        action="store_true",
        help="with --fp8-recipe: the dense linear layers in FP8 too (Megatron-Core's --fp8-format on every "
        "TransformerEngine linear; folding's dense layers are bf16)",
    )
    p.add_argument(
        "--memory-gib",
        nargs="?",
        type=float,
        const=GPU_MEMORY,
        default=None,
        metavar="N",
        help="give each layout the fastest set of recompute modules (train.recompute_modules, or "
        "train.recompute=full) and offload modules (train.offload_modules) whose peak fits N GiB of usable "
        "memory (1.05 x peak <= N, the allocator overhead included); without N: the --gpu's usable memory. "
        "Without the flag each layout tries the recompute modes none, selective, moe and full only",
    )
    p.add_argument("--top", type=int, default=10, help="plans to list, best first (text and --json; default 10)")
    p.add_argument(
        "--json",
        action="store_true",
        help="print only a JSON list of the --top fitting layouts, best first (one per mapping unless "
        "--all-variants), each with its job overrides",
    )
    return p.parse_args(argv)


def _optimizer_note(prec: OptimizerPrecision) -> str:
    """The optimizer and its state bytes per bf16 parameter, for the header line."""
    adamw = f"{prec.describe()}: {prec.state_bytes(2):g} bytes of state per bf16 parameter"
    if prec.name != "muon":
        return adamw
    return f"Muon: {prec.muon_state_bytes(2):g} bytes of state per bf16 matrix parameter; AdamW for the rest, {adamw}"


def _overlap_note(args) -> str:
    note = ""
    if args.fp8_recipe:
        note += f", FP8 ({args.fp8_recipe}) {'all linear layers' if args.fp8_dense else 'experts'}"
    if not args.overlap_moe_comm:
        return note
    return note + ", MoE exchanges overlapped" + (", expert wgrad delayed" if args.delay_wgrad else "")


EP_LEGEND = (
    "EP in DP: the expert-parallel group lies inside one attention DP group (Megatron-Core without folding); "
    "EP over TP·CP·DP: it is folded across attention TP / CP ranks too"
)
"""Printed above the lines when any of them has EP > 1."""


def engine_trace_loads(path: str):
    """The routed (token, expert) pairs ``[steps, MoE layers, experts]`` of a trace the engine recorded
    (``moe.trace_dir``: the directory or its ``routing_trace.bin``), summed over source ranks, drops
    included: the planner applies the capacity factor itself."""
    trace = read_trace(path)
    return (trace.counts_SLRE.astype("int64") + trace.dropped_SLRE).sum(axis=2)


register_trace_reader(".bin", engine_trace_loads)
register_trace_reader("/", engine_trace_loads)


def routing_model(args, cfg):
    """The :class:`RoutingModel` of ``--routing-trace`` / ``--routing-skew`` (``None``: balanced)."""
    if args.routing_trace and args.routing_skew:
        raise ValueError("--routing-trace and --routing-skew are exclusive: give one")
    if args.routing_trace:
        loads = load_routing_trace(args.routing_trace)
    elif args.routing_skew:
        loads = zipf_loads(
            num_experts=cfg.moe.num_experts,
            num_layers=cfg.num_moe_layers(),
            steps=args.skew_steps,
            exponent=parse_skew(args.routing_skew),
            seed=args.seed,
            topk=cfg.moe.topk,
        )
    else:
        return None
    return RoutingModel(loads, cfg, rank_by=args.rank_by)


def _routing_note(args) -> str:
    if args.routing_trace:
        src = f"routing trace {args.routing_trace}"
    elif args.routing_skew:
        src = f"routing {args.routing_skew} seed {args.seed} over {args.skew_steps} steps"
    else:
        return ""
    return f", {src}, ranked by {args.rank_by}"


def _line(i: int, r, tokens: float, gpus: int) -> str:
    p = r.plan
    opt = "distopt" if p.distributed_optimizer else "no-distopt"
    if r.routing is not None:
        rt = r.routing
        opt += (
            f"  p50 {rt.p50.step_s:.3f} s p99 {rt.p99.step_s:.3f} s "
            f"max/mean {rt.load_p50.max_over_mean:.2f}/{rt.load_p99.max_over_mean:.2f}"
        )
        if rt.load_p99.dropped:
            opt += f" dropped {100 * rt.load_p50.dropped:.1f}%/{100 * rt.load_p99.dropped:.1f}%"
    return (
        f"{i:>3}  MFU {100 * r.mfu:5.1f}%  {tokens / r.time.step_s / gpus:7.0f} tok/s/GPU  "
        f"step {r.time.step_s:7.3f} s  mem {r.memory_gib:5.1f} GiB  "
        f"{describe_plan(p)}  recompute={p.recompute}{f' offload={p.offload}' if p.offload else ''} {opt}"
    )


def _moe_overrides(args) -> list:
    """Each ``--moe KEY=VALUE`` as the job's ``moe.KEY=VALUE`` (the planner's own overrides carry the rest:
    :attr:`~folding.planning.planner.PlanResult.overrides`)."""
    return [f"moe.{item}" for item in args.moe]


def _overrides(result, args):
    """The overrides that run ``result``'s plan as planned, with this invocation's ``--moe`` options (a key
    the plan's own overrides set, such as ``moe.dispatcher`` under ``--dispatcher``, once: the plan's)
    (``None``: no engine layout)."""
    over = result.overrides
    if over is None:
        return None
    keys = {o.partition("=")[0] for o in over}
    return over + [o for o in _moe_overrides(args) if o.partition("=")[0] not in keys]


def _overrides_line(result, args) -> str:
    """The ``run:`` line under a plan: the overrides that run it as planned."""
    over = _overrides(result, args)
    if over is None:
        return "run: no engine layout places EP this way (carved out of DP with CP > 1); plan without --unfolded"
    # a layout's quotes and | ( ) * are the shell's too: such an override is quoted again for the shell
    return "run: " + " ".join(f'"{o}"' if any(c in o for c in "|()*'") else o for o in over)


def memory_budget(args, gpu):
    """The usable GiB of ``--memory-gib`` (the GPU's when given without a value; ``None`` without the flag)."""
    if args.memory_gib is None:
        return None
    return gpu.usable_memory_gib if args.memory_gib is GPU_MEMORY else args.memory_gib


def _memory_note(args, gpu) -> str:
    """The fit rule of the header: the GPU's usable memory, or the ``--memory-gib`` budget and its search."""
    rule = f"less {100 * gpu.fragmentation:.0f}% allocator overhead"
    budget = memory_budget(args, gpu)
    if budget is None:
        return f"usable memory {gpu.usable_memory_gib:.1f} GiB {rule}"
    return f"memory budget {budget:.1f} GiB {rule}, cheapest recompute and offload modules that fit"


def _precision_note(args, shape) -> str:
    """The precision the plans assume (parameters, activations, gradients, optimizer state), and what of
    the plan no job setting carries."""
    note = "precision: " + precision_summary(param_bytes=BF16, act_bytes=BF16, optim_precision=shape.optim_precision)
    if not args.fused_swiglu:
        note += (
            "; --no-fused-swiglu plans 5 F-wide tensors per routed row where the engine keeps 3: the run: "
            "lines' dry runs predict less activation memory"
        )
    if args.fp8_dense:
        note += "; --fp8-dense has no job setting (folding's dense layers are bf16): the run: lines run them in bf16"
    return note


def main(argv=None) -> int:
    """Run the planner; 0 on success, 2 on bad input, 1 when no layout fits."""
    args = parse_args(argv)
    if args.fp8_dense and not args.fp8_recipe:
        print("error: --fp8-dense needs --fp8-recipe (the recipe the linear layers run)", file=sys.stderr)
        return 2
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
                name=args.optimizer,
            ),
            fp8_recipe=args.fp8_recipe,
            fp8_dense=args.fp8_dense,
        )
        routing = routing_model(args, cfg)
        results = plan_layouts(
            cfg,
            cluster=cluster,
            shape=shape,
            compute_efficiency=args.compute_efficiency,
            folded=not args.unfolded,
            distinct=not args.all_variants,
            overlap_moe_comm=args.overlap_moe_comm,
            delay_wgrad=args.delay_wgrad,
            routing=routing,
            dispatcher=args.dispatcher,
            pipeline_layouts=args.pipeline_layouts,
            memory_gib=memory_budget(args, gpu),
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([{**r.to_dict(), "overrides": _overrides(r, args)} for r in results[: args.top]]))
        return 0 if results else 1
    head = (
        f"{cfg.name} on {args.gpus} x {gpu.name}, seq {args.seq_length}, global batch "
        f"{args.global_batch_size}, micro-batch {args.micro_batch_size}, dispatcher "
        f"{planned_dispatcher(cfg, args.dispatcher)}: {len(results)} layouts fit "
        f"({_memory_note(args, gpu)}, "
        f"compute efficiency {args.compute_efficiency}{_overlap_note(args)}{_routing_note(args)}; optimizer "
        f"{_optimizer_note(shape.optim_precision)})"
    )
    print(head)
    print(_precision_note(args, shape))
    if not results:
        more = " or a larger --memory-gib" if args.memory_gib is not None else ""
        print(f"no legal layout fits in memory: use more GPUs, a GPU with more memory, or a shorter sequence{more}")
        return 1
    shown = results[: args.top]
    if any(r.plan.ep > 1 for r in shown):
        print(EP_LEGEND)
    for i, r in enumerate(shown, 1):
        print(_line(i, r, args.global_batch_size * args.seq_length, args.gpus))
        print("     " + _overrides_line(r, args))
    best = results[0]
    print("best step breakdown (s): " + ", ".join(f"{k} {v:.3f}" for k, v in best.time.breakdown.items()))
    print("best memory (GiB): " + ", ".join(f"{k} {v / 2**30:.1f}" for k, v in best.memory.by_part().items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
