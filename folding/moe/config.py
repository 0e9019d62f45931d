"""Typed configuration of one MoE layer: routing, capacity, auxiliary losses, dispatch and experts.

``MoEConfig`` is the one record of every MoE option: a model carries it whole
(``ModelConfig.moe``), presets set it, and the Hydra keys ``moe.*`` are generated from its fields. It
is frozen and keyword-only, validated when built (``__post_init__`` calls :meth:`MoEConfig.validate`),
and every error names the offending key as ``moe.<field>`` together with a fix. String options are
typed as ``Literal`` enumerations; the tuples of valid values below are derived from them. Options
mean what the same options mean in Megatron-Core (``--num-experts``, ``--moe-router-topk``,
``--moe-router-score-function``, ...).

Usage::

    cfg = MoEConfig(num_experts=8, topk=2, ffn_hidden_size=14336)            # Mixtral 8x7B
    cfg = MoEConfig(num_experts=64, topk=8, ffn_hidden_size=2560, pre_softmax=True,
                    shared_expert_ffn_hidden_size=20480, shared_expert_gate=True)  # Qwen2-57B-A14B
    router = Router(hidden_size=4096, config=cfg, groups=ps.groups)
"""

from __future__ import annotations

import dataclasses
from typing import Literal, Optional, get_args

ScoreFunction = Literal["softmax", "sigmoid"]
RouterDtype = Literal["fp32", "fp64"]
DropPolicy = Literal["probs", "position"]
AuxLossType = Literal["none", "aux_loss", "seq_aux_loss", "global_aux_loss"]
Dispatcher = Literal["alltoall", "allgather", "hierarchical"]
WireFormat = Literal["none", "fp8", "mxfp8"]
ExpertBackend = Literal["auto", "te", "torch", "loop", "emulated"]
Fp8Recipe = Literal["delayed", "tensorwise", "blockwise", "mxfp8", "rowwise"]

SCORE_FUNCTIONS = get_args(ScoreFunction)
ROUTER_DTYPES = get_args(RouterDtype)
DROP_POLICIES = get_args(DropPolicy)
AUX_LOSS_TYPES = get_args(AuxLossType)
DISPATCHERS = get_args(Dispatcher)
WIRE_FORMATS = get_args(WireFormat)
EXPERT_BACKENDS = get_args(ExpertBackend)
FP8_RECIPES = (None,) + get_args(Fp8Recipe)
FP8_ROW_ALIGN = {"delayed": 16, "tensorwise": 16, "blockwise": 16, "mxfp8": 32, "rowwise": 16}
"""Per-expert row multiple that each FP8 recipe's grouped GEMM needs (each expert's rows are
zero-padded to it; MX blocks are 32 rows, the FP8 GEMMs' tiles 16)."""


TRAINING_ONLY = (
    "input_jitter_eps",
    "dispatch_wire",
    "combine_wire",
    "grad_wire",
    "expert_backend",
    "fp8_recipe",
    "fp8_act_input_store",
    "trace_dir",
    "expert_replicas",
    "replica_interval",
)
"""The options that say how a run trains (noise, wire formats, kernels, telemetry, replica slots),
not what the model is: the weights and the function they compute are the same without them."""


def _fail(field: str, value, why: str, fix: str) -> None:
    raise ValueError(f"moe.{field}={value!r}: {why}; {fix}")


