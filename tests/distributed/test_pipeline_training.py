"""Every layout trains like one rank: 6 optimizer steps of tiny Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE and
DeepSeek-V3 (fp32, micro-batches of 2 sequences, several per step, the same split everywhere) give the
1-rank per-step losses and final parameters on 8 gloo ranks, through the real training loop (pipeline schedules,
folded MoE, gradient reduction, optimizer). A bf16 layout trains like the one-rank bf16 run (losses,
gradient norms and fp32 master weights, within tolerances measured and justified at ``BF16_LOSS_RTOL``).
Dropping cases route in fp64 and are compared element by element like the dropless ones. Inside every
run the option under test is shown to be in effect (:func:`_check_option_active`): the merged pairs each
rank's schedule should run did run, replicas were in use, the optimizer kept the chosen state.
The 1-rank losses of 10 steps are the golden losses in ``tests/golden_losses.json``.

Every case also runs with ``parallel.overlap_moe_comm`` (the ``overlap`` parameter), every other one
with ``parallel.delay_wgrad`` too: merged forward-backward pairs whose MoE exchanges hide behind each
other's compute must give the same tolerances against one rank and, against the same layout without
overlap, bitwise the same losses, gradient norms and parameters.

With bf16 AdamW moments (``optim.exp_avg_dtype=exp_avg_sq_dtype=bf16``, the ``bf16_moments`` case) two
cases of the matrix, one with ZeRO-1 and one without, train like one rank with bf16 moments: the same
loss and grad-norm tolerances, parameters within the bound of one bf16 rounding flip per step.

With hot-expert replicas (the ``replicas`` case: ``moe.expert_replicas=1``, re-planned every 2 steps,
so replicas are in use from step 3 on) four cases (EP4 dropless, PP2 EP4 dropping, EP2×ETP2, PP2×EP2)
train like one rank without replicas under the same tolerances; with ``parallel.overlap_moe_comm`` too
(``replicas_overlap``) two cases whose ranks run merged pairs train like one rank and bitwise like
their runs with replicas and without overlap, the second one also with ``parallel.delay_wgrad``.

With dropout (``model.hidden_dropout=0.1``, ``model.attention_dropout=0.2``: :data:`DROPOUT`) the second half
of the fp32 matrix trains like one rank with dropout, with overlap on (bitwise as off) and with the memory
parameter's recompute and offload modules (bitwise as without them): every layout drops the same elements as one
rank, and recomputed and overlapped forwards drop them again. Those runs also pad the vocabulary
(``model.make_vocab_size_divisible_by=384``: 512 ids in 768 rows, a TP rank's slice partly or wholly padding).
Inside every such run the dropout is shown to act (:func:`_check_dropout_active`).

With Muon (``optim.name=muon``, the ``muon`` case) four cases of the matrix train like one rank with
Muon under the fp32 tolerances: ZeRO-1 with PP2 TP2 (TP-gathered attention and dense matrices, each
matrix orthogonalized by its owner in the DP group), VPP2 TP2 EP4 with ZeRO-1, ETP2 without ZeRO-1
(expert matrices gathered over ETP) and Qwen2-MoE's shared expert with ETP2 and ZeRO-1."""

import collections
import contextlib
import json
import os

import pytest
import torch
import torch.distributed as dist

from folding.data.config import DataConfig
from folding.job.config import JobConfig, LoggingConfig, ParallelConfig, TrainConfig, WandbConfig
from folding.model.presets import get_preset
from folding.optim.config import OptimConfig
from folding.parallel import build_parallel_state
from folding.parallel.params import require_spec, take_slice

