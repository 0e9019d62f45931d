"""The table from Megatron-LM's command-line flags to this engine's Hydra keys.

One entry per Megatron-LM flag that has an equivalent here (names as in Megatron-LM's
``megatron/training/arguments.py``): a flag with a value that sets one key (:func:`value`), a switch
that sets one key to a fixed value (:func:`switch`), a flag that changes nothing here and is accepted
with a note saying why (:func:`noop`), or one that :mod:`folding.interop.megatron.args` converts
itself because it reads other flags too (:func:`special`: the virtual pipeline from layers per stage,
the FFN sizes, GQA, the data blend, the tokenizer, recompute, the LR schedule, checkpoints), or one
refused with its reason (:func:`refuse`). A flag that is not in :data:`FLAGS` has no equivalent and is
refused by name. The rule: a flag becomes a key, or is refused (exit 2), or is only a note when
ignoring it cannot change what the job computes. :data:`MEGATRON_DEFAULTS` are
Megatron-LM's defaults for keys whose default differs here, applied when the command relies on them.

Usage::

    FLAGS["--tensor-model-parallel-size"].key      # "parallel.tp"
    leaf_synonyms()["tensor_model_parallel_size"]  # "parallel.tp"
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, Optional, Tuple


@dataclasses.dataclass(frozen=True)
class Flag:
    """How one Megatron-LM flag maps onto this engine."""

    takes_value: bool
    """Whether the flag is followed by a value (or several: ``--data-path``)."""
    key: Optional[str] = None
    """The Hydra key it sets (``None``: none, or several for a special flag)."""
    convert: Optional[Callable[[str], Any]] = None
    """Turns the flag's value into the key's value (``int``, ``float``, ...); ``None`` for a switch."""
    fixed: Any = None
    """The value a switch sets ``key`` to."""
    choices: Tuple[str, ...] = ()
    """The Megatron-LM values that have an equivalent here (empty: any)."""
    note: str = ""
    """Said with the result: why a no-op changes nothing, or a difference worth knowing."""
    special: bool = False
    """Converted by :mod:`folding.interop.megatron.args` itself (it reads other flags too)."""
    refused: str = ""
    """Why the flag is refused by name although Megatron-LM users often give it: it changes what the
    job does and this engine has no setting for that (empty: not refused)."""


def value(key: str, convert: Callable[[str], Any] = str, choices: Tuple[str, ...] = (), note: str = "") -> Flag:
    """A flag with one value that sets ``key`` to ``convert(value)``."""
    return Flag(True, key, convert, choices=choices, note=note)


def switch(key: str, fixed: Any = True, note: str = "") -> Flag:
    """A flag without a value that sets ``key`` to ``fixed``."""
    return Flag(False, key, fixed=fixed, note=note)


def noop(note: str, takes_value: bool = False) -> Flag:
    """A flag accepted without any key: ``note`` says why nothing needs to change here."""
    return Flag(takes_value, note=note)


def refuse(reason: str, takes_value: bool = False) -> Flag:
    """A flag that changes the job in a way this engine has no setting for: refused, ``reason`` says
    why and what to do instead."""
    return Flag(takes_value, refused=reason)


def special(takes_value: bool = True) -> Flag:
    """A flag :mod:`folding.interop.megatron.args` converts from several flags at once."""
    return Flag(takes_value, special=True)


KERNEL = "a kernel choice; folding has one implementation of it"
LOGS = "folding logs every step to train.log, metrics.jsonl and W&B (offline unless logging.wandb.mode=online)"
ATTENTION = "attention is torch's scaled_dot_product_attention here"

FLAGS: Dict[str, Flag] = {
    # ------------------------------------------------------------------ parallel layout
    "--tensor-model-parallel-size": value("parallel.tp", int),
    "--pipeline-model-parallel-size": value("parallel.pp", int),
    "--context-parallel-size": value("parallel.cp", int),
    "--expert-model-parallel-size": value("parallel.ep", int),
    "--expert-tensor-parallel-size": value("parallel.etp", int),
    "--num-virtual-stages-per-pipeline-rank": value("parallel.vpp", int),
    "--virtual-pipeline-model-parallel-size": value("parallel.vpp", int),  # the 2021 spelling
    "--num-layers-per-virtual-pipeline-stage": special(),
    "--decoder-first-pipeline-num-layers": value("parallel.first_stage_layers", int),
    "--decoder-last-pipeline-num-layers": value("parallel.last_stage_layers", int),
    "--pipeline-model-parallel-layout": value(
        "parallel.pipeline_layout",
        str,
        note="the same syntax; the stage count over parallel.pp implies parallel.vpp, and folding runs the "
        "MTP modules (m) only in the last virtual stage, with the loss",
    ),
    "--sequence-parallel": noop("folding runs sequence parallelism whenever TP > 1 (MoE needs it)"),
    "--overlap-moe-expert-parallel-comm": switch("parallel.overlap_moe_comm"),
    "--delay-wgrad-compute": switch("parallel.delay_wgrad"),
    "--use-distributed-optimizer": switch("optim.distributed"),
    "--overlap-grad-reduce": switch("optim.overlap_grad_reduce"),
    "--overlap-param-gather": noop(
        "the distributed optimizer's parameter all-gather runs behind the optimizer step, not the next forward"
    ),
    "--tp-comm-overlap": noop(
        "sequence-parallel collectives are not chunked behind the GEMMs here (python -m tools.plan "
        "--tp-comm-overlap predicts what that would gain)"
    ),
    "--cp-comm-type": noop("context parallelism all-gathers K and V here (one scheme, the same results)", True),
    "--distributed-backend": noop("NCCL on GPU, gloo on CPU, chosen by the device", True),
    "--distributed-timeout-minutes": special(),
    "--ddp-bucket-size": value("optim.bucket_size", int),
    # ------------------------------------------------------------------ model
    "--num-layers": value("model.num_layers", int),
    "--hidden-size": value("model.hidden_size", int),
    "--ffn-hidden-size": special(),
    "--num-attention-heads": value("model.num_attention_heads", int),
    "--group-query-attention": special(False),
    "--num-query-groups": special(),
    "--kv-channels": value("model.head_dim", int),
    "--seq-length": value("train.seq_length", int),
    "--max-position-embeddings": value("model.max_position_embeddings", int),
    "--vocab-size": value("model.vocab_size", int),
    "--make-vocab-size-divisible-by": special(),
    "--normalization": value("", str, choices=("RMSNorm",)),
    "--norm-epsilon": value("model.norm_eps", float),
    "--position-embedding-type": value("", str, choices=("rope",)),
    "--no-position-embedding": noop("positions come from RoPE only here"),
    "--rotary-base": value("model.rope_theta", float),
    "--rotary-percent": value("", float, choices=("1.0", "1")),
    "--swiglu": noop("the MLPs and experts are SwiGLU here"),
    "--disable-bias-linear": noop("linear layers have no bias here (q/k/v biases: --add-qkv-bias)"),
    "--add-qkv-bias": switch("model.qkv_bias"),
    "--qk-layernorm": switch("model.qk_norm", "head"),
    "--untie-embeddings-and-output-weights": special(False),
    "--init-method-std": value("model.init_std", float),
    "--attention-dropout": value("model.attention_dropout", float),
    "--hidden-dropout": value("model.hidden_dropout", float),
    "--mtp-num-layers": value("model.mtp_num_layers", int),
    "--mtp-loss-scaling-factor": value("model.mtp_loss_scaling_factor", float),
    "--use-mcore-models": noop("deprecated in Megatron-LM; folding has one model implementation"),
    "--transformer-impl": noop(ATTENTION + "; the experts' GEMM backend is moe.expert_backend", True),
    "--attention-backend": noop(ATTENTION, True),
    "--use-flash-attn": noop(ATTENTION),
    "--attention-softmax-in-fp32": noop(ATTENTION),
    **{
        flag: noop(KERNEL)
        for flag in (
            "--no-masked-softmax-fusion",
            "--no-bias-swiglu-fusion",
            "--no-bias-dropout-fusion",
            "--no-rope-fusion",
            "--no-gradient-accumulation-fusion",
            "--no-persist-layer-norm",
            "--cross-entropy-loss-fusion",
            "--moe-permute-fusion",
            "--moe-router-fusion",
        )
    },
    # ------------------------------------------------------------------ MoE
    "--num-experts": value("moe.num_experts", int),
    "--moe-router-topk": value("moe.topk", int),
    "--moe-ffn-hidden-size": special(),
    "--moe-aux-loss-coeff": value("moe.aux_loss_coeff", float),
    "--moe-z-loss-coeff": value("moe.z_loss_coeff", float),
    "--moe-router-load-balancing-type": value(
        "moe.aux_loss_type", str, choices=("aux_loss", "seq_aux_loss", "global_aux_loss", "none")
    ),
    "--moe-token-dispatcher-type": value("moe.dispatcher", str, choices=("alltoall", "allgather")),
    "--moe-grouped-gemm": noop(
        "the experts always run as grouped GEMMs here (moe.expert_backend=auto: TransformerEngine on GPU)"
    ),
    "--moe-expert-capacity-factor": value("moe.capacity_factor", float),
    "--moe-pad-expert-input-to-capacity": switch("moe.pad_to_capacity"),
    "--moe-token-drop-policy": value("moe.drop_policy", str, choices=("probs", "position")),
    "--moe-router-pre-softmax": switch("moe.pre_softmax"),
    "--moe-router-score-function": value("moe.score_function", str, choices=("softmax", "sigmoid")),
    "--moe-router-num-groups": value("moe.num_groups", int),
    "--moe-router-group-topk": value("moe.group_topk", int),
    "--moe-router-topk-scaling-factor": value("moe.topk_scaling_factor", float),
    "--moe-router-dtype": value("moe.router_dtype", str, choices=("fp32", "fp64")),
    "--moe-input-jitter-eps": value("moe.input_jitter_eps", float),
    "--moe-router-enable-expert-bias": switch("moe.expert_bias"),
    "--moe-router-bias-update-rate": value("moe.expert_bias_update_rate", float),
    "--moe-router-force-load-balancing": switch("moe.force_balance"),
    "--moe-shared-expert-intermediate-size": value("moe.shared_expert_ffn_hidden_size", int),
    "--moe-shared-expert-gate": switch("moe.shared_expert_gate"),
    "--moe-shared-expert-overlap": noop("with parallel.overlap_moe_comm the shared expert runs during its dispatch"),
    "--moe-layer-freq": special(),
    "--multi-latent-attention": special(False),
    "--q-lora-rank": special(),
    "--kv-lora-rank": special(),
    "--qk-head-dim": special(),
    "--qk-pos-emb-head-dim": special(),
    "--v-head-dim": special(),
    "--moe-layer-recompute": switch("train.recompute", "moe"),
    "--moe-per-layer-logging": noop("each layer's expert load is on the console (imb) and in metrics.jsonl"),
    "--activation-func-fp8-input-store": switch(
        "moe.fp8_act_input_store",
        note="needs moe.fp8_recipe; the routed experts' activation keeps its input in the recipe's scaled e4m3 "
        "(Megatron-Core casts without a scale, with or without FP8, in every SwiGLU MLP; folding's dense MLPs "
        "and shared experts are bf16)",
    ),
    # ------------------------------------------------------------------ training and optimizer
    "--micro-batch-size": value("train.micro_batch_size", int),
    "--global-batch-size": value("train.global_batch_size", int),
    "--train-iters": value("train.steps", int),
    "--seed": special(),
    "--bf16": switch("train.precision", "bf16"),
    "--optimizer": value("", str, choices=("adam",), note="AdamW (decoupled weight decay), as Megatron-LM's adam"),
    "--lr": value("optim.lr", float),
    "--min-lr": value("optim.min_lr", float),
    "--lr-warmup-iters": value("optim.warmup_steps", int),
    "--lr-warmup-fraction": special(),
    "--lr-decay-iters": value("optim.decay_steps", int),
    "--lr-decay-style": special(),
    "--lr-wsd-decay-style": special(),
    "--lr-wsd-decay-iters": special(),
    "--weight-decay": value("optim.weight_decay", float),
    "--adam-beta1": value("optim.beta1", float),
    "--adam-beta2": value("optim.beta2", float),
    "--adam-eps": value("optim.eps", float),
    "--clip-grad": value("optim.clip_grad", float),
    "--recompute-activations": special(False),
    "--recompute-granularity": special(),
    "--recompute-method": special(),
    "--recompute-num-layers": special(),
    "--recompute-modules": special(),
    "--fine-grained-activation-offloading": special(False),
    "--offload-modules": special(),
    "--calculate-per-token-loss": noop(
        "the loss is always per token here: the global batch's token losses / their count"
    ),
    "--manual-gc": noop("no manual garbage collection is needed here"),
    "--num-workers": noop("batches are read in the training process here (memory-mapped)", True),
    "--eval-interval": value("train.eval_interval", int),
    "--eval-iters": value("train.eval_steps", int),
    "--log-interval": value("logging.interval", int),
    "--log-throughput": noop(LOGS),
    "--log-timers-to-tensorboard": noop(LOGS),
    "--tensorboard-dir": noop(LOGS, True),
    "--tensorboard-log-interval": noop(LOGS, True),
    "--log-validation-ppl-to-tensorboard": noop(LOGS + "; the eval records hold the loss, whose exp is the perplexity"),
    "--log-params-norm": noop(LOGS + "; the parameters' norm is not among the step's metrics"),
    "--log-num-zeros-in-grad": noop(LOGS + "; the count of zero gradients is not among the step's metrics"),
    "--timing-log-level": noop(LOGS + "; the step's time and its breakdown are logged at one level", True),
    "--exit-duration-in-mins": noop(
        "a timer that stops the job; folding stops on a signal (SIGTERM or SIGINT, as schedulers send before "
        "their limit), saving a checkpoint, so the scheduler's own time limit plays its part",
        True,
    ),
    "--dist-ckpt-strictness": noop(
        "how Megatron-LM treats unexpected or missing keys on load; folding's load checks every key and shape "
        "against the job and refuses a mismatch by name",
        True,
    ),
    "--accumulate-allreduce-grads-in-fp32": noop(
        "folding always accumulates and reduces gradients in fp32 (optim.main_grads_dtype=fp32, its default)"
    ),
    "--wandb-project": special(),
    "--wandb-exp-name": value("logging.wandb.name", str),
    # ------------------------------------------------------------------ data and checkpoints
    "--data-path": special(),
    "--split": special(),
    "--mock-data": noop("without data.paths folding trains on its embedded corpus (text, not random tokens)"),
    "--data-cache-path": value("data.cache_dir", str),
    "--eod-mask-loss": switch("data.eod_mask_loss"),
    "--no-create-attention-mask-in-dataloader": noop("the causal mask is implicit here"),
    "--tokenizer-type": special(),
    "--tokenizer-model": special(),
    "--vocab-file": special(),
    "--merge-file": special(),
    "--save": special(),
    "--load": special(),
    "--pretrained-checkpoint": special(),
    "--save-interval": value("checkpoint.save_interval", int),
    "--ckpt-format": noop("checkpoints are torch.distributed.checkpoint directories that reshard to any layout", True),
    "--auto-detect-ckpt-format": noop("there is one checkpoint format here"),
    "--async-save": switch("checkpoint.async_save"),
    "--no-load-optim": special(False),
    "--no-load-rng": special(False),
}
"""Every Megatron-LM flag with an equivalent here (see the module docstring). ``key=""`` marks a flag
whose only accepted values (``choices``) are what this engine always does."""

MEGATRON_DEFAULTS: Tuple[Tuple[str, Any, Tuple[str, ...]], ...] = (
    # (key, Megatron-LM's default, flags whose presence makes the command rely on it)
    ("model.rope_theta", 10000.0, ("--num-layers",)),
    ("model.norm_eps", 1e-5, ("--num-layers",)),
    ("model.init_std", 0.02, ("--num-layers",)),
    ("model.hidden_dropout", 0.1, ("--num-layers",)),
    ("model.attention_dropout", 0.1, ("--num-layers",)),
    ("moe.topk", 2, ("--num-experts",)),
    ("moe.aux_loss_coeff", 0.0, ("--num-experts",)),
    ("moe.z_loss_coeff", 0.0, ("--num-experts",)),
    ("moe.dispatcher", "allgather", ("--num-experts",)),
    ("moe.aux_loss_type", "aux_loss", ("--num-experts",)),
    ("moe.capacity_factor", None, ("--num-experts",)),
    ("moe.pre_softmax", False, ("--num-experts",)),
    ("moe.score_function", "softmax", ("--num-experts",)),
    ("moe.expert_bias", False, ("--num-experts",)),
    ("moe.shared_expert_ffn_hidden_size", None, ("--num-experts",)),
    ("optim.min_lr", 0.0, ("--lr",)),
    ("optim.warmup_steps", 0, ("--lr",)),
    ("optim.decay_style", "linear", ("--lr",)),
    ("optim.weight_decay", 0.01, ("--lr",)),
    ("optim.beta1", 0.9, ("--lr",)),
    ("optim.beta2", 0.999, ("--lr",)),
    ("optim.eps", 1e-8, ("--lr",)),
    ("optim.clip_grad", 1.0, ("--lr",)),
    ("train.seed", 1234, ("--train-iters",)),
    ("data.seed", 1234, ("--train-iters",)),
    ("train.eval_interval", 0, ("--train-iters",)),
    ("logging.interval", 100, ("--train-iters",)),
)
"""Megatron-LM's defaults where this engine's differ (or its presets set others), applied when one of
the listed flags shows the command defines that part of the job and does not give the key's flag."""

