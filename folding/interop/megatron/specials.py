"""The Megatron-LM flags that convert from several flags at once (see :mod:`folding.interop.megatron.args`).

Each rule reads the parsed flags (``{"--flag": [values]}``), writes typed values into ``out`` (Hydra key
-> value), and appends to ``notes`` (accepted, but worth knowing) or ``problems`` (no equivalent: the
conversion is refused). The rules follow Megatron-LM's own semantics: VPP is the layers divided by
``pp · num_layers_per_virtual_pipeline_stage``; ``--num-query-groups`` counts only with
``--group-query-attention``; the experts' FFN is ``--moe-ffn-hidden-size``, else ``--ffn-hidden-size``;
embeddings are tied unless ``--untie-embeddings-and-output-weights``; ``--data-path`` is ``p1 p2`` or
``w1 p1 w2 p2``; the vocabulary is padded to a multiple of ``--make-vocab-size-divisible-by`` (128 when
absent) times TP; the warm-up fraction is of the decay horizon; a ``--tokenizer-model`` becomes ``data.tokenizer`` only
when it is a local path (a hub name becomes a note saying what to pass).

Usage::

    specials(flags, out, notes, problems)
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional

from ...memory.offload import OFFLOAD_MODULES
from ...model.recompute import RECOMPUTE_MODULES

Flags = Dict[str, List[str]]

HF_TOKENIZERS = ("HuggingFaceTokenizer",)
"""Megatron-LM tokenizer types whose ``--tokenizer-model`` this engine reads as ``data.tokenizer``."""
DECAY_STYLES = {"constant": "constant", "linear": "linear", "cosine": "cosine", "WSD": "wsd"}
"""Megatron-LM ``--lr-decay-style`` -> ``optim.decay_style`` (``inverse-square-root`` has no equivalent)."""
WSD_SHAPES = {"linear": "linear", "cosine": "cosine", "minus_sqrt": "sqrt"}
"""Megatron-LM ``--lr-wsd-decay-style`` -> ``optim.wsd_decay_shape`` (``exponential`` has none)."""
ARCHITECTURE_DEFAULTS = (
    ("--normalization", "LayerNorm (Megatron-LM's default; folding builds RMSNorm: --normalization RMSNorm)"),
    (
        "--position-embedding-type",
        "learned absolute positions (Megatron-LM's default; folding uses RoPE: --position-embedding-type rope)",
    ),
    ("--swiglu", "GeLU MLPs (Megatron-LM's default; folding's are SwiGLU: --swiglu)"),
    (
        "--disable-bias-linear",
        "biases in every linear layer (Megatron-LM's default; folding has none: --disable-bias-linear)",
    ),
)
"""Flags whose absence gives a model this engine does not build, with what the default would be."""


def _one(flags: Flags, name: str) -> Optional[str]:
    vals = flags.get(name)
    return vals[0] if vals else None


def _number(text: str) -> Any:
    x = float(text)
    return int(x) if x.is_integer() and "." not in text and "e" not in text.lower() else x


def specials(flags: Flags, out: Dict[str, Any], notes: List[str], problems: List[str]) -> None:
    """Convert every special flag of ``flags`` (and the defaults a model relies on) into ``out``."""
    try:
        _layout(flags, out, notes, problems)
        _model(flags, out, notes, problems)
        _schedule(flags, out, notes, problems)
        _recompute(flags, out, notes, problems)
        _offload(flags, out, notes, problems)
        _mla_and_layer_freq(flags, out, notes, problems)
        _data_and_checkpoints(flags, out, notes, problems)
    except ValueError as e:  # a value that is not a number where one is expected
        problems.append(f"a flag's value is not a number: {e}")


def _layout(flags: Flags, out: Dict[str, Any], notes: List[str], problems: List[str]) -> None:
    per_stage = _one(flags, "--num-layers-per-virtual-pipeline-stage")
    if per_stage is not None:
        layers, pp = out.get("model.num_layers"), out.get("parallel.pp", 1)
        n = int(per_stage)
        if "parallel.vpp" in out:
            problems.append("give either --num-layers-per-virtual-pipeline-stage or a number of virtual stages")
        elif layers is None or layers % (pp * n):
            problems.append(
                f"--num-layers-per-virtual-pipeline-stage {n} needs --num-layers divisible by "
                f"--pipeline-model-parallel-size x {n} (got {layers} layers, pp {pp})"
            )
        else:
            out["parallel.vpp"] = layers // (pp * n)
    if "parallel.pipeline_layout" in out:
        others = (
            "--decoder-first-pipeline-num-layers",
            "--decoder-last-pipeline-num-layers",
            "--num-layers-per-virtual-pipeline-stage",
        )
        given = ", ".join(f for f in others if f in flags)
        if given:
            problems.append(
                f"--pipeline-model-parallel-layout lists every stage's layers: drop {given} (Megatron-LM refuses "
                "the combination too)"
            )
    if "parallel.etp" not in out and ({"--tensor-model-parallel-size", "--expert-model-parallel-size"} & set(flags)):
        out["parallel.etp"] = out.get("parallel.tp", 1)  # Megatron-LM's default, written out as folding asks
    minutes = _one(flags, "--distributed-timeout-minutes")
    if minutes is not None:
        out["train.collective_timeout_s"] = 60.0 * float(minutes)


def _model(flags: Flags, out: Dict[str, Any], notes: List[str], problems: List[str]) -> None:
    defined = "--num-layers" in flags
    if defined:
        for flag, what in ARCHITECTURE_DEFAULTS:
            if flag not in flags:
                problems.append(f"no {flag}: the model would have {what}")
        if "--num-experts" not in flags:
            problems.append("no --num-experts: a dense model; folding trains mixture-of-experts models")
        if "--bf16" in flags and "--moe-router-dtype" not in flags and "--num-experts" in flags:
            notes.append("the router computes in fp32 here (Megatron-LM: in bf16 unless --moe-router-dtype)")
    divisor = _one(flags, "--make-vocab-size-divisible-by")
    if divisor is not None or defined:  # Megatron-LM pads to a multiple of the divisor (128 when absent) x TP
        n, tp = int(divisor or 128), out.get("parallel.tp", 1)
        out["model.make_vocab_size_divisible_by"] = n * tp
        notes.append(
            f"--make-vocab-size-divisible-by {n}{'' if divisor else ' (Megatron-LM default)'} with TP {tp}: "
            f"model.make_vocab_size_divisible_by={n * tp}, Megatron-LM's padding (its multiple is N x TP); here "
            "it is part of the model, kept under another parallel.tp, and the padded ids are never predicted"
        )
    ffn, moe_ffn = _one(flags, "--ffn-hidden-size"), _one(flags, "--moe-ffn-hidden-size")
    if moe_ffn or ffn:
        out["moe.ffn_hidden_size"] = int(moe_ffn or ffn)
    groups = _one(flags, "--num-query-groups")
    if "--group-query-attention" in flags:
        out["model.num_kv_heads"] = int(groups) if groups is not None else 1  # Megatron-LM's default: 1 group
    elif groups is not None:
        notes.append("--num-query-groups: ignored without --group-query-attention, as in Megatron-LM")
    if "model.num_kv_heads" not in out and "model.num_attention_heads" in out:
        out["model.num_kv_heads"] = out["model.num_attention_heads"]
    if defined or "--untie-embeddings-and-output-weights" in flags:
        out["model.tie_embeddings"] = "--untie-embeddings-and-output-weights" not in flags


def _schedule(flags: Flags, out: Dict[str, Any], notes: List[str], problems: List[str]) -> None:
    seed = _one(flags, "--seed")
    if seed is not None:
        out["train.seed"] = out["data.seed"] = int(seed)  # Megatron-LM seeds both from --seed
    horizon = out.get("optim.decay_steps") or out.get("train.steps")
    fraction = _one(flags, "--lr-warmup-fraction")
    if fraction is not None:
        if "optim.warmup_steps" in out or horizon is None:
            problems.append("--lr-warmup-fraction needs --lr-decay-iters or --train-iters, and no --lr-warmup-iters")
        else:
            out["optim.warmup_steps"] = int(float(fraction) * horizon)
    for flag, key, table in (
        ("--lr-decay-style", "optim.decay_style", DECAY_STYLES),
        ("--lr-wsd-decay-style", "optim.wsd_decay_shape", WSD_SHAPES),
    ):
        name = _one(flags, flag)
        if name is None:
            continue
        if name in table:
            out[key] = table[name]
        else:
            problems.append(f"{flag} {name}: no equivalent; folding has {', '.join(table)}")
    iters = _one(flags, "--lr-wsd-decay-iters")
    if iters is not None:
        if horizon is None:
            problems.append("--lr-wsd-decay-iters needs --lr-decay-iters or --train-iters")
        else:
            out["optim.wsd_decay_fraction"] = int(iters) / horizon
    project = _one(flags, "--wandb-project")
    if project is not None:
        out["logging.wandb.project"] = project
        out["logging.wandb.mode"] = "online"  # Megatron-LM logs online when given a project


def _recompute(flags: Flags, out: Dict[str, Any], notes: List[str], problems: List[str]) -> None:
    granularity = _one(flags, "--recompute-granularity")
    if "--recompute-activations" in flags and granularity is None:
        granularity = "selective"  # Megatron-LM's meaning of --recompute-activations
    if granularity is None:
        if {"--recompute-method", "--recompute-num-layers", "--recompute-modules"} & set(flags):
            notes.append("--recompute-method/-num-layers/-modules: ignored without --recompute-granularity")
        return
    if granularity == "full":
        method, layers = _one(flags, "--recompute-method"), int(_one(flags, "--recompute-num-layers") or 1)
        if method == "block":
            problems.append(
                "--recompute-method block recomputes only some layers of each stage; folding recomputes every "
                "layer (train.recompute=full, as --recompute-method uniform --recompute-num-layers 1) or none"
            )
            return
        out["train.recompute"] = "full"
        if layers != 1:
            notes.append(f"--recompute-num-layers {layers}: folding recomputes layer by layer (1)")
    elif granularity == "selective":
        modules = [m for v in flags.get("--recompute-modules") or ["core_attn"] for m in v.split()]  # its default
        unknown = [m for m in modules if m not in RECOMPUTE_MODULES]
        if unknown:
            problems.append(
                f"--recompute-modules {' '.join(unknown)}: folding recomputes {', '.join(RECOMPUTE_MODULES)} "
                "(Megatron-Core's names and meaning)"
            )
        else:
            out["train.recompute"] = "none"
            out["train.recompute_modules"] = list(dict.fromkeys(modules))
    else:
        problems.append(f"--recompute-granularity {granularity}: folding has full or selective")


def _offload(flags: Flags, out: Dict[str, Any], notes: List[str], problems: List[str]) -> None:
    """``--fine-grained-activation-offloading --offload-modules ...`` -> ``train.offload_modules``."""
    modules = [m for v in flags.get("--offload-modules") or [] for m in v.split()]
    if "--fine-grained-activation-offloading" not in flags:
        if modules:
            notes.append("--offload-modules: ignored without --fine-grained-activation-offloading (as in Megatron-LM)")
        return
    unknown = [m for m in modules if m not in OFFLOAD_MODULES]
    if unknown:
        problems.append(f"--offload-modules {' '.join(unknown)}: folding offloads {', '.join(OFFLOAD_MODULES)}")
    elif not modules:
        problems.append("--fine-grained-activation-offloading without --offload-modules: name the modules to offload")
    else:
        out["train.offload_modules"] = list(dict.fromkeys(modules))


def _data_and_checkpoints(flags: Flags, out: Dict[str, Any], notes: List[str], problems: List[str]) -> None:
    tokens = [t for v in flags.get("--data-path", []) for t in v.split()]
    if tokens:
        pairs = len(tokens) % 2 == 0 and all(_is_number(t) for t in tokens[::2])
        out["data.paths"] = tokens[1::2] if pairs else tokens
        if pairs:
            out["data.weights"] = [float(w) for w in tokens[::2]]
        elif len(tokens) > 1:
            notes.append("--data-path without weights: Megatron-LM blends by size, folding equally (give w1 p1 w2 p2)")
    split = _one(flags, "--split")
    if split is not None:
        out["data.split"] = [_number(x.strip()) for x in split.split(",")]
    kind, model = _one(flags, "--tokenizer-type"), _one(flags, "--tokenizer-model")
    if kind in HF_TOKENIZERS and model and os.path.exists(os.path.expanduser(model)):
        out["data.tokenizer"] = model
    elif kind in HF_TOKENIZERS and model:  # a hub name: folding reads tokenizers from disk only
        notes.append(
            f"--tokenizer-model {model}: not a local path, and folding loads no tokenizer over the network; "
            f"download it (huggingface-cli download {model} --local-dir DIR) and pass data.tokenizer=DIR"
        )
    elif kind or model or "--vocab-file" in flags:
        notes.append(
            f"--tokenizer-type {kind}: set data.tokenizer to a Hugging Face tokenizer (a directory or tokenizer.json) "
            "with the same vocabulary; the tokenized .bin/.idx data are read as they are"
        )
    if "--no-load-rng" in flags:
        if float(_one(flags, "--moe-input-jitter-eps") or 0.0) != 0.0:
            problems.append(
                "--no-load-rng with --moe-input-jitter-eps: folding restores the RNG on resume and the jitter "
                "draws from it, so the resumed run would differ; drop --no-load-rng"
            )
        else:
            notes.append(
                "--no-load-rng: ignored; nothing in this job draws random numbers after initialization (dropout "
                "masks are hashed from the sample, not drawn)"
            )
    save, load, pretrained = _one(flags, "--save"), _one(flags, "--load"), _one(flags, "--pretrained-checkpoint")
    # --load naming another directory than --save (or --pretrained-checkpoint) reads a Megatron checkpoint:
    # its weights start the run (checkpoint.init_from_megatron); --load = --save is the run's own directory
    start = load if load and load != save else pretrained
    if "--no-load-optim" in flags and load and load == save:
        problems.append(
            "--no-load-optim: folding always restores the optimizer state with the weights; drop the flag to "
            "resume the run as it was, or start fresh from the Megatron checkpoint's weights with "
            "--load pointing at it (another directory than --save: checkpoint.init_from_megatron)"
        )
    elif "--no-load-optim" in flags and not start:
        notes.append("--no-load-optim: ignored; without --load there is no checkpoint to read an optimizer from")
    if save:
        out["checkpoint.dir"] = save
    if start:
        out["checkpoint.init_from_megatron"] = start
        which = "--load" if start == load else "--pretrained-checkpoint"
        notes.append(
            f"{which}: checkpoint.init_from_megatron starts from the Megatron-Core checkpoint's weights (any "
            "layout) with a fresh optimizer at step 0; its optimizer state, iteration and RNG are not read"
        )
        if load and pretrained and start == load:
            notes.append("--pretrained-checkpoint: ignored; --load names the checkpoint to start from")
    if load and load == save:
        notes.append("--load = --save: a run restarted with the same checkpoint.dir resumes from its latest checkpoint")


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


MLA_FLAGS = {
    "--q-lora-rank": "q_lora_rank",
    "--kv-lora-rank": "kv_lora_rank",
    "--qk-head-dim": "qk_nope_head_dim",
    "--qk-pos-emb-head-dim": "qk_rope_head_dim",
    "--v-head-dim": "v_head_dim",
}
"""Megatron-LM's multi-head latent attention sizes and the ``model.mla`` fields they are."""