STEPS = 4  # per equivalence run: 2 warm-up steps and 2 of cosine decay; the 8-rank runs' time is per step
GOLDEN_STEPS = 10  # the golden curves (one rank, cheap)
GOLDEN = os.path.join(os.path.dirname(os.path.dirname(__file__)), "golden_losses.json")
MODELS = {
    # init std and aux-loss weight pinned to the values the golden curve and the cases were recorded with
    # (the preset's before its demo values), so that they keep checking the same numerics
    "mixtral_tiny": dict(hidden_size=32, init_std=0.02, moe=dict(ffn_hidden_size=16, aux_loss_coeff=0.01)),
    "qwen2_moe_tiny": dict(
        hidden_size=32,
        moe=dict(ffn_hidden_size=16, shared_expert_ffn_hidden_size=16),
        ffn_hidden_size=32,
        mlp_only_layers=(1,),
    ),
    # head_dim stays 16 (hidden/heads is 4): q/k widths differ from the hidden size
    "qwen3_moe_tiny": dict(hidden_size=32, moe=dict(ffn_hidden_size=16), ffn_hidden_size=32, mlp_only_layers=(1,)),
    "olmoe_tiny": dict(hidden_size=32, moe=dict(ffn_hidden_size=16)),
    "deepseek_v3_tiny": dict(hidden_size=32, moe=dict(ffn_hidden_size=16, shared_expert_ffn_hidden_size=16)),
}
# Dropping cases route in fp64 (fewer near-ties at a capacity boundary) and are compared element by
# element: every parameter but the experts' within the dropless tolerance, the experts' with the bound of
# :func:`_check_dropping_experts`; losses and gradient norms are compared tightly in every case.
DROP = dict(capacity_factor=1.0, router_dtype="fp64")
# Overlap merges a forward with a backward only in a schedule's steady state. Cases whose ranks would
# hold one micro-batch (DP4 without PP; PP2 with DP4) or as many as VPP2's stages (warm-up covers them
# all) take a global batch of 16 sequences, so that with ``parallel.overlap_moe_comm`` every case runs
# merged pairs (the counts per rank are asserted: :func:`_expected_pairs`). With PP the warm-up that
# overlap lengthens leaves the first stages of PP2 (2 micro-batches) and PP4 unpaired: there the
# case tests the deferral of the shared expert and of ``parallel.delay_wgrad``'s weight gradients.
PAIRED = dict(global_batch_size=16)
# (model, parallel, train overrides, optim.distributed, moe overrides)
CASES = [
    ("mixtral_tiny", dict(pp=2, tp=2, ep=2, etp=1), dict(), True, {}),  # PP2, TP2+SP, EDP2
    ("mixtral_tiny", dict(pp=4, ep=2, etp=1), dict(recompute="full"), False, {}),  # PP4, EP over DP
    ("mixtral_tiny", dict(pp=2, vpp=2, tp=2, ep=4, etp=1), dict(recompute="selective", **PAIRED), True, {}),  # VPP2
    ("mixtral_tiny", dict(pp=2, cp=2, tp=2, ep=4, etp=1), dict(recompute="moe"), False, {}),  # CP2, EP over TP×CP
    ("mixtral_tiny", dict(tp=2, cp=2, ep=8, etp=1), dict(), True, {}),  # EP8 over TP×CP×DP
    ("mixtral_tiny", dict(tp=2, ep=2, etp=2), dict(PAIRED), False, {}),  # ETP2, EDP2 != DP·CP
    ("mixtral_tiny", dict(pp=2, ep=4, etp=1), dict(PAIRED), True, DROP),  # dropping, TP=CP=1
    ("qwen2_moe_tiny", dict(pp=2, tp=2, ep=2, etp=2), dict(recompute="full"), True, {}),
    ("qwen2_moe_tiny", dict(pp=2, vpp=2, cp=2, ep=2, etp=1), dict(recompute="moe", **PAIRED), True, {}),
    ("qwen2_moe_tiny", dict(pp=4, vpp=1, ep=2, etp=1), dict(), False, DROP),  # PP4, dropping, TP=CP=1
    # per-head q/k norm: replicated weights whose gradients are summed over TP. Dropping and VPP do
    # not depend on the attention block: the Mixtral and Qwen2-MoE cases cover them for every family
    ("qwen3_moe_tiny", dict(pp=2, tp=2, ep=2, etp=2), dict(recompute="selective"), True, {}),  # PP2, TP2+SP, ETP2
    ("qwen3_moe_tiny", dict(tp=2, cp=2, ep=8, etp=1), dict(), False, {}),  # CP2, EP8 over TP×CP×DP
    # q/k norm over the whole projection: TP-sharded weights, sum of squares all-reduced over TP
    ("olmoe_tiny", dict(pp=2, tp=2, ep=2, etp=2), dict(recompute="full"), True, {}),  # PP2, TP2+SP, ETP2
    ("olmoe_tiny", dict(tp=4, ep=2, etp=1), dict(), False, {}),  # TP4+SP, EDP4
    ("olmoe_tiny", dict(pp=2, cp=2, tp=2, ep=4, etp=1), dict(recompute="selective"), True, {}),  # CP2 with TP2
    # EP = ETP = 1 (each rank a one-rank expert domain): no exchange follows an expert backward, so with
    # overlap (and delay_wgrad: an odd position) only the end-of-backward flush delivers the deferred work
    ("mixtral_tiny", dict(tp=2, ep=1, etp=1), dict(PAIRED), False, {}),
]
# DeepSeek-V3: MLA (latent down-projections replicated over TP, compressed KV gathered over CP), YaRN,
# sigmoid group-limited routing with the expert bias updated every step, seq_aux_loss, dense layer 0,
# a multi-token-prediction module on the last stage (its own embedding copy when PP > 1)
DEEPSEEK_CASES = [
    ("deepseek_v3_tiny", dict(pp=2, tp=2, ep=2, etp=1), dict(), True, {}),  # PP2, TP2+SP
    # CP2, VPP2: the MTP module in the last virtual stage
    ("deepseek_v3_tiny", dict(pp=2, vpp=2, cp=2, tp=2, ep=4, etp=1), dict(recompute="selective"), False, {}),
    ("deepseek_v3_tiny", dict(tp=2, ep=2, etp=2), dict(PAIRED), True, {}),  # EP2 x ETP2
    # stages of 1 + 3 layers: the dense layer 0 alone on the first, parallel.first_stage_layers and
    # last_stage_layers both set (the split the planner proposes for lighter first and last stages)
    ("deepseek_v3_tiny", dict(pp=2, first_stage_layers=1, last_stage_layers=3, ep=4, etp=1), dict(PAIRED), False, {}),
    # uneven virtual stages from a pipeline layout (parallel.pipeline_layout, Megatron-Core's syntax; VPP2 implied):
    # rank 0 holds the embedding and layer 0, then layers 1-3; rank 1 an empty stage (the hidden states pass
    # through) and a last stage with no transformer layer, only the MTP module and the loss
    ("deepseek_v3_tiny", dict(pp=2, tp=2, ep=4, etp=1, pipeline_layout="Et||ttt|mL"), dict(PAIRED), True, {}),
]
# (model, parallel, train overrides): Qwen2-MoE's DP4 takes a batch of 16, so that it pairs with overlap
BF16_CASES = [("mixtral_tiny", dict(pp=2, tp=2, ep=2, etp=1), {}), ("qwen2_moe_tiny", dict(tp=2, ep=4, etp=1), PAIRED)]


# Dropout (Megatron-LM's names and placement) and a padded vocabulary, for the second half of the matrix: a case
# whose model name ends in "+dropout" trains with them, its 1-rank reference too. The two rates differ so that
# the counts of dropped elements tell the two dropouts apart (:func:`_check_dropout_active`)
DROPOUT = dict(hidden_dropout=0.1, attention_dropout=0.2, make_vocab_size_divisible_by=384)


def _with_dropout(case):
    """``case`` with dropout and the padded vocabulary of :data:`DROPOUT` (its model name marked)."""
    return (f"{case[0]}+dropout", *case[1:])