EXTRA_SYNONYMS: Dict[str, str] = {
    "learning_rate": "optim.lr",
    "min_learning_rate": "optim.min_lr",
    "warmup": "optim.warmup_steps",
    "lr_warmup_steps": "optim.warmup_steps",
    "warmup_iters": "optim.warmup_steps",
    "num_warmup_steps": "optim.warmup_steps",
    "lr_scheduler": "optim.decay_style",
    "max_grad_norm": "optim.clip_grad",
    "grad_clip": "optim.clip_grad",
    "num_expert": "moe.num_experts",
    "n_experts": "moe.num_experts",
    "n_routed_experts": "moe.num_experts",
    "num_local_experts": "moe.num_experts",
    "top_k": "moe.topk",
    "num_experts_per_tok": "moe.topk",
    "router_aux_loss_coef": "moe.aux_loss_coeff",
    "capacity": "moe.capacity_factor",
    "mbs": "train.micro_batch_size",
    "gbs": "train.global_batch_size",
    "batch_size": "train.global_batch_size",
    "max_steps": "train.steps",
    "iters": "train.steps",
    "seq_len": "train.seq_length",
    "max_seq_len": "train.seq_length",
    "sequence_length": "train.seq_length",
    "tensor_parallel_size": "parallel.tp",
    "pipeline_parallel_size": "parallel.pp",
    "expert_parallel_size": "parallel.ep",
    "num_hidden_layers": "model.num_layers",
    "num_key_value_heads": "model.num_kv_heads",
    "rms_norm_eps": "model.norm_eps",
    "dtype": "train.precision",
    "activation_checkpointing": "train.recompute",
    "save_dir": "checkpoint.dir",
}
"""Other spellings of keys (Hugging Face, torchtitan and common habits) for "did you mean"."""