def _mla_and_layer_freq(flags: Flags, out: Dict[str, Any], notes: List[str], problems: List[str]) -> None:
    """``--multi-latent-attention`` and its sizes become ``model.mla.*`` values that must equal a preset's
    (:func:`folding.interop.megatron.args.convert` refuses what is left after the preset is matched);
    ``--moe-layer-freq`` (an int, or Megatron-LM's list expression such as ``([0]*3+[1]*58)``) becomes
    ``model.mlp_only_layers``, the dense layers."""
    sizes = {field: _one(flags, flag) for flag, field in MLA_FLAGS.items() if flag in flags}
    if sizes and "--multi-latent-attention" not in flags:
        problems.append(f"{', '.join(f for f in MLA_FLAGS if f in flags)}: only with --multi-latent-attention")
    for field, v in sizes.items():
        out[f"model.mla.{field}"] = None if v in (None, "None", "none") else int(v)
    if "--multi-latent-attention" in flags and not sizes:
        notes.append("--multi-latent-attention: the MLA sizes are the preset's (model.mla)")
    freq = _one(flags, "--moe-layer-freq")
    if freq is None:
        return
    pattern = layer_freq_pattern(freq, out.get("model.num_layers"))
    if pattern is None:
        problems.append(
            f"--moe-layer-freq {freq}: give an integer or a list expression of 0/1 such as ([0]*3+[1]*58) "
            "covering --num-layers"
        )
    elif any(pattern):
        out["model.mlp_only_layers"] = tuple(i for i, moe in enumerate(pattern) if not moe)
    else:
        problems.append(f"--moe-layer-freq {freq}: no MoE layer; folding trains MoE models")


def layer_freq_pattern(freq: str, num_layers: Optional[int]) -> Optional[List[int]]:
    """Megatron-LM's ``--moe-layer-freq`` as one 0/1 per layer (1: MoE): an integer ``N`` (every N-th layer,
    from the first), a list ``[1,0,...]``, or a sum of repeated lists ``([0]*3+[1]*58)``; ``None`` when it
    is none of these or does not cover ``num_layers`` layers."""
    text = freq.strip().replace(" ", "")
    if text.isdigit():
        n = int(text)
        if not n or num_layers is None:
            return None
        return [1 if i % n == 0 else 0 for i in range(num_layers)]
    text = text[1:-1] if text.startswith("(") and text.endswith(")") else text
    out: List[int] = []
    for term in text.split("+"):
        body, _, times = term.partition("*")
        if not (body.startswith("[") and body.endswith("]")) or (times and not times.isdigit()):
            return None
        values = [v for v in body[1:-1].split(",") if v]
        if not values or any(v not in ("0", "1") for v in values):
            return None
        out += [int(v) for v in values] * (int(times) if times else 1)
    return out if num_layers is None or len(out) == num_layers else None