def _preset(model_name):
    """The preset a case's model name (``NAME`` or ``NAME+dropout``) trains."""
    return model_name.split("+")[0]


def _job(model_name, parallel, train, distributed, moe, steps=STEPS, optim=()):
    name = _preset(model_name)
    sizes = MODELS[name]
    extra = DROPOUT if model_name.endswith("+dropout") else {}
    model = get_preset(name, **{**sizes, **extra, "moe": {**sizes["moe"], **moe}})
    return JobConfig(
        model=model,
        parallel=ParallelConfig(**parallel),
        train=TrainConfig(
            **{
                **dict(steps=steps, global_batch_size=8, micro_batch_size=2, seq_length=16, eval_interval=0, seed=7),
                **train,
            }
        ),
        optim=OptimConfig(
            lr=3e-3,
            min_lr=3e-4,
            warmup_steps=2,
            decay_style="cosine",
            clip_grad=1.0,
            weight_decay=0.01,
            eps=1e-6,
            distributed=distributed,
            **dict(optim),
        ),
        data=DataConfig(),
        logging=LoggingConfig(metrics_file="metrics.jsonl", console=False, wandb=WandbConfig(mode="disabled")),
    )


def _train(cases, run_dir, with_params=True, steps=STEPS, optim=()):
    """Train each case on this world; per case a dict of this rank's results: ``losses``, ``norms``,
    ``params`` (name -> (spec, local tensor): the fp32 master weights of a bf16 run, else the
    parameters), ``tables`` (replica slot tables by layer), ``pairs`` / ``hand_overs`` (merged
    forward-backward pairs and lane switches over the run), ``pp_rank``, ``dp`` and, when ``optim`` is
    set, ``state`` (the optimizer's state keys and dtypes, as strings, over every parameter)."""
    from folding.training import trainer

    out = []
    for args in cases:
        job = _job(*args, steps=steps, optim=optim)
        # as the trainer builds it: with overlap, every concurrent role on a communicator of its own
        ps = build_parallel_state(job.layout(dist.get_world_size()), own_communicators=job.parallel.overlap_moe_comm)
        bf16 = job.train.precision == "bf16"
        try:
            with _counting_recompute() as recomputed, _counting_dropout() as dropped:
                res = trainer.train(job, run_dir=run_dir, parallel_state=ps)
            # the replica slot tables the run ended with (moe.expert_replicas), by layer
            tables = {
                m.layer_number: m.replica_table
                for chunk in res["chunks"]
                for m in chunk.modules()
                if getattr(m, "num_replicas", 0)
            }
            # a collective under ZeRO-1: only where masters or the optimizer's own state are compared
            state = res["optimizer"].param_state() if (with_params and bf16) or optim else {}
            params = {}
            if with_params:
                for c, chunk in enumerate(res["chunks"]):
                    for name, p in chunk.named_parameters():
                        # the optimizer names a parameter by its model chunk and its name there; a
                        # parameter kept in fp32 (bf16 runs keep some) is its own master
                        master = state.get(f"{c}.{name}", {}).get("master") if bf16 else None
                        value = master if master is not None else p.detach().clone()
                        params[name] = (require_spec(p, name), value)
            kinds = sorted({(k, str(t.dtype)) for entry in state.values() for k, t in entry.items()})
            hist = res["history"]
            out.append(
                dict(
                    losses=[h["lm_loss"] for h in hist],
                    norms=[h["grad_norm"] for h in hist],
                    params=params,
                    tables=tables,
                    pairs=sum(h["overlap_pairs"] for h in hist),
                    hand_overs=sum(h["overlap_hand_overs"] for h in hist),
                    pp_rank=ps.coords.pp.rank,
                    vpp=ps.layout.virtual_stages,
                    dp=ps.layout.dp,
                    state=kinds if optim else None,
                    recomputed=dict(recomputed),
                    dropped={p: list(c) for p, c in dropped.items()},
                )
            )
        finally:
            ps.destroy()
    return out


@contextlib.contextmanager
def _counting_recompute():
    """Count, by the module that asks, the checkpointed regions run, the discarded tensors refilled in
    backward and the storages offloaded to host memory and copied back during the block (wrapping the
    functions the engine's modules call; the counts are of what ran, not of what was configured):
    ``{"block": n, "core": n, "shared": n, "refills": n, "offloaded": n, "reloaded": n}``."""
    from folding.memory.offload import Offloader
    from folding.model import block, context_parallel, mla
    from folding.moe import layer
    from folding.moe.experts import grouped

    counts = collections.Counter()
    saved = []

    def counting_method(name, what):
        real = getattr(Offloader, name)

        def wrapped(self, *args):
            counts[what] += 1
            return real(self, *args)

        saved.append((Offloader, name, real))
        setattr(Offloader, name, wrapped)

    counting_method("_copy_out", "offloaded")
    counting_method("_copy_in", "reloaded")

    def counting_checkpoint(module, what):
        real = module.checkpoint

        def wrapped(fn, *args, **kwargs):
            counts[what] += 1
            return real(fn, *args, **kwargs)

        saved.append((module, "checkpoint", real))
        module.checkpoint = wrapped

    def counting_discard(module):
        real = module.discard_until_backward

        def wrapped(tensors, *, after, refill):
            def counted():
                counts["refills"] += 1
                return refill()

            return real(tensors, after=after, refill=counted)

        saved.append((module, "discard_until_backward", real))
        module.discard_until_backward = wrapped

    for module, what in ((block, "block"), (context_parallel, "core"), (layer, "shared")):
        counting_checkpoint(module, what)
    for module in (block, mla, grouped):
        counting_discard(module)
    try:
        yield counts
    finally:
        for module, name, real in saved:
            setattr(module, name, real)