def _positive_int(field: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        _fail(field, value, "must be an integer >= 1", f"set moe.{field} to a positive integer")


def _choice(field: str, value, choices) -> None:
    if value not in choices:
        _fail(field, value, "unknown value", f"choose one of {', '.join(repr(c) for c in choices)}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """Configuration of the MoE layers of a model (Hydra group ``moe``); see the module docstring."""

    num_experts: int
    """Number of routed experts E per MoE layer."""
    topk: int
    """Experts chosen per token (k)."""
    ffn_hidden_size: int
    """Hidden size F of one routed expert's FFN (full size, before any ETP sharding)."""
    score_function: ScoreFunction = "softmax"
    """How logits become probabilities: ``"softmax"`` or ``"sigmoid"`` (top-k probs renormalized to
    sum 1 when k > 1)."""
    pre_softmax: bool = False
    """Softmax over all E experts before top-k (Qwen2-MoE without ``norm_topk_prob``); the default
    applies softmax to the k selected logits after top-k (Mixtral). Only for ``softmax``."""
    num_groups: Optional[int] = None
    """Group-limited routing: split the E experts into this many contiguous groups (e.g. one per
    node or EP rank). ``None`` disables it; needs ``group_topk``."""
    group_topk: Optional[int] = None
    """Group-limited routing: number of groups a token may use. A group's score is the sum of its
    top ``group_score_topk`` scores; the other groups are masked before the top-k."""
    group_score_topk: Optional[int] = None
    """Group-limited routing: how many of a group's best scores sum to its score. ``None``:
    ``topk // group_topk`` (Megatron-Core's rule); DeepSeek-V3 (Hugging Face) always uses 2, which
    equals Megatron-Core's rule for its top-8 of 4 groups."""
    topk_scaling_factor: Optional[float] = None
    """Multiplies the final top-k probabilities (``None`` = 1)."""
    router_dtype: RouterDtype = "fp32"
    """Precision of the gating GEMM, scores and losses: ``"fp32"`` or ``"fp64"``."""
    input_jitter_eps: Optional[float] = None
    """Training only: multiply router inputs by noise uniform in [1-eps, 1+eps]. ``None`` = off."""
    capacity_factor: Optional[float] = None
    """Expert capacity = ceil(T·k/E · capacity_factor) from the local tokens T; tokens beyond it are
    dropped. ``None`` = dropless."""
    drop_policy: DropPolicy = "probs"
    """Which tokens an over-full expert keeps: ``"probs"`` (highest probability) or ``"position"``
    (earliest tokens)."""
    pad_to_capacity: bool = False
    """Give every expert exactly ``capacity`` rows (filler rows have probability 0): static shapes,
    no host sync in the dispatcher. Needs ``capacity_factor``."""
    aux_loss_type: AuxLossType = "aux_loss"
    """Load-balancing loss: ``"none"``, ``"aux_loss"`` (Switch/GShard per micro-batch, counts over
    TP×CP), ``"seq_aux_loss"`` (per sequence, averaged over the batch) or ``"global_aux_loss"``
    (counts over TP×DP×CP accumulated over micro-batches until reset)."""
    aux_loss_coeff: float = 0.0
    """Weight of the load-balancing loss (0 disables it)."""
    z_loss_coeff: float = 0.0
    """Weight of the router z-loss mean(logsumexp(logits)²) (0 disables it)."""
    expert_bias: bool = False
    """Aux-loss-free balancing: a per-expert bias added to the scores for expert selection only,
    updated once per global batch from the token counts over TP×DP×CP."""
    expert_bias_update_rate: float = 1e-3
    """Step of the expert-bias update: ``bias += rate · sign(mean_count − count)``."""
    force_balance: bool = False
    """Benchmarks only: ignore the learned choice and assign tokens round-robin so that every
    expert receives the same load (probabilities still come from the real logits)."""
    dispatcher: Dispatcher = "alltoall"
    """Token dispatcher: ``"alltoall"`` (EP all-to-all, ETP all-gather), ``"allgather"``, or
    ``"hierarchical"`` (when EP spans nodes of ``parallel.nvlink_domain`` ranks: a token crosses the
    node boundary once per destination node and is forwarded inside it; the combine sums each node's
    partials in fp32 before they cross back; ``alltoall`` when EP lies in one node). Hierarchical
    refuses ``pad_to_capacity`` and ``expert_replicas`` (docs/dispatcher.md)."""
    dispatch_wire: WireFormat = "none"
    """Wire format of the dispatch exchange: ``"none"``, ``"fp8"`` or ``"mxfp8"``."""
    combine_wire: WireFormat = "none"
    """Wire format of the combine exchange: ``"none"``, ``"fp8"`` or ``"mxfp8"``."""
    grad_wire: WireFormat = "none"
    """Wire format of the backward exchanges: ``"none"``, ``"fp8"`` or ``"mxfp8"``."""
    expert_backend: ExpertBackend = "auto"
    """Grouped-GEMM backend: ``"auto"``, ``"te"`` (TransformerEngine), ``"torch"`` (grouped_mm; FP8
    ``rowwise`` / ``mxfp8`` through ``torch._scaled_grouped_mm``), ``"loop"`` (one GEMM per expert) or
    ``"emulated"`` (FP8 emulated on any device)."""
    fp8_recipe: Optional[Fp8Recipe] = None
    """FP8 recipe of the experts: ``None`` (off), ``"delayed"``, ``"tensorwise"``, ``"blockwise"``,
    ``"mxfp8"`` (TransformerEngine's recipes; ``mxfp8`` also on the ``torch`` backend) or ``"rowwise"``
    (per-row scales, ``torch._scaled_grouped_mm`` on compute capability 9.x; not in TE). Under a recipe
    the experts keep each GEMM's input for backward only quantized, 1 byte per element plus the recipe's
    scales (docs/precision.md)."""
    fp8_act_input_store: bool = False
    """Keep the experts' activation input (fc1's output ``[rows, 2F]``) for backward in FP8, e4m3 with
    ``moe.fp8_recipe``'s scaling, instead of high precision: 1 byte per element plus scales, and the
    activation's backward sees the FP8-rounded input (Megatron-Core's
    ``--activation-func-fp8-input-store``). Needs ``moe.fp8_recipe``."""
    shared_expert_ffn_hidden_size: Optional[int] = None
    """FFN size of the shared expert (Qwen2-MoE); ``None`` = no shared expert."""
    shared_expert_gate: bool = False
    """Multiply the shared expert's output by sigmoid(x·g) with a learned g [1, H] (Qwen2-MoE)."""
    trace_dir: Optional[str] = None
    """Training only: record the routing of every step (tokens each source rank sent to each expert,
    and the drops, per MoE layer) in ``<trace_dir>/routing_trace.bin``; ``None`` = off. Changes no
    tensor of the model. Read it with ``python -m tools.routing_trace``."""
    expert_replicas: int = 0
    """Hot-expert replicas: extra expert slots per EP rank (``0`` = off). Every
    ``replica_interval`` steps the hottest experts of the last interval get copies on the least
    loaded EP ranks and their tokens are split across the copies; the model trains exactly as
    without (see docs/dispatcher.md). Needs EP > 1."""
    replica_interval: int = 100
    """Steps between two re-plans of the replica slots (from the per-expert loads measured over the
    steps since the last one); only with ``expert_replicas > 0``."""

    def __post_init__(self):
        self.validate()

    def replace(self, **changes) -> "MoEConfig":
        """A copy with ``changes`` applied (validated again); an unknown field names the valid ones."""
        names = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(changes) - names)
        if unknown:
            raise ValueError(f"unknown MoE option(s) {unknown}; options: {', '.join(sorted(names))}")
        return dataclasses.replace(self, **changes)

    def for_inference(self) -> "MoEConfig":
        """A copy with every :data:`TRAINING_ONLY` option at its default: the MoE of export,
        generation and conversion, which run on one process whatever the run trained with."""
        defaults = {f.name: f.default for f in dataclasses.fields(self) if f.name in TRAINING_ONLY}
        return dataclasses.replace(self, **defaults)

    def validate(self) -> None:
        """Raise ``ValueError`` naming ``moe.<field>`` and a fix if the configuration is impossible."""
        for f in ("num_experts", "topk", "ffn_hidden_size"):
            _positive_int(f, getattr(self, f))
        self._validate_routing()
        self._validate_capacity()
        self._validate_losses()
        self._validate_execution()
        self._validate_replicas()
        self._validate_shared_expert()

    def _validate_routing(self) -> None:
        """Top-k, the score function and its options, expert groups, scaling, router dtype, jitter."""
        E, k = self.num_experts, self.topk
        if k > E:
            _fail("topk", k, f"exceeds moe.num_experts={E}", f"set moe.topk <= {E}")
        _choice("score_function", self.score_function, SCORE_FUNCTIONS)
        if self.pre_softmax and self.score_function != "softmax":
            _fail(
                "pre_softmax",
                True,
                "only applies to score_function='softmax'",
                "set moe.pre_softmax=false or moe.score_function=softmax",
            )
        if k == 1 and self.score_function == "softmax" and not self.pre_softmax:
            _fail(
                "topk",
                1,
                "softmax over a single selected logit is always 1, so the router gets no gradient",
                "set moe.pre_softmax=true (or use moe.score_function=sigmoid)",
            )
        self._validate_groups()
        if self.topk_scaling_factor is not None and not self.topk_scaling_factor > 0:
            _fail("topk_scaling_factor", self.topk_scaling_factor, "must be > 0", "use a positive factor or null")
        _choice("router_dtype", self.router_dtype, ROUTER_DTYPES)
        if self.input_jitter_eps is not None and not 0 <= self.input_jitter_eps < 1:
            _fail("input_jitter_eps", self.input_jitter_eps, "must be in [0, 1)", "use e.g. 0.01 or null")

    def _validate_capacity(self) -> None:
        """The capacity factor, the drop policy and padding to capacity."""
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            _fail("capacity_factor", self.capacity_factor, "must be > 0", "use e.g. 1.0, or null for dropless routing")
        _choice("drop_policy", self.drop_policy, DROP_POLICIES)
        if self.pad_to_capacity and self.capacity_factor is None:
            _fail("pad_to_capacity", True, "needs a capacity", "set moe.capacity_factor (e.g. 1.0)")
        if self.dispatcher == "hierarchical" and self.pad_to_capacity:
            _fail(
                "pad_to_capacity",
                True,
                "the hierarchical dispatcher's de-duplicated row counts are not static",
                "set moe.pad_to_capacity=false or moe.dispatcher=alltoall",
            )

    def _validate_losses(self) -> None:
        """The load-balancing loss, the loss weights and the expert-bias rate."""
        _choice("aux_loss_type", self.aux_loss_type, AUX_LOSS_TYPES)
        for f in ("aux_loss_coeff", "z_loss_coeff"):
            if not getattr(self, f) >= 0:
                _fail(f, getattr(self, f), "must be >= 0", f"set moe.{f} to 0 (off) or a positive weight")
        if not self.expert_bias_update_rate > 0:
            _fail("expert_bias_update_rate", self.expert_bias_update_rate, "must be > 0", "use e.g. 1e-3")

    def _validate_execution(self) -> None:
        """The dispatcher and its wires, the expert backend and FP8 recipe, the routing trace."""
        _choice("dispatcher", self.dispatcher, DISPATCHERS)
        for f in ("dispatch_wire", "combine_wire", "grad_wire"):
            _choice(f, getattr(self, f), WIRE_FORMATS)
        _choice("expert_backend", self.expert_backend, EXPERT_BACKENDS)
        _choice("fp8_recipe", self.fp8_recipe, FP8_RECIPES)
        self._validate_backend_recipe()
        if self.trace_dir is not None and (not isinstance(self.trace_dir, str) or not self.trace_dir.strip()):
            fix = "set moe.trace_dir=PATH, or null for no trace"
            _fail("trace_dir", self.trace_dir, "must be a directory path", fix)

    def _validate_shared_expert(self) -> None:
        """The shared expert's width and gate."""
        if self.shared_expert_ffn_hidden_size is not None:
            _positive_int("shared_expert_ffn_hidden_size", self.shared_expert_ffn_hidden_size)
        elif self.shared_expert_gate:
            _fail(
                "shared_expert_gate",
                True,
                "there is no shared expert",
                "set moe.shared_expert_ffn_hidden_size or moe.shared_expert_gate=false",
            )

    def _validate_backend_recipe(self) -> None:
        """The expert backend × FP8 recipe pairs no machine runs (what a given machine runs is
        :func:`folding.moe.experts.select.check_backend`'s, with the device), and what needs a recipe."""
        if not isinstance(self.fp8_act_input_store, bool):
            _fail("fp8_act_input_store", self.fp8_act_input_store, "must be true or false", "set it to true or false")
        if self.fp8_act_input_store and self.fp8_recipe is None:
            _fail(
                "fp8_act_input_store",
                True,
                "keeps the activation's input in the FP8 recipe's format and moe.fp8_recipe is null",
                "set moe.fp8_recipe (e.g. mxfp8 or blockwise), or moe.fp8_act_input_store=false",
            )
        if self.expert_backend == "emulated" and self.fp8_recipe is None:
            _fail(
                "expert_backend",
                "emulated",
                "emulates an FP8 recipe and moe.fp8_recipe is null",
                "set moe.fp8_recipe (e.g. mxfp8), or moe.expert_backend=loop",
            )
        if self.expert_backend == "loop" and self.fp8_recipe is not None:
            _fail(
                "expert_backend",
                "loop",
                f"computes in high precision, not moe.fp8_recipe={self.fp8_recipe!r}",
                "use moe.expert_backend='emulated', 'torch' or 'te' (or auto), or moe.fp8_recipe=null",
            )

    def _validate_replicas(self) -> None:
        R = self.expert_replicas
        if isinstance(R, bool) or not isinstance(R, int) or R < 0:
            _fail("expert_replicas", R, "must be an integer >= 0", "set moe.expert_replicas=0 (off) or e.g. 2")
        _positive_int("replica_interval", self.replica_interval)
        if R == 0:
            return
        if self.dispatcher == "hierarchical":
            _fail(
                "expert_replicas",
                R,
                "hot-expert replicas are not planned with the hierarchical dispatcher's node split",
                "set moe.expert_replicas=0 or moe.dispatcher=alltoall",
            )
        if self.pad_to_capacity:
            _fail(
                "expert_replicas",
                R,
                "pad_to_capacity gives every expert a static row count, which a split expert cannot keep",
                "set moe.pad_to_capacity=false or moe.expert_replicas=0",
            )
        if self.expert_backend == "te":
            _fail(
                "expert_replicas",
                R,
                "the te expert backend has a fixed number of local experts",
                "set moe.expert_backend=torch (or loop, emulated, auto off GPU) or moe.expert_replicas=0",
            )
        if self.fp8_recipe == "delayed":
            _fail(
                "expert_replicas",
                R,
                "the delayed FP8 recipe keeps amax histories per expert slot, which a replica would not share",
                "use another moe.fp8_recipe or moe.expert_replicas=0",
            )

    def _validate_groups(self) -> None:
        G, g, E, k = self.num_groups, self.group_topk, self.num_experts, self.topk
        if G is None and g is None:
            if self.group_score_topk is not None:
                _fail(
                    "group_score_topk",
                    self.group_score_topk,
                    "needs group-limited routing",
                    "set moe.num_groups and moe.group_topk, or null",
                )
            return
        if G is None or g is None:
            missing = "num_groups" if G is None else "group_topk"
            _fail(
                missing,
                None,
                "group-limited routing needs both moe.num_groups and moe.group_topk",
                f"set moe.{missing} or set both to null",
            )
        _positive_int("num_groups", G)
        _positive_int("group_topk", g)
        if E % G:
            _fail("num_groups", G, f"does not divide moe.num_experts={E}", "use a divisor of num_experts")
        if g > G:
            _fail("group_topk", g, f"exceeds moe.num_groups={G}", f"set moe.group_topk <= {G}")
        n = self.group_score_topk
        if n is not None:
            _positive_int("group_score_topk", n)
            if n > E // G:
                _fail(
                    "group_score_topk",
                    n,
                    f"exceeds the {E // G} experts of a group",
                    "lower moe.group_score_topk or moe.num_groups",
                )
        elif g > k:
            _fail(
                "group_topk",
                g,
                f"exceeds moe.topk={k}: a group is scored by its top topk//group_topk experts, which would be none",
                f"set moe.group_topk <= {k} or set moe.group_score_topk",
            )
        elif k // g > E // G:
            _fail(
                "topk",
                k,
                f"topk//group_topk={k // g} exceeds the {E // G} experts of a group",
                "raise moe.group_topk or lower moe.num_groups",
            )
        if g * (E // G) < k:
            _fail(
                "group_topk",
                g,
                f"the {g} kept groups hold {g * (E // G)} experts, fewer than moe.topk={k}",
                "raise moe.group_topk",
            )
