"""The decoder-only MoE transformer (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE): embedding, layers, final norm, output.

Parallelism comes from the ``parallel_state`` (attention TP with sequence parallelism, CP with
load-balanced chunks, MoE EP/ETP inside the MoE blocks); the same code runs on 1 rank.

Forward contract (``model(input_ids_BS, labels=None, loss_mask=None, sample_index=None)``):

- ``input_ids_BS``: the micro-batch's **full** sequences ``[B, S]`` (the same on all TP and CP ranks
  of one data-parallel replica). The model keeps this CP rank's load-balanced positions
  (:meth:`local_positions`), then splits them over TP (sequence parallelism).
- Without ``labels``: logits ``[B, S/CP, V/TP]``: this CP rank's positions (in
  :meth:`local_positions` order), this TP rank's vocabulary slice. On 1 rank: ``[B, S, V]``.
- With ``labels [B, S]`` (full, like the ids): the fp32 per-token loss ``[B, S/CP]`` at this CP
  rank's positions, computed by vocab-parallel cross-entropy (no rank holds full logits),
  multiplied by ``loss_mask [B, S]`` when given; identical on every TP rank. The training loss is
  ``loss.sum() / global_token_count`` (global count of unmasked tokens over DP x CP), whose
  gradients are then summed over DP x CP (dense) and EDP (experts). With multi-token prediction
  (``config.mtp_num_layers = D > 0``, :mod:`folding.model.mtp`) the per-token loss at position i is
  ``lm_i + mtp_loss_scaling_factor / D · sum_k mtp_k,i``, where ``mtp_k,i`` is depth k's masked loss
  for the token i+k+1 (``stage_forward(..., loss_parts=True)`` returns the two parts); in eval mode
  (``model.eval()``) the MTP modules do not run and the loss is the LM loss.
- ``sample_index [B]``: each sequence's global sample index, needed in training mode when
  ``model.hidden_dropout`` or ``model.attention_dropout`` is above 0 (the masks are a function of it,
  of the layer, the position and the column: :mod:`folding.model.dropout`).
- With ``model.make_vocab_size_divisible_by`` the vocabulary dimension is the padded one
  (``config.padded_vocab_size``); the padded ids' logits are ``-inf`` and never predicted.

Pipeline stages cut the model at ``embedding`` / ``layers[i:j]`` / ``final_norm`` + ``output_layer``
(+ the MTP modules): :meth:`embed`, :meth:`run_layers` and :meth:`head` are those pieces.

Usage::

    model = MoETransformer(get_preset("mixtral_tiny"), parallel_state=ps, settings=LayerSettings(init_seed=1))
    loss_BS = model(ids_BS, labels=labels_BS, loss_mask=mask_BS)
    (loss_BS.sum() / global_tokens).backward()
"""

from __future__ import annotations

import contextlib
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from ..memory.offload import Offloader
from ..moe.experts.te import fp8_region
from ..moe.settings import LayerSettings
from ..parallel.collectives import group_rank, group_size
from ..parallel.groups import ProcessGroups
from ..parallel.linear import sp_gather
from ..parallel.params import initialize_parameters, mark_param, set_init_spec
from .block import MoEFactory, TransformerLayer
from .config import ModelConfig
from .context_parallel import check_cp_seq_len, cp_positions, gathered_positions
from .dropout import DropoutKeys, hidden_dropout
from .embedding import VocabParallelEmbedding
from .fused_cross_entropy import fused_linear_cross_entropy, mask_padding
from .moe_block import check_moe_factory, default_moe_factory
from .mtp import MTPModule, shift_left
from .norm import RMSNorm
from .rope_yarn import model_rope_cos_sin