@contextlib.contextmanager
def _counting_dropout():
    """Count, by rate, the elements the engine's dropout masks saw and dropped during the block (wrapping
    the one function every dropout applies its mask with): ``{rate: [dropped, total]}``."""
    from folding.model import dropout

    counts: dict = {}
    real = dropout._apply

    def wrapped(x, keep, p):
        c = counts.setdefault(p, [0, 0])
        c[0] += int((~keep).sum())
        c[1] += keep.numel()
        return real(x, keep, p)

    dropout._apply = wrapped
    try:
        yield counts
    finally:
        dropout._apply = real


def _check_dropout_active(case, runs):
    """Inside each run of a ``+dropout`` case both dropouts acted, each dropping its rate of the elements
    it masked (within 0.01: each rank masks tens of thousands of elements a run); in other runs none did."""
    for run in runs:
        if not case[0].endswith("+dropout"):
            assert not run["dropped"], (case, run["dropped"])
            continue
        rates = {DROPOUT["hidden_dropout"], DROPOUT["attention_dropout"]}
        assert set(run["dropped"]) == rates, (case, run["pp_rank"], run["dropped"])
        for p, (dropped, total) in run["dropped"].items():
            assert total >= 10_000 and abs(dropped / total - p) <= 0.01, (case, run["pp_rank"], p, dropped, total)


def _check_layout_applied(case, runs):
    """Each rank of a ``parallel.pipeline_layout`` case holds the decoder layers of its virtual stages (rank
    ``r``: stages ``r, r + pp, ...`` of the layout), and the MTP modules sit on the last pipeline rank only."""
    from folding.parallel.partition import partition_layers

    parallel = case[1]
    cfg = _job(*case).model
    pp = parallel["pp"]
    ranges = partition_layers(
        num_layers=cfg.num_layers, pp=pp, pipeline_layout=parallel["pipeline_layout"], mtp_num_layers=cfg.mtp_num_layers
    )
    for run in runs:
        held = {int(n.split(".")[1]) for n in run["params"] if n.startswith("layers.")}
        want = {i for s, e in ranges[run["pp_rank"] :: pp] for i in range(s, e)}
        assert held == want, (case, run["pp_rank"], held, want)
        has_mtp = any(n.startswith("mtp.") for n in run["params"])
        assert has_mtp == (run["pp_rank"] == pp - 1 and cfg.mtp_num_layers > 0), (case, run["pp_rank"])


def _full(entries):
    """Assemble full tensors from (spec, local) pieces of every rank; check replicas agree."""
    full = {}
    for name, (spec, local) in entries:
        t = full.setdefault(name, torch.full(spec.full_shape, float("nan"), dtype=local.dtype))
        view = take_slice(t, spec.shards)
        done = ~torch.isnan(view)
        assert torch.equal(view[done], local.reshape(view.shape)[done]), name  # replicas are identical
        view.copy_(local.reshape(view.shape))
    return full


def _expected_pairs(case, run):
    """Merged pairs a rank of ``case`` runs per step with overlap: the steady state of its schedule
    (the pure program of :func:`folding.pipeline.comm_plan.rank_program`), from the layout alone."""
    from folding.pipeline.comm_plan import Pair, rank_program

    _, parallel, train, _, _ = case
    gbs = train.get("global_batch_size", 8)
    program = rank_program(
        num_microbatches=gbs // (2 * run["dp"]),
        pp=parallel.get("pp", 1),
        vpp=run["vpp"],  # parallel.vpp, or what parallel.pipeline_layout implies
        pp_rank=run["pp_rank"],
        forward_only=False,
        overlap=True,
    )
    return sum(isinstance(a, Pair) for a in program)


_NO_OVERLAP: dict = {}  # case -> its 8-rank results without overlap (the overlap runs' bitwise reference)
_ONE_RANK: dict = {}  # (model, moe overrides, optim, batch, precision) -> the 1-rank reference run (once per session)


def _key(case):
    return repr(case)


def _ref_key(model_name, train, moe, optim):
    """The 1-rank reference a case compares with: the same model, MoE options, optimizer, global batch
    and precision (the layout and schedule settings are what the case varies)."""
    return (
        model_name,
        tuple(sorted(moe.items())),
        optim,
        train.get("global_batch_size", 8),
        train.get("precision", "fp32"),
    )


def _references(ranks, tmp_path, keys):
    """Compute the 1-rank references not computed yet this session (one call for all)."""
    todo = sorted(set(keys) - set(_ONE_RANK), key=repr)
    by_optim: dict = {}
    for key in todo:
        by_optim.setdefault(key[2], []).append(key)
    for optim, group in by_optim.items():
        cases = [
            (m, {}, {"global_batch_size": gbs, "precision": prec}, False, dict(moe)) for m, moe, _, gbs, prec in group
        ]
        runs = ranks(1).run(_train, cases, str(tmp_path), True, STEPS, optim)[0]
        for key, run in zip(group, runs):
            run["params"] = {n: t.reshape(s.full_shape) for n, (s, t) in run["params"].items()}
            _ONE_RANK[key] = run


def _check_option_active(case, runs, *, overlap, optim, replicas):
    """Inside each run, the option under test was in effect (not merely accepted): the pairs the
    schedule should merge ran on every rank (none without overlap) and hid exchanges; replicas were in
    use; the optimizer kept the state of the chosen moments' dtype or of Muon; dropout acted in a
    ``+dropout`` case's runs and nowhere else (:func:`_check_dropout_active`)."""
    _check_dropout_active(case, runs)
    for run in runs:
        want = _expected_pairs(case, run) * STEPS if overlap else 0
        assert run["pairs"] == want, (case, run["pp_rank"], run["pairs"], want)
        exchanges = case[1].get("ep", 1) * case[1].get("etp", 1) > 1  # EP = ETP = 1: none to hand over at
        assert (run["hand_overs"] > 0) == (want > 0 and exchanges), (case, run["hand_overs"], want)
    if overlap:
        assert sum(run["pairs"] for run in runs) > 0, case  # some rank of the case did pair
    if replicas:  # not vacuous: some layer ended with a replicated expert on some rank
        assert any(e >= 0 for run in runs for t in run["tables"].values() for e in t), case
    opt = dict(optim)
    for run in runs:
        dtypes = {}  # state key -> the dtypes it has over this rank's parameters
        for key, dtype in run["state"] or []:
            dtypes.setdefault(key, set()).add(dtype)
        if opt.get("name") == "muon":  # Muon's momentum beside AdamW's moments of the other parameters
            assert "momentum" in dtypes and "exp_avg" in dtypes, (case, run["state"])
        if "exp_avg_dtype" in opt:
            want = {"bf16": "torch.bfloat16", "fp32": "torch.float32"}[opt["exp_avg_dtype"]]
            assert dtypes.get("exp_avg") == dtypes.get("exp_avg_sq") == {want}, (case, run["state"])