SPECIAL_SYNONYMS: Dict[str, str] = {
    "num_layers_per_virtual_pipeline_stage": "parallel.vpp",
    "ffn_hidden_size": "moe.ffn_hidden_size",
    "moe_ffn_hidden_size": "moe.ffn_hidden_size",
    "num_query_groups": "model.num_kv_heads",
    "lr_warmup_fraction": "optim.warmup_steps",
    "lr_decay_style": "optim.decay_style",
    "lr_wsd_decay_style": "optim.wsd_decay_shape",
    "lr_wsd_decay_iters": "optim.wsd_decay_fraction",
    "recompute_granularity": "train.recompute",
    "data_path": "data.paths",
    "split": "data.split",
    "tokenizer_model": "data.tokenizer",
    "save": "checkpoint.dir",
    "load": "checkpoint.init_from_megatron",
    "pretrained_checkpoint": "checkpoint.init_from_megatron",
    "seed": "train.seed",
    "wandb_project": "logging.wandb.project",
    "distributed_timeout_minutes": "train.collective_timeout_s",
}
"""The keys of the special flags, for "did you mean" (their conversion is in megatron_args)."""


def leaf_synonyms() -> Dict[str, str]:
    """``{spelling: key}``: each Megatron-LM flag with a key, written as a config leaf
    (``--moe-router-topk`` -> ``moe_router_topk``), plus :data:`SPECIAL_SYNONYMS` and
    :data:`EXTRA_SYNONYMS`."""
    out = {flag[2:].replace("-", "_"): f.key for flag, f in FLAGS.items() if f.key}
    out.update(SPECIAL_SYNONYMS)
    out.update(EXTRA_SYNONYMS)
    return out
