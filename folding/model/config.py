"""Architecture of a decoder-only MoE transformer (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) and its parameter count.

A :class:`ModelConfig` says *what* the model is, never how it is parallelized. Presets with the
published hyper-parameters live in :mod:`folding.model.presets`.

Usage::

    from folding.model.presets import get_preset
    cfg = get_preset("mixtral_8x7b")
    total, active = cfg.num_parameters()      # 46.7e9, 12.9e9
    cfg.is_moe_layer(0)                       # True
    cfg.moe.topk                              # 2: every MoE option lives in cfg.moe
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal, Optional, Tuple, get_args

from ..memory.offload_modules import OFFLOAD_MODULES  # noqa: F401 - for planning
from ..moe.config import FP8_ROW_ALIGN, MoEConfig  # noqa: F401 - FP8_ROW_ALIGN for the planner
from .mla_config import MLAConfig
from .recompute import (  # noqa: F401 - for planning
    RECOMPUTE,
    RECOMPUTE_MODES,
    RECOMPUTE_MODULES,
    Recompute,
    offload_conflict,
    recompute_mode,
    recompute_spec,
)
from .yarn_config import YarnConfig

Family = Literal["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3"]
FAMILIES = get_args(Family)
QKNorm = Literal["none", "head", "full"]
QK_NORMS = get_args(QKNorm)


def _per_rank(n: int, ranks: int, what: str) -> int:
    """``n / ranks``; ``ValueError`` naming ``what`` when ``ranks`` does not divide ``n``."""
    if n % ranks:
        raise ValueError(f"{what}={n} is not divisible by {ranks}; choose sizes that divide evenly")
    return n // ranks


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Hyper-parameters of a decoder-only MoE transformer (field names follow Megatron-Core where they exist)."""

    name: str
    """Preset name (``mixtral_8x7b``, ``mixtral_tiny``, ...)."""
    family: Family
    """``mixtral``, ``qwen2_moe``, ``qwen3_moe``, ``olmoe`` or ``deepseek_v3``: selects the Hugging Face
    mapping (tensor names, ``config.json`` fields); the architecture itself is fixed by the other fields
    (``mla`` and ``yarn`` for DeepSeek-V3's attention)."""
    vocab_size: int
    """Vocabulary size of the tokenizer / checkpoint (before padding: :attr:`padded_vocab_size`)."""
    hidden_size: int
    """Model width H."""
    num_layers: int
    """Number of transformer layers."""
    num_attention_heads: int
    """Query heads."""
    num_kv_heads: int
    """Key/value heads (GQA); must divide ``num_attention_heads``."""
    head_dim: Optional[int] = None
    """Per-head width; ``None`` means ``hidden_size // num_attention_heads``."""
    ffn_hidden_size: int = 0
    """FFN width of dense (non-MoE) layers; 0 when every layer is MoE."""
    moe: MoEConfig
    """Every option of the MoE layers (:class:`folding.moe.config.MoEConfig`: experts, top-k, expert FFN
    width, router, capacity, losses, dispatcher, experts' backend, shared expert), the one record of
    them; the Hydra keys ``moe.*``."""
    decoder_sparse_step: int = 1
    """Every ``decoder_sparse_step``-th layer is MoE (Qwen2/Qwen3-MoE: layer i is MoE when (i+1) % step == 0)."""
    mlp_only_layers: Tuple[int, ...] = ()
    """Layer indices that use a dense MLP whatever the sparse step (Qwen2-MoE, Qwen3-MoE)."""
    qkv_bias: bool = False
    """Bias on the q/k/v projections (Qwen2-MoE)."""
    qk_norm: QKNorm = "none"
    """RMSNorm of the queries and keys after their projections, before RoPE: ``none``; ``head``
    (Qwen3-MoE) normalizes each head's vector, one weight of size ``head_dim`` shared by all heads
    (one for q, one for k); ``full`` (OLMoE) normalizes each token's whole q projection output
    (weight ``num_attention_heads·head_dim``) and whole k projection output (weight
    ``num_kv_heads·head_dim``), so under TP the sum of squares is all-reduced over the heads' ranks."""
    rope_theta: float = 10000.0
    """RoPE base."""
    max_position_embeddings: int = 4096
    """Longest supported sequence."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    tie_embeddings: bool = False
    """Share the input embedding and the output layer weight."""
    init_std: float = 0.02
    """Standard deviation of the normal initialization."""
    make_vocab_size_divisible_by: int = 1
    """The embedding table and the output layer have :attr:`padded_vocab_size` rows: ``vocab_size``
    rounded up to a multiple of this (Megatron-LM's ``--make-vocab-size-divisible-by``; Megatron-LM
    multiplies it by TP, which :mod:`folding.interop.megatron` writes out, so that the padding is a
    property of the model and checkpoints keep their shapes under any layout). The padded rows are
    never predicted (their logits are ``-inf``) and never exported to Hugging Face. 1: no padding."""
    hidden_dropout: float = 0.0
    """Dropout rate of the embedding output, the attention output projection and the MLP / MoE block
    output, before the residual add (Megatron-LM's ``hidden_dropout`` and placement). Masks depend on the
    seed, the layer, the sample, the position and the column only, so every layout drops the same
    elements (:mod:`folding.model.dropout`). None in eval mode. 0: off."""
    attention_dropout: float = 0.0
    """Dropout rate of the attention probabilities (Megatron-LM's ``attention_dropout``); above 0 the
    attention core runs unfused (:mod:`folding.model.dropout`). 0: off."""
    mla: Optional[MLAConfig] = None
    """Multi-head latent attention (DeepSeek-V3, :class:`~folding.model.mla_config.MLAConfig`);
    ``None``: GQA attention. Needs ``num_kv_heads == num_attention_heads``."""
    yarn: Optional[YarnConfig] = None
    """YaRN RoPE scaling (:class:`~folding.model.rope_yarn.YarnConfig`); ``None``: default RoPE."""
    mtp_num_layers: int = 0
    """Multi-token prediction depth D (DeepSeek-V3: 1; Hugging Face ``num_nextn_predict_layers``): D
    modules after the last layer, module k predicting the token k+1 positions ahead from module k-1's
    hidden states (the final-normed model output for k=1) and the embedding of the token k positions
    ahead; each has its own two input norms, a ``2H -> H`` projection, one transformer layer (layer
    number ``num_layers + k - 1``) and an output norm, and shares the embedding and output layer with
    the model. They sit on the last pipeline stage (:mod:`folding.model.mtp`). 0: none."""
    mtp_loss_scaling_factor: float = 0.1
    """Weight of the multi-token-prediction loss: the objective adds ``mtp_loss_scaling_factor / D``
    times the sum of the D modules' masked token losses, over the same global token count as the LM
    loss (Megatron-Core's ``mtp_loss_scaling_factor`` with per-token loss)."""

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"model.family={self.family!r}: choose one of {FAMILIES}")
        for f in (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_attention_heads",
            "num_kv_heads",
            "decoder_sparse_step",
        ):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"model.{f}={v!r} must be an integer >= 1")
        if self.num_attention_heads % self.num_kv_heads:
            raise ValueError(
                f"model.num_kv_heads={self.num_kv_heads} must divide "
                f"model.num_attention_heads={self.num_attention_heads}"
            )
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"model.hidden_size={self.hidden_size} is not divisible by "
                f"model.num_attention_heads={self.num_attention_heads}; set model.head_dim"
            )
        if isinstance(self.mtp_num_layers, bool) or not isinstance(self.mtp_num_layers, int) or self.mtp_num_layers < 0:
            raise ValueError(f"model.mtp_num_layers={self.mtp_num_layers!r} must be an integer >= 0 (0: no MTP)")
        if not math.isfinite(self.mtp_loss_scaling_factor) or self.mtp_loss_scaling_factor < 0:
            raise ValueError(
                f"model.mtp_loss_scaling_factor={self.mtp_loss_scaling_factor!r} must be a finite number >= 0"
            )
        for f in ("hidden_dropout", "attention_dropout"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= v < 1.0:
                raise ValueError(f"model.{f}={v!r} must be a number in [0, 1) (0: no dropout; Megatron-LM's is 0.1)")
        n = self.make_vocab_size_divisible_by
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"model.make_vocab_size_divisible_by={n!r} must be an integer >= 1 (1: no padding)")
        if self.qk_norm not in QK_NORMS:
            raise ValueError(f"model.qk_norm={self.qk_norm!r}: choose one of {QK_NORMS}")
        if self.mla is not None and self.num_kv_heads != self.num_attention_heads:
            raise ValueError(
                f"model.num_kv_heads={self.num_kv_heads}: multi-head latent attention (model.mla) has one "
                f"key/value per query head; set it to model.num_attention_heads={self.num_attention_heads}"
            )
        if self.mla is not None and self.qk_norm != "none":
            raise ValueError(
                f"model.qk_norm={self.qk_norm!r} with multi-head latent attention (model.mla): MLA normalizes "
                "its latents instead; set model.qk_norm=none"
            )
        if not isinstance(self.moe, MoEConfig):
            raise ValueError(f"model.moe={self.moe!r} must be a folding.moe.config.MoEConfig")
        if any(not self.is_moe_layer(i) for i in self.layer_numbers()) and self.ffn_hidden_size < 1:
            raise ValueError(
                "model.ffn_hidden_size must be >= 1 when some layers are dense "
                "(model.mlp_only_layers / model.decoder_sparse_step)"
            )

    # ------------------------------------------------------------------------------ derived
    @property
    def kv_channels(self) -> int:
        """Per-head width (``head_dim`` or ``hidden_size // num_attention_heads``)."""
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def padded_vocab_size(self) -> int:
        """Rows of the embedding table and the output layer: ``vocab_size`` rounded up to a multiple of
        ``make_vocab_size_divisible_by``."""
        n = self.make_vocab_size_divisible_by
        return -(-self.vocab_size // n) * n

    @property
    def output_init_std(self) -> float:
        """Std of the projections that write into the residual stream (attention output, dense and
        expert fc2): ``init_std / sqrt(2 · num_layers)`` (Megatron-Core's scaled init)."""
        return self.init_std / math.sqrt(2.0 * self.num_layers)

    def is_moe_layer(self, i: int) -> bool:
        """Whether layer ``i`` (0-based) has an MoE block rather than a dense MLP."""
        return i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0

    def num_moe_layers(self) -> int:
        """Number of MoE layers of the decoder (without the multi-token-prediction layers)."""
        return sum(self.is_moe_layer(i) for i in range(self.num_layers))

    def layer_numbers(self) -> range:
        """Every transformer layer's number: the decoder's ``0 .. num_layers-1``, then the
        multi-token-prediction layers' ``num_layers .. num_layers + mtp_num_layers - 1``."""
        return range(self.num_layers + self.mtp_num_layers)

    # ------------------------------------------------------------------------------ parameter counts
    # One formula per part, for the whole model (``tp=1``, ...) and for what one rank holds under tensor
    # and expert parallelism (the planner's memory model, :mod:`folding.planning.memory`).
    def attention_params(self, tp: int = 1) -> int:
        """Parameters of one attention block and its input norm on each of ``tp`` tensor-parallel ranks
        (``tp=1``: the whole block). The norm and per-head q/k norms (``qk_norm="head"``) are replicated;
        the q/k/v/o projections, their biases and whole-projection q/k norms (``"full"``) are split by
        heads; multi-head latent attention splits as :class:`~folding.model.mla_config.MLAConfig` says."""
        H, d, h, kv = self.hidden_size, self.kv_channels, self.num_attention_heads, self.num_kv_heads
        if self.mla is not None:
            heads = _per_rank(h, tp, "num_attention_heads")
            return H + self.mla.replicated_params(hidden_size=H) + heads * self.mla.head_params(hidden_size=H)
        proj = H * d * (h + 2 * kv) + d * h * H + (d * (h + 2 * kv) if self.qkv_bias else 0)
        n = H + _per_rank(proj, tp, "attention size")
        if self.qk_norm == "head":
            n += 2 * d
        elif self.qk_norm == "full":
            n += _per_rank((h + kv) * d, tp, "q/k norm size")
        return n

    def router_params(self) -> int:
        """Parameters of one MoE layer's router (its gating weight ``[E, H]``, replicated, kept in fp32)."""
        return self.moe.num_experts * self.hidden_size

    def expert_params(self, etp: int = 1) -> int:
        """Parameters of one routed expert (SwiGLU: gate, up, down) on each of ``etp`` expert-tensor-parallel
        ranks."""
        return _per_rank(3 * self.hidden_size * self.moe.ffn_hidden_size, etp, "3*H*moe_ffn_hidden_size")

    def routed_experts_params(self, *, ep: int = 1, etp: int = 1) -> int:
        """Parameters of one MoE layer's routed experts on one rank of ``ep`` expert-parallel by ``etp``
        expert-tensor-parallel ranks (``ep=etp=1``: all of them)."""
        return _per_rank(self.moe.num_experts, ep, "num_experts") * self.expert_params(etp)

    def shared_expert_params(self, tp: int = 1) -> int:
        """Parameters of the shared expert (a SwiGLU split over ``tp`` ranks) and its sigmoid gate
        (replicated); 0 without one."""
        f = self.moe.shared_expert_ffn_hidden_size
        if not f:
            return 0
        mlp = _per_rank(3 * self.hidden_size * f, tp, "shared_expert_ffn_hidden_size*H")
        return mlp + (self.hidden_size if self.moe.shared_expert_gate else 0)

    def dense_mlp_params(self, tp: int = 1) -> int:
        """Parameters of a dense layer's SwiGLU MLP (width ``ffn_hidden_size``) on each of ``tp`` ranks."""
        return _per_rank(3 * self.hidden_size * self.ffn_hidden_size, tp, "ffn_hidden_size*H")

    def layer_params(self, i: int, tp: int = 1) -> int:
        """Parameters of transformer layer ``i`` besides its routed experts, on each of ``tp``
        tensor-parallel ranks: the attention block with its input norm, the pre-MLP norm, and the router and
        shared expert (MoE layer) or the dense MLP."""
        n = self.attention_params(tp) + self.hidden_size
        if self.is_moe_layer(i):
            return n + self.router_params() + self.shared_expert_params(tp)
        return n + self.dense_mlp_params(tp)

    def embedding_params(self, tp: int = 1) -> int:
        """Parameters of the input embedding (or of the output layer, the same shape) on each of ``tp``
        ranks (split by vocabulary rows, the padding included)."""
        what = "model.vocab_size padded by model.make_vocab_size_divisible_by"
        return _per_rank(self.padded_vocab_size, tp, what) * self.hidden_size

    def mtp_params(self) -> int:
        """Parameters of the multi-token-prediction modules beyond their transformer layers: per module
        two input norms, the ``2H -> H`` projection and the output norm, replicated over TP (embedding
        and output layer are the model's)."""
        H = self.hidden_size
        return self.mtp_num_layers * (2 * H * H + 3 * H)

    def num_parameters(self) -> Tuple[int, int]:
        """``(total, active)`` parameter counts; active counts ``topk`` routed experts per token. The
        multi-token-prediction modules are included (DeepSeek-V3: 671.0e9 without, 682.6e9 with; its
        checkpoint's 685e9 also counts its copies of the embedding and output layer)."""
        emb = self.embedding_params() * (1 if self.tie_embeddings else 2) + self.hidden_size  # + final norm
        total = active = emb + self.mtp_params()
        for i in self.layer_numbers():
            total += self.layer_params(i)
            active += self.layer_params(i)
            if self.is_moe_layer(i):
                total += self.routed_experts_params()
                active += self.moe.topk * self.expert_params()
        return total, active

    def check_divisible(self, *, tp: int = 1, ep: int = 1, etp: int = 1) -> None:
        """Raise ``ValueError`` naming the ``parallel.*`` setting and a fix when a layout's sizes do not
        divide this architecture: heads, KV heads, vocabulary and shared-expert width by TP; routed
        experts by EP; the expert FFN width by ETP. The one check of the model against a layout (the
        job's validation and :class:`~folding.model.transformer.MoETransformer` both call it)."""
        sizes = [
            ("parallel.tp", tp, "model.num_attention_heads", self.num_attention_heads),
            ("parallel.tp", tp, "model.num_kv_heads", self.num_kv_heads),
            ("parallel.tp", tp, "model.vocab_size", self.padded_vocab_size),
        ]
        if any(self.is_moe_layer(i) for i in self.layer_numbers()):
            sizes += [
                ("parallel.ep", ep, "moe.num_experts", self.moe.num_experts),
                ("parallel.etp", etp, "moe.ffn_hidden_size", self.moe.ffn_hidden_size),
            ]
            if self.moe.shared_expert_ffn_hidden_size:
                sizes.append(
                    ("parallel.tp", tp, "moe.shared_expert_ffn_hidden_size", self.moe.shared_expert_ffn_hidden_size)
                )
        for setting, size, key, n in sizes:
            if key == "model.vocab_size" and n % size and n != self.vocab_size:  # the padded vocabulary
                raise ValueError(
                    f"model.vocab_size={self.vocab_size} (padded to {n}) is not divisible by parallel.tp={size}; "
                    f"set model.make_vocab_size_divisible_by to a multiple of {size} (Megatron-LM pads to "
                    f"128 x TP) or choose parallel.tp among the divisors of {n}"
                )
            if n % size:
                raise ValueError(
                    f"{key}={n} is not divisible by {setting}={size}; choose {setting} among the divisors of {n}"
                )

    def __hash__(self) -> int:
        """The hash of every field, as a frozen dataclass's, computed once per record: the planner keys its
        caches by the config hundreds of thousands of times per run, and the nested records make each hash
        a walk over them. Not pickled (string hashes differ between processes)."""
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = hash(tuple(getattr(self, f.name) for f in dataclasses.fields(self)))
            object.__setattr__(self, "_hash", cached)
        return cached

    def __getstate__(self) -> dict:
        """The fields, without the cached hash (see :meth:`__hash__`)."""
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}

    @classmethod
    def from_dict(cls, values: dict) -> "ModelConfig":
        """The config of a plain dict such as ``dataclasses.asdict(cfg)`` read back from JSON (the MoE
        record nested under ``moe``; lists where the config holds tuples)."""
        values = dict(values)
        values["moe"] = MoEConfig(**values["moe"])
        for key, record in (("mla", MLAConfig), ("yarn", YarnConfig)):
            if isinstance(values.get(key), dict):
                values[key] = record(**values[key])
        values["mlp_only_layers"] = tuple(values.get("mlp_only_layers") or ())
        return cls(**values)

    def for_inference(self) -> "ModelConfig":
        """This model without the training-only MoE options (:meth:`MoEConfig.for_inference`): what
        export, generation and conversion build from a checkpoint's config."""
        return dataclasses.replace(self, moe=self.moe.for_inference())

    def replace(self, **changes) -> "ModelConfig":
        """A copy with ``changes`` applied (validated again). ``moe`` may be a :class:`MoEConfig` or a
        mapping of MoE field changes (``cfg.replace(moe={"topk": 4})``); so may ``mla`` and ``yarn``."""
        names = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(changes) - names)
        if unknown:
            moe_names = {f.name for f in dataclasses.fields(MoEConfig)}
            hint = [f"moe={{{k!r}: ...}}" for k in unknown if k in moe_names]
            raise ValueError(
                f"unknown ModelConfig field(s) {unknown}"
                + (f"; MoE options go in the moe record: {', '.join(hint)}" if hint else "")
                + f"; fields: {', '.join(sorted(names))}"
            )
        moe = changes.get("moe")
        if moe is not None and not isinstance(moe, MoEConfig):
            changes["moe"] = self.moe.replace(**dict(moe))
        for key, record in (("mla", MLAConfig), ("yarn", YarnConfig)):
            if changes.get(key) is not None and not isinstance(changes[key], record):
                old = getattr(self, key)
                changes[key] = record(**{**(dataclasses.asdict(old) if old is not None else {}), **dict(changes[key])})
        return dataclasses.replace(self, **changes)