# bf16 layouts against the one-rank bf16 run of the same batches. Measured (Mixtral PP2 TP2 EP2; Qwen2-MoE
# TP2 EP4 at a batch of 8 and of 16; over 6 steps, the runs' length before it was cut to 4): losses within
# 6.6e-5 relative, gradient norms within 6.1e-3, fp32 master weights within a mean absolute difference of
# 2.5e-4 per tensor. An element's difference alone says little: where a gradient is near zero, bf16 noise
# flips the sign of Adam's normalized update, so single elements differ by up to a few updates (1.1e-2
# measured; at most STEPS * lr). The tolerances leave 4x the measured noise; defects are larger: every
# expert gradient zeroed moves the loss by ~5e-4, the gradient norm by far more than 2e-2, and the expert
# masters by whole updates on most elements.
BF16_LOSS_RTOL = 2.5e-4
BF16_NORM_RTOL = 2.5e-2
BF16_PARAM_MEAN_ATOL = 1e-3


def _check_dropping_experts(case, name, got, want, atol):
    """A dropping case's expert weights, element by element. Dropping decides at each expert's capacity
    boundary by comparing probabilities; after step 1 the layouts' weights differ by reduction-order
    noise, so two tokens whose fp64 probabilities are that close can swap at the boundary and move the
    elements of the expert that kept one of them (measured, Mixtral PP2 EP4 at a batch of 16: 126 of
    8192 fc1 and 88 of 4096 fc2 elements of one layer, by at most 1.0e-4). Bounded: fewer elements out
    of the dropless tolerance than half of one expert holds (an expert-wide defect, such as one
    expert's gradient doubled, moves most of its elements), and none by more than one Adam update per
    step (STEPS * lr). Every other parameter of a dropping case is compared like a dropless one."""
    experts = _job(_preset(case[0]), {}, {}, False, {}).model.moe.num_experts
    err = (got - want).abs()
    out = int((err > atol + 1e-4 * want.abs()).sum())
    assert out <= got.numel() // (2 * experts), (case, name, out, got.numel() // (2 * experts))
    assert float(err.max()) <= STEPS * 3e-3, (case, name, float(err.max()))