class MoETransformer(nn.Module):
    """Decoder-only MoE language model; see the module docstring for the forward contract.

    Args:
        config: the architecture.
        parallel_state: a :class:`~folding.parallel.ParallelState`, or ``None`` for 1 rank.
        settings: how every layer is built and run (:class:`~folding.moe.settings.LayerSettings`):
            ``init_seed`` (the layout-independent initialization), ``device`` and ``params_dtype``
            (``meta`` skips init), ``recompute``, the MoE layers' ``overlap_comm`` and
            ``delay_wgrad``, and ``expert_backend`` (resolved here, once, from ``config.moe`` when
            not given). Handed whole to every layer and MoE block factory at construction.
        moe_factory: builds MoE blocks (default: :func:`folding.model.moe_block.default_moe_factory`;
            its contract: :mod:`folding.model.moe_block`).
        initialize: fill parameters now (set False when weights are loaded right after).
        loss_chunk_tokens: with labels, the output layer and the cross-entropy run fused, this many
            tokens at a time (:mod:`folding.model.fused_cross_entropy`): fp32 logits of the whole
            micro-batch never exist. Larger chunks: fewer, bigger GEMMs and more transient memory.
        layer_range: ``[start, end)`` of the decoder layers this pipeline chunk holds (default: all of
            them); empty for a virtual stage without transformer layers (``parallel.pipeline_layout``).
        pre_process / post_process: whether the chunk is the first virtual stage (the embedding) / the
            last (final norm, output layer, multi-token prediction); ``None``: whether ``layer_range``
            starts at layer 0 / ends at the last layer. Required with an empty ``layer_range``.
    """

    def __init__(
        self,
        config: ModelConfig,
        *,
        parallel_state=None,
        settings: LayerSettings = LayerSettings(),
        moe_factory: Optional[MoEFactory] = None,
        initialize: bool = True,
        layer_range: Optional[Tuple[int, int]] = None,
        loss_chunk_tokens: int = 2048,
        pre_process: Optional[bool] = None,
        post_process: Optional[bool] = None,
    ):
        super().__init__()
        if loss_chunk_tokens < 1:
            raise ValueError(f"loss_chunk_tokens={loss_chunk_tokens} must be >= 1 (tokens per fused loss chunk)")
        self.loss_chunk_tokens = loss_chunk_tokens
        if layer_range is None:
            if parallel_state is not None and parallel_state.layout.pp > 1:
                raise ValueError(
                    "with parallel.pp > 1 build this rank's pipeline chunks with "
                    "folding.model.chunks.build_stage_chunks (or pass layer_range=)"
                )
            layer_range = (0, config.num_layers)
        start, end = layer_range
        if not 0 <= start <= end <= config.num_layers or (start == end and None in (pre_process, post_process)):
            raise ValueError(
                f"layer_range={layer_range} is not a range of the {config.num_layers} layers (an empty one "
                "needs pre_process= and post_process=: which ends of the model the stage holds)"
            )
        self.pre_process = start == 0 if pre_process is None else pre_process
        self.post_process = end == config.num_layers if post_process is None else post_process
        if (self.pre_process and start) or (self.post_process and end != config.num_layers):
            raise ValueError(
                f"layer_range={layer_range}: the first stage starts at layer 0, the last one ends after the last layer"
            )
        self.layer_range = (start, end)
        self.config = config
        self.groups = parallel_state.groups if parallel_state is not None else ProcessGroups.single()
        if moe_factory is None:
            moe_factory = default_moe_factory
        check_moe_factory(moe_factory)
        self.check_layout()
        settings = settings.with_expert_backend(config.moe)  # decided once, for every MoE layer
        self.settings = settings
        """The :class:`~folding.moe.settings.LayerSettings` every layer was built with."""
        device, init_seed = settings.device, settings.init_seed
        kw = dict(device=device, dtype=settings.params_dtype)
        g = self.groups
        # The last stage of a pipeline with tied embeddings, or with multi-token prediction (which
        # embeds the tokens ahead), holds its own copy of the table (the same init seed gives the same
        # values); the two copies' gradients are summed over the embedding group (first + last stage).
        shared_table = config.tie_embeddings or config.mtp_num_layers > 0
        if self.pre_process or (self.post_process and shared_table):
            self.embedding = VocabParallelEmbedding(
                config.padded_vocab_size,
                config.hidden_size,
                tp_group=g.tp,
                init_std=config.init_std,
                tied=shared_table,
                **kw,
            )
        else:
            self.embedding = None
        offload = frozenset(m for m in settings.offload_modules.split(",") if m)
        self.offloader = Offloader(offload, self.parameters) if offload else None
        """The chunk's activation offloader (``train.offload_modules``; ``None`` without offload modules)."""
        lk = dict(groups=g, moe_factory=moe_factory, settings=settings, offloader=self.offloader)
        # keyed by the global layer index, so parameter names do not depend on the pipeline cut
        self.layers = nn.ModuleDict({str(i): TransformerLayer(config, layer_number=i, **lk) for i in range(start, end)})
        self.final_norm = RMSNorm(config.hidden_size, eps=config.norm_eps, **kw) if self.post_process else None
        # multi-token prediction: on the last stage, after the final norm (folding.model.mtp)
        self.mtp = (
            nn.ModuleList(MTPModule(config, depth=k, **lk) for k in range(1, config.mtp_num_layers + 1))
            if self.post_process and config.mtp_num_layers
            else None
        )
        if config.tie_embeddings or not self.post_process:
            self.output_weight = None
        else:
            tp, r = group_size(g.tp), group_rank(g.tp)
            V = config.padded_vocab_size
            self.output_weight = nn.Parameter(torch.empty(V // tp, config.hidden_size, **kw))
            mark_param(self.output_weight, tp_sharded=True)
            set_init_spec(
                self.output_weight,
                full_shape=(V, config.hidden_size),
                shards=((0, r, tp),),
                std=config.init_std,
            )
        if initialize and init_seed is not None and torch.device(device or "cpu").type != "meta":
            initialize_parameters(self, init_seed)

    # ------------------------------------------------------------------------------ checks
    def check_layout(self) -> None:
        """Raise a clear error if the layout does not divide the architecture (:meth:`ModelConfig.check_divisible`)."""
        g = self.groups
        self.config.check_divisible(tp=g.tp_size, ep=group_size(g.ep), etp=group_size(g.etp))

    def local_positions(self, seq_len: int, device=None) -> torch.Tensor:
        """Sequence positions held by this CP rank (before the TP split), in the model's order."""
        return cp_positions(seq_len, self.groups.cp_rank, self.groups.cp_size, device)

    # ------------------------------------------------------------------------------ pieces
    def embed(self, input_ids_BS: torch.Tensor, dropout: Optional[DropoutKeys] = None) -> torch.Tensor:
        """Full ids ``[B, S]`` -> this rank's hidden shard ``[S/(CP*TP), B, H]``; ``dropout``: the
        micro-batch's keys bound to a layer (:meth:`dropout_keys`), for the embedding dropout."""
        pos = self.local_positions(input_ids_BS.shape[1], input_ids_BS.device)
        return hidden_dropout(self.embedding(input_ids_BS[:, pos]), dropout, "embedding")

    def dropout_keys(self, seq_len: int, sample_index: Optional[torch.Tensor]) -> Optional[DropoutKeys]:
        """The micro-batch's :class:`~folding.model.dropout.DropoutKeys`, or ``None`` in eval mode or
        when both ``model.hidden_dropout`` and ``model.attention_dropout`` are 0. ``sample_index``: the
        global sample index of each sequence (int64 ``[B]``, the data sampler's ``sample_index``),
        required when dropout is on: it makes each sequence's masks its own at every step."""
        cfg = self.config
        if not self.training or not (cfg.hidden_dropout or cfg.attention_dropout):
            return None
        if sample_index is None:
            raise ValueError(
                "model.hidden_dropout / model.attention_dropout need each sequence's global sample index: "
                "pass sample_index= (the data sampler's, a different one for every sequence of every step) "
                "or call model.eval()"
            )
        pos_S = self.local_positions(seq_len, sample_index.device)
        n = pos_S.shape[0] // self.groups.tp_size
        r = group_rank(self.groups.tp)
        return DropoutKeys(
            hidden=cfg.hidden_dropout,
            attention=cfg.attention_dropout,
            seed=self.settings.init_seed or 0,
            sample_B=sample_index.to(torch.int64),
            positions_S=pos_S[r * n : (r + 1) * n],
            query_positions_S=pos_S,
        )

    def rope(self, seq_len: int, device=None, dtype=None):
        """``(cos, sin, kv_order, chunk_starts)`` for this CP rank at sequence length ``seq_len``.

        ``cos``/``sin`` are computed in fp32 and returned in ``dtype`` (the activations' dtype; ``None``:
        fp32): cast once per micro-batch, so that no layer makes its own copies of the tables.
        ``kv_order`` sorts CP-gathered keys into sequence order (``None`` without CP);
        ``chunk_starts`` are the first positions of this rank's chunks.
        """
        q_pos = self.local_positions(seq_len, device)
        cos, sin = model_rope_cos_sin(q_pos, self.config)  # default RoPE or YaRN; MLA: its rotary dims
        if dtype is not None:
            cos, sin = cos.to(dtype), sin.to(dtype)
        cp = self.groups.cp_size
        if cp == 1:
            return cos, sin, None, (0,)
        kv_order = torch.argsort(gathered_positions(seq_len, cp, device))
        c = seq_len // (2 * cp)
        return cos, sin, kv_order, (int(q_pos[0]), int(q_pos[c]))

    def transformer_layers(self):
        """This chunk's transformer layers in order: its decoder layers, then the MTP modules' layers."""
        return list(self.layers.values()) + [m.layer for m in (self.mtp or ())]

    def run_layers(
        self, x_SBH: torch.Tensor, seq_len: int, rope=None, dropout: Optional[DropoutKeys] = None
    ) -> torch.Tensor:
        """Every layer this model holds (its ``layer_range``), in order, on a hidden shard; ``rope``:
        :meth:`rope` at ``seq_len`` (computed when not given); ``dropout``: :meth:`dropout_keys`."""
        rope = self.rope(seq_len, x_SBH.device, x_SBH.dtype) if rope is None else rope
        with self._offload_pass():
            for i in range(*self.layer_range):
                x_SBH = self.layers[str(i)](x_SBH, rope, dropout)
        return x_SBH

    def _offload_pass(self):
        """One forward pass of this chunk's layers for the offloader (prefetching links layer to layer)."""
        return self.offloader.forward_pass() if self.offloader is not None else contextlib.nullcontext()

    def head(self, x_SBH: torch.Tensor) -> torch.Tensor:
        """Final norm and output layer: ``[S/(CP*TP), B, H]`` -> contiguous logits ``[B, S/CP, V/TP]``.

        The hidden states (``H`` wide) are transposed to batch-major before the output GEMM, so the
        ``V``-wide logits are written once in the caller's layout instead of being transposed after.
        """
        w = self._output_weight()
        logits_BSV = F.linear(sp_gather(self.final_norm(x_SBH), self.groups.tp).transpose(0, 1), w)
        if self.config.padded_vocab_size == self.config.vocab_size:
            return logits_BSV
        # the padded rows' logits (model.make_vocab_size_divisible_by): -inf, never predicted
        return mask_padding(logits_BSV.clone(), group_rank(self.groups.tp) * w.shape[0], self.config.vocab_size)

    def _output_weight(self) -> torch.Tensor:
        """The output layer's weight ``[V/TP, H]`` (the embedding table when tied)."""
        return self.embedding.weight if self.output_weight is None else self.output_weight

    def _token_loss(self, h_SBH, labels_BS, loss_mask_BS, pos) -> torch.Tensor:
        """Per-token loss ``[B, S/CP]`` of normed hidden states ``h_SBH`` (this rank's shard) against the
        full ``labels_BS`` read at this CP rank's positions ``pos``, times ``loss_mask_BS`` (if any)."""
        h_SBH = sp_gather(h_SBH, self.groups.tp)
        Sl, B, H = h_SBH.shape
        loss_SB = fused_linear_cross_entropy(
            h_SBH.reshape(Sl * B, H),
            self._output_weight(),
            labels_BS[:, pos].t().reshape(-1),
            self.groups.tp,
            self.loss_chunk_tokens,
            vocab_size=self.config.vocab_size,
        ).view(Sl, B)
        loss_BS = loss_SB.t()
        if loss_mask_BS is not None:
            loss_BS = loss_BS * loss_mask_BS[:, pos].to(loss_BS.dtype)
        return loss_BS

    # ------------------------------------------------------------------------------ forward
    def forward(
        self,
        input_ids_BS: torch.Tensor,
        labels: Optional[torch.Tensor] = None,
        loss_mask: Optional[torch.Tensor] = None,
        sample_index: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Logits ``[B, S/CP, V/TP]`` or, with ``labels``, per-token losses ``[B, S/CP]`` (module docstring);
        ``sample_index`` (int64 ``[B]``): each sequence's global sample index, which dropout needs in
        training mode (:meth:`dropout_keys`)."""
        if input_ids_BS.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids_BS.shape)}")
        B, S = input_ids_BS.shape
        check_cp_seq_len(S, self.groups.cp_size, self.groups.tp_size)
        for name, t in (("labels", labels), ("loss_mask", loss_mask)):
            if t is not None and tuple(t.shape) != (B, S):
                raise ValueError(f"{name} must have the shape of input_ids {(B, S)}, got {tuple(t.shape)}")
        if not (self.pre_process and self.post_process):
            raise ValueError("forward() needs the whole model; a pipeline chunk runs stage_forward()")
        return self.stage_forward(input_ids_BS, labels=labels, loss_mask=loss_mask, sample_index=sample_index)

    def fp8_region_recipe(self) -> Optional[str]:
        """The FP8 recipe of this chunk's TransformerEngine region (None when no expert runs TE FP8)."""
        recipes = {
            r
            for m in self.modules()
            if m is not self and hasattr(m, "fp8_region_recipe")
            for r in [m.fp8_region_recipe()]
            if r is not None
        }
        if len(recipes) > 1:
            raise ValueError(f"one FP8 recipe per model: the experts use {sorted(recipes)}")
        return recipes.pop() if recipes else None

    def stage_forward(
        self,
        input_ids_BS: torch.Tensor,
        hidden_SBH: Optional[torch.Tensor] = None,
        labels: Optional[torch.Tensor] = None,
        loss_mask: Optional[torch.Tensor] = None,
        first_microbatch: Optional[bool] = None,
        loss_parts: bool = False,
        sample_index: Optional[torch.Tensor] = None,
    ):
        """Run this chunk: the first chunk embeds ``input_ids_BS``, later ones take ``hidden_SBH``
        from the previous stage; the last chunk returns what :meth:`forward` returns, the others the
        hidden shard ``[S/(CP*TP), B, H]`` for the next stage. ``input_ids_BS`` (full ``[B, S]``) is
        always given, for the sequence length. The whole chunk runs in one TransformerEngine FP8
        region when its experts use TE with a recipe (amax reduced over DP×CP on exit);
        ``first_microbatch`` (True on a step's first micro-batch) lets TE reuse FP8 weights.
        With ``labels`` and ``loss_parts=True`` the last chunk returns ``(lm_loss_BS, mtp_loss_BS)``
        instead of their weighted sum: the LM per-token loss and the mean over the MTP depths of
        their per-token losses (``None`` without multi-token prediction). ``sample_index``: the
        sequences' global sample indices, for dropout (:meth:`dropout_keys`)."""
        with fp8_region(
            self.fp8_region_recipe(), amax_reduction_group=self.groups.dp_cp, first_microbatch=first_microbatch
        ):
            out = self._stage_forward(input_ids_BS, hidden_SBH, labels, loss_mask, sample_index)
        if labels is None or not self.post_process or loss_parts:
            return out
        lm_BS, mtp_BS = out
        return lm_BS if mtp_BS is None else lm_BS + self.config.mtp_loss_scaling_factor * mtp_BS

    def _stage_forward(self, input_ids_BS, hidden_SBH, labels, loss_mask, sample_index):
        S = input_ids_BS.shape[1]
        drop = self.dropout_keys(S, sample_index)
        x = self.embed(input_ids_BS, drop) if self.pre_process else hidden_SBH
        if x is None:
            raise ValueError("a chunk that does not start at layer 0 needs hidden_SBH")
        rope = self.rope(S, input_ids_BS.device, x.dtype)  # once per micro-batch: decoder and MTP layers
        x = self.run_layers(x, S, rope, drop)
        if not self.post_process:
            return x
        if labels is None:
            return self.head(x)
        pos = self.local_positions(S, input_ids_BS.device)
        h_SBH = self.final_norm(x)
        lm_BS = self._token_loss(h_SBH, labels, loss_mask, pos)
        if self.mtp is None or not self.training:  # MTP is a training objective: eval skips it
            return lm_BS, None
        mask = torch.ones_like(labels) if loss_mask is None else loss_mask
        mtp_BS = torch.zeros_like(lm_BS)
        with self._offload_pass():
            for k, module in enumerate(self.mtp, 1):
                layer_drop = drop.at_layer(module.layer.layer_number) if drop is not None else None
                emb_SBH = self.embed(shift_left(input_ids_BS, k, 0), layer_drop)
                h_SBH = module(h_SBH, emb_SBH, rope, drop)
                mtp_BS = mtp_BS + self._token_loss(h_SBH, shift_left(labels, k, 0), shift_left(mask, k, 0), pos)
        return lm_BS, mtp_BS / len(self.mtp)