def _check_cases(ranks, tmp_path, cases, bf16_cases=(), overlap=False, optim=(), replicas=0, variants=None):
    """Train ``cases`` on 8 ranks and their 1-rank references; compare losses, grad norms, parameters
    and the golden curves of the models they train, and check inside each run that the option under
    test was active (:func:`_check_option_active`). ``bf16_cases`` ``(model, parallel, train)`` train in
    bf16 on 8 ranks and are compared with the one-rank bf16 run (losses, gradient norms, fp32 master
    weights). With ``overlap`` every case runs with ``parallel.overlap_moe_comm=true`` and must also
    equal its run without overlap bit for bit. ``optim``: ``optim.*`` overrides (``(key, value)``
    pairs) of every run, the 1-rank references' too. ``replicas``: the 8-rank runs use
    ``moe.expert_replicas`` slots re-planned every 2 steps (the 1-rank references have none) and must
    have replicated some expert by their end. ``variants``: one ``(parallel overrides, train overrides)`` per
    case, the memory options under test (recompute modules, with or without overlap): each case runs with
    its variant, must equal its run without it bit for bit, and must have run the recompute it names
    (:func:`_check_memory_active`)."""
    optim = tuple(sorted(dict(optim).items()))
    bf16 = [(m, par, dict(precision="bf16", **train), False, {}) for m, par, train in bf16_cases]
    _references(ranks, tmp_path, [_ref_key(m, tr, moe, optim) for m, _, tr, _, moe in [*cases, *bf16]])
    # one call per case, each well inside the pool's timeout on a slow machine
    results = []
    extra = dict(expert_replicas=replicas, replica_interval=2) if replicas else {}
    for i, case in enumerate(cases):
        case = (*case[:4], {**case[4], **extra})
        if variants is not None:
            results.append(_bitwise_variant(ranks, tmp_path, case, variants[i], optim))
            continue
        if not overlap:
            results.append([r[0] for r in ranks(8).run(_train, [case], str(tmp_path), True, STEPS, optim)])
            _NO_OVERLAP[_key(case) + repr(optim)] = results[-1]
            continue
        model_name, parallel, train, distributed, moe = case
        # every other case also delays the experts' weight gradients (parallel.delay_wgrad), with
        # replicas too (the second replicas_overlap case: the replicas' gradients reach the deferred work)
        knobs = {"overlap_moe_comm": True, "delay_wgrad": len(results) % 2 == 1}
        on = ranks(8).run(
            _train, [(model_name, {**parallel, **knobs}, train, distributed, moe)], str(tmp_path), True, STEPS, optim
        )
        on = [r[0] for r in on]
        off = _NO_OVERLAP.get(_key(case) + repr(optim)) or [
            r[0] for r in ranks(8).run(_train, [case], str(tmp_path), True, STEPS, optim)
        ]
        for r in range(8):  # bitwise: overlap changes when work runs, never what it computes
            a, b = on[r], off[r]
            assert a["losses"] == b["losses"] and a["norms"] == b["norms"], (case, r, a["losses"], b["losses"])
            assert sorted(a["params"]) == sorted(b["params"]), case
            for name in a["params"]:
                assert torch.equal(a["params"][name][1], b["params"][name][1]), (case, r, name)
        _check_option_active(case, off, overlap=False, optim=optim, replicas=0)
        results.append(on)
    # 16-bit moments: where two layouts' fp32 moments (equal up to reduction-order noise) straddle a
    # rounding boundary they round one gap apart (bf16: 2^-7 relative), moving that element's update by
    # up to lr * 2^-7 = 2.3e-5 per step (lr 3e-3), at most STEPS times
    atol = 1e-5 if all(v == "fp32" for k, v in optim if k.endswith("_dtype")) else STEPS * 3e-3 * 2**-7
    for i, (model_name, parallel, train, distributed, moe) in enumerate(cases):
        ref = _ONE_RANK[_ref_key(model_name, train, moe, optim)]
        if variants is not None:
            on = variants[i][0].get("overlap_moe_comm", False)
            _check_option_active(_with(cases[i], variants[i]), results[i], overlap=on, optim=optim, replicas=replicas)
        else:
            _check_option_active(cases[i], results[i], overlap=overlap, optim=optim, replicas=replicas)
        for r in range(8):
            losses, norms = results[i][r]["losses"], results[i][r]["norms"]
            assert len(losses) == STEPS
            for step, (a, b) in enumerate(zip(losses, ref["losses"])):
                assert abs(a - b) <= 1e-5 * abs(b), (cases[i], step + 1, a, b)
            # fp32 reduction-order noise in the gradient norm reaches 1.2e-4 relative (PP2 EP4 dropping,
            # step 5 of 10; 8e-7 again by step 9) while the losses agree to 3e-6; a wrong reduction or
            # scale is off by O(1)
            for a, b in zip(norms, ref["norms"]):
                assert abs(a - b) <= 3e-4 * abs(b), (cases[i], a, b)
        if "first_stage_layers" in parallel:  # the split is applied: rank 0 (first stage) holds those layers
            held = {int(n.split(".")[1]) for n in results[i][0]["params"] if n.startswith("layers.")}
            assert held == set(range(parallel["first_stage_layers"])), (cases[i], held)
        if "pipeline_layout" in parallel:  # the layout is applied: each rank holds its virtual stages' layers
            _check_layout_applied(cases[i], results[i])
        full = _full([(n, e) for r in range(8) for n, e in results[i][r]["params"].items()])
        assert sorted(full) == sorted(ref["params"]), cases[i]
        for name, t in full.items():
            assert not torch.isnan(t).any(), (cases[i], name)  # every element held by some rank
            if moe.get("capacity_factor") is None or ".experts." not in name:
                torch.testing.assert_close(t, ref["params"][name], rtol=1e-4, atol=atol, msg=f"{cases[i]} {name}")
            else:
                _check_dropping_experts(cases[i], name, t, ref["params"][name], atol)
    for case in bf16:
        model_name, parallel = case[0], case[1]
        if overlap:
            parallel = {**parallel, "overlap_moe_comm": True}
        runs = [
            r[0] for r in ranks(8).run(_train, [(*case[:1], parallel, *case[2:])], str(tmp_path), True, STEPS, optim)
        ]
        ref = _ONE_RANK[_ref_key(model_name, case[2], {}, optim)]
        _check_option_active((model_name, parallel, case[2], False, {}), runs, overlap=overlap, optim=optim, replicas=0)
        for run in runs:
            for step, (a, b) in enumerate(zip(run["losses"], ref["losses"])):
                assert abs(a - b) <= BF16_LOSS_RTOL * abs(b), (model_name, parallel, step + 1, a, b)
            for a, b in zip(run["norms"], ref["norms"]):
                assert abs(a - b) <= BF16_NORM_RTOL * abs(b), (model_name, parallel, a, b)
        full = _full([(n, e) for r in range(8) for n, e in runs[r]["params"].items()])
        assert sorted(full) == sorted(ref["params"]), model_name
        for name, t in full.items():
            err = (t - ref["params"][name]).abs()
            assert float(err.mean()) <= BF16_PARAM_MEAN_ATOL, (model_name, parallel, name, float(err.mean()))
            assert float(err.max()) <= STEPS * 3e-3, (model_name, parallel, name, float(err.max()))
    if overlap or optim or replicas or variants:  # the golden curves: one rank's fp32 ones, checked once
        return
    # golden losses: the 1-rank curves of this file's configuration, over GOLDEN_STEPS steps
    golden = json.load(open(GOLDEN))
    names = sorted({_preset(m) for m, *_ in cases})  # the golden curves are those without dropout
    curves = ranks(1).run(_train, [(m, {}, {}, False, {}) for m in names], str(tmp_path), False, GOLDEN_STEPS)[0]
    for model_name, run in zip(names, curves):
        got, want = run["losses"], golden[model_name]
        assert len(got) == len(want) == GOLDEN_STEPS, (model_name, len(got), len(want))
        assert all(abs(a - b) <= 1e-4 * abs(b) for a, b in zip(got, want)), (model_name, got)
        # the curve moves by far more than the tolerance, so a run that did not learn (a dead
        # optimizer, a zero learning rate) could not match it
        assert want[0] - want[-1] > 100 * 1e-4 * want[0], (model_name, want)


def _with(case, variant):
    """``case`` with a variant's ``(parallel, train)`` overrides applied."""
    model_name, parallel, train, distributed, moe = case
    return (model_name, {**parallel, **variant[0]}, {**train, **variant[1]}, distributed, moe)


def _bitwise_variant(ranks, tmp_path, case, variant, optim):
    """Run ``case`` with ``variant`` on 8 ranks; check it equals the case's plain run (this session's, or a
    fresh one) bit for bit in losses, gradient norms and parameters, and that the recompute it names ran."""
    runs = [r[0] for r in ranks(8).run(_train, [_with(case, variant)], str(tmp_path), True, STEPS, optim)]
    plain = _NO_OVERLAP.get(_key(case) + repr(optim)) or [
        r[0] for r in ranks(8).run(_train, [case], str(tmp_path), True, STEPS, optim)
    ]
    for r in range(8):  # bitwise: recompute changes what is kept and when work runs, never what it computes
        a, b = runs[r], plain[r]
        assert a["losses"] == b["losses"] and a["norms"] == b["norms"], (case, variant, r, a["losses"], b["losses"])
        assert sorted(a["params"]) == sorted(b["params"]), case
        for name in a["params"]:
            assert torch.equal(a["params"][name][1], b["params"][name][1]), (case, variant, r, name)
    _check_memory_active(case, variant, runs, plain)
    return runs


def _check_memory_active(case, variant, runs, plain):
    """Inside the runs the recompute and offload modules of ``variant`` ran (counted by
    :func:`_counting_recompute`): a discarding module (``layernorm``, ``moe_act``, ``mla_up_proj``) refilled
    tensors in backward; the attention core, the shared expert and the MLP block ran under checkpoints where
    their module names them; the offload modules copied storages out, and every one came back; the plain run
    did none of it."""
    modules = set(variant[1].get("recompute_modules", ()))
    offload = bool(variant[1].get("offload_modules"))
    total = collections.Counter()
    for run in runs:
        total.update(run["recomputed"])
    assert all(not run["recomputed"] for run in plain), (case, [run["recomputed"] for run in plain])
    want = {
        "refills": bool(modules & {"layernorm", "moe_act", "mla_up_proj"}),
        "core": "core_attn" in modules,
        "shared": "shared_experts" in modules and "moe" not in modules,
        "block": bool(modules & {"mlp", "moe"}),
        "offloaded": offload,
        "reloaded": offload,
    }
    assert {k: total[k] > 0 for k in want} == want, (case, variant, dict(total))
    assert total["reloaded"] >= total["offloaded"], (case, variant, dict(total))  # none left in host memory


# hot-expert replicas (moe.expert_replicas=1, re-planned every 2 steps): EP8 dropless over TP2 CP2 DP2
# with ZeRO-1, EP4 dropping with PP2, and Qwen2-MoE's shared expert with PP2 TP2 EP2 ETP2 (EP2×ETP2)
# and full recompute, whose recomputed forwards use the step's fetched replicas
REPLICA_CASES = [CASES[4], CASES[6], CASES[7]]
# replicas with parallel.overlap_moe_comm: layouts with several micro-batches per rank, so that merged
# forward-backward pairs do run (on every rank: TP2 CP2 EP8; on the last stage: Qwen2-MoE's PP2 case),
# and with parallel.delay_wgrad: the replicas' weight gradients arrive in deferred work, on the first
# stage from the end-of-backward flush, on the last inside merged pairs' exchange waits. Their runs
# without overlap are the `replicas` parameter's of the same session (one worker: tests/conftest.py)
REPLICA_OVERLAP_CASES = [CASES[4], CASES[7]]

# the hierarchical dispatcher, dropless with the 8 ranks as 2 nodes of 4 (parallel.nvlink_domain=4): EP8
# over TP2×DP4 and EP4×ETP2 with TP2 (a batch of 16: two micro-batches per rank), both also with overlap on
# (the second with delay_wgrad), bitwise
# equal to off. Dropping needs TP=CP=1 (capacity is decided from local tokens) and so PP2 at this batch
# size, whose stages of 4 ranks are split as 2 nodes of 2: EP4, and EP2×ETP2
HIER = dict(dispatcher="hierarchical")
HIER_CASES = [
    ("mixtral_tiny", dict(tp=2, ep=8, etp=1, nvlink_domain=4), dict(PAIRED), True, HIER),
    ("mixtral_tiny", dict(tp=2, ep=4, etp=2, nvlink_domain=4), dict(PAIRED), False, HIER),
    ("mixtral_tiny", dict(pp=2, ep=4, etp=1, nvlink_domain=2), dict(), True, {**HIER, **DROP}),
    ("mixtral_tiny", dict(pp=2, ep=2, etp=2, nvlink_domain=2), dict(), False, {**HIER, **DROP}),
]


# Megatron-Core's recompute and offload modules, every one in some case, with pipeline parallelism and with
# overlap, each bitwise equal to the case's run without them (the plain runs are those of the same half's
# overlap_off test, on the same worker): Mixtral PP2 TP2 EP2 recomputing core_attn, layernorm and moe_act and
# offloading attn_norm, mlp_norm and expert_fc1; Qwen2-MoE PP4 (dropping; a dense layer, a shared expert)
# recomputing shared_experts, mlp and layernorm and offloading core_attn, attn_proj and moe_act; Qwen3-MoE TP2
# CP2 EP8 with overlap on, recomputing core_attn and moe_act and offloading qkv_linear, attn_norm and
# expert_fc1; DeepSeek-V3 (MLA, dense layer 0) PP2 recomputing mla_up_proj, mlp and moe and offloading
# qkv_linear, attn_norm and attn_proj. The Qwen2-MoE and Qwen3-MoE variants train with dropout (the second
# half's cases): the recomputed attention core, norms, MLP and shared expert drop the elements they dropped
# in forward.
MEMORY_VARIANTS = {
    "a": [
        (
            CASES[0],
            (
                {},
                dict(
                    recompute_modules=["core_attn", "layernorm", "moe_act"],
                    offload_modules=["attn_norm", "mlp_norm", "expert_fc1"],
                ),
            ),
        )
    ],
    "b": [
        (
            _with_dropout(CASES[9]),
            (
                {},
                dict(
                    recompute_modules=["shared_experts", "mlp", "layernorm"],
                    offload_modules=["core_attn", "attn_proj", "moe_act"],
                ),
            ),
        ),
        (
            _with_dropout(CASES[11]),
            (
                dict(overlap_moe_comm=True),
                dict(
                    recompute_modules=["core_attn", "moe_act"],
                    offload_modules=["qkv_linear", "attn_norm", "expert_fc1"],
                ),
            ),
        ),
    ],
    "deepseek": [
        (
            DEEPSEEK_CASES[0],
            (
                {},
                dict(
                    recompute_modules=["mla_up_proj", "mlp", "moe"],
                    offload_modules=["qkv_linear", "attn_norm", "attn_proj"],
                ),
            ),
        )
    ],
}

# The fp32 matrix runs as two halves, each one test per overlap setting: a half's overlap_on compares
# bitwise with its overlap_off runs of the same session (tests/conftest.py keeps a half on one worker),
# and the two halves run side by side on the two workers. The bf16 layouts run with the second half;
# each half checks the golden curves of the models it trains (the second half's are all four). The second
# half trains with dropout and a padded vocabulary (:data:`DROPOUT`), its 1-rank references too: TP2 and TP4,
# CP2 (with TP2, and with PP2 VPP2), PP2 and PP4, VPP2, EP1 to EP8, ETP2, dropping, full, selective and MoE
# recompute, and with overlap on, merged pairs with and without delay_wgrad.
MATRIX = {"a": CASES[:8], "b": [_with_dropout(case) for case in CASES[8:]]}


@pytest.mark.parametrize(
    "overlap,moments,replicas,half",
    [
        (False, "fp32", 0, "a"),
        (False, "fp32", 0, "b"),
        (True, "fp32", 0, "a"),
        (True, "fp32", 0, "b"),
        (False, "bf16", 0, None),
        (False, "muon", 0, None),
        (False, "fp32", 1, None),
        (True, "fp32", 1, None),
        (True, "hierarchical", 0, None),
        (False, "memory", 0, "a"),
        (False, "memory", 0, "b"),
    ],
    ids=[
        "overlap_off_a",
        "overlap_off_b",
        "overlap_on_a",
        "overlap_on_b",
        "bf16_moments",
        "muon",
        "replicas",
        "replicas_overlap",
        "hierarchical",
        "memory_a",
        "memory_b",
    ],
)
def test_layouts_train_like_one_rank(ranks, tmp_path, overlap, moments, replicas, half):
    if replicas:  # with overlap: also bitwise the run with replicas and without overlap
        cases = REPLICA_OVERLAP_CASES if overlap else REPLICA_CASES
        _check_cases(ranks, tmp_path, cases, overlap=overlap, replicas=replicas)
    elif moments == "memory":  # recompute modules: like one rank, and bitwise the same case without them
        cases, variants = zip(*MEMORY_VARIANTS[half])
        _check_cases(ranks, tmp_path, list(cases), variants=list(variants))
    elif moments == "hierarchical":  # every case like one rank, then two with overlap (bitwise as off)
        _check_cases(ranks, tmp_path, HIER_CASES)
        _check_cases(ranks, tmp_path, HIER_CASES[:2], overlap=True)
    elif moments == "fp32":
        _check_cases(ranks, tmp_path, MATRIX[half], BF16_CASES if half == "b" else (), overlap=overlap)
    elif moments == "muon":  # ZeRO-1 PP2 TP2; VPP2 TP2 EP4; ETP2 plain; Qwen2-MoE shared expert ETP2
        _check_cases(ranks, tmp_path, [CASES[0], CASES[2], CASES[5], CASES[7]], optim=(("name", "muon"),))
    else:  # two cases of the matrix (ZeRO-1 over DP with PP2 TP2; plain with ETP2, EDP2 != DP·CP)
        cases = [CASES[0], CASES[5]]
        _check_cases(ranks, tmp_path, cases, optim=(("exp_avg_dtype", moments), ("exp_avg_sq_dtype", moments)))


@pytest.mark.parametrize("overlap", [False, True, "memory"], ids=["overlap_off", "overlap_on", "memory"])
def test_deepseek_v3_layouts_train_like_one_rank(ranks, tmp_path, overlap):
    if overlap == "memory":  # MLA's and the dense layer's recompute modules, bitwise the plain run
        cases, variants = zip(*MEMORY_VARIANTS["deepseek"])
        _check_cases(ranks, tmp_path, list(cases), variants=list(variants))
        return
    _check_cases(ranks, tmp_path, DEEPSEEK_CASES, overlap=overlap)


def _train_with_ns_budget(budget, case, run_dir, optim):
    from folding.optim import muon

    saved = muon.NS_STACK_ELEMENTS
    muon.NS_STACK_ELEMENTS = budget if budget else saved
    try:
        return _train([case], run_dir, True, 3, optim)
    finally:
        muon.NS_STACK_ELEMENTS = saved


def test_muon_in_newton_schulz_chunks_trains_like_one_stack(ranks, tmp_path):
    """Muon orthogonalizes an owner's matrices of one parameter in stacks of at most
    ``NS_STACK_ELEMENTS`` elements; a budget of one expert matrix per call (16x32, so each of the
    8 experts' fc1/fc2 is its own Newton-Schulz call) gives the losses and parameters of one stack."""
    case = ("mixtral_tiny", {}, {}, False, {})
    optim = (("name", "muon"),)
    (one,), (many,) = (ranks(1).run(_train_with_ns_budget, b, case, str(tmp_path), optim)[0] for b in (16 * 32, None))
    for a, b in zip(one["losses"], many["losses"]):
        assert abs(a - b) <= 1e-6 * abs(b), (one["losses"], many["losses"])
    assert sorted(one["params"]) == sorted(many["params"])
    for name in many["params"]:
        torch.testing.assert_close(one["params"][name][1], many["params"][name][1], rtol=0, atol=1e-6, msg=name)
