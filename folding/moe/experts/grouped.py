"""Grouped SwiGLU experts: every local expert's MLP as grouped GEMMs, with pluggable backends.

Shape suffixes (docs/shapes.md): N token rows on this rank (sorted expert-major), H hidden size, F
full per-expert FFN size, Fl = F / ETP the shard this rank holds, L local experts, E global experts.

For each local expert e with rows x_e: ``out_e = (silu(x_e·gate_eᵀ) ⊙ (x_e·up_eᵀ) ⊙ p_e) · fc2_eᵀ``
(the router probabilities p multiply the activation before fc2; the combine is then an unweighted
sum). Under ETP the output is a partial sum over F shards: the dispatcher reduce-scatters it.

Parameters (the same for every backend):

- ``fc1_weight [L, 2·Fl, H]``: rows ``[0:Fl]`` are this ETP rank's shard of gate, ``[Fl:]`` its
  shard of up; the logical full fc1 of an expert is ``[gate; up]`` of shape ``[2F, H]``.
- ``fc2_weight [L, H, Fl]``: this rank's column shard of the full ``[H, F]``.

Initialization does not depend on the layout: each weight records its full tensor (``fc1``: the
stack ``[E, 2, F, H]`` of every expert's gate and up, ``fc2``: ``[E, H, F]``) and this
rank's slice (EP along dim 0, ETP along F) in its :class:`~folding.parallel.params.ParamSpec`; the
full tensor is drawn from ``normal(0, init_std)`` one expert at a time (``chunk_dim=0``), so a rank
generates only its own experts, and every layout holds the same numbers.

Backends: ``loop`` (reference), ``torch`` (grouped_mm; with ``fp8_recipe`` ``rowwise`` or ``mxfp8``
``torch._scaled_grouped_mm``, rows padded per expert once around fc1→fc2, see
:mod:`folding.moe.experts.scaled`), ``emulated`` (loop on FP8/MXFP8-quantized
operands: CPU runs see the GPU recipe's precision), ``te`` (TransformerEngine ``GroupedLinear``
inside the model chunk's FP8 region, see :mod:`folding.moe.experts.te`). ``moe.expert_backend=auto``
is resolved before the experts are built, once (:mod:`folding.moe.experts.select`, with
TransformerEngine's own checks); the experts receive the backend that runs.

What an FP8 recipe keeps for backward: every backend keeps each GEMM's input (fc1's: the dispatched
rows; fc2's: the activation) only quantized, 1 byte per element plus the recipe's scales, as the weight
gradient reads it (``emulated`` and ``torch``: :class:`folding.quant.Fp8Operand`, made in the forward;
``te``: TransformerEngine keeps its input's columnwise FP8 copy itself), so the high-precision rows are
freed after the forward. The SwiGLU keeps fc1's output in high precision unless ``fp8_act_input_store``.

Usage::

    mlp = GroupedMLP(num_local_experts=4, hidden_size=64, ffn_hidden_size=128, etp_size=2,
                     etp_rank=ps.coords.etp.rank, expert_offset=ps.coords.ep.rank * 4, backend="torch")
    out_NH = mlp(tokens_NH, tokens_per_expert, probs_N)
"""

from __future__ import annotations

import torch

from folding.memory.discard import discard_until_backward
from folding.memory.offload import offload_region
from folding.moe.dispatch.base import DispatchRecord
from folding.moe.experts.backends import grouped_linear, host_counts
from folding.moe.experts.scaled import aligned_sizes
from folding.moe.experts.select import BACKENDS, check_backend
from folding.moe.experts.swiglu import swiglu_prob
from folding.moe.experts.te import (
    FP8_ROW_ALIGN,
    TEGroupedRunner,
    expert_region,
    pad_rows_per_expert,
    unpad_rows_per_expert,
)
from folding.parallel.params import initialize_parameters, mark_param, set_init_spec
from folding.quant.delayed import DelayedScaling
from folding.quant.emulate import RECIPES


def _check_settings(
    num_experts,
    num_local_experts,
    hidden_size,
    ffn_hidden_size,
    etp_size,
    etp_rank,
    expert_offset,
    backend,
    fp8_recipe,
    fp8_act_input_store=False,
) -> None:
    """Raise ``ValueError`` naming the argument and a fix if :class:`GroupedMLP`'s sizes are impossible
    (the backend and recipe names were checked by ``MoEConfig``: asserted here)."""
    if fp8_act_input_store and fp8_recipe is None:
        raise ValueError(
            "fp8_act_input_store=True keeps the activation's input in the FP8 recipe's format and "
            "fp8_recipe is None; give an fp8_recipe (moe.fp8_recipe) or fp8_act_input_store=False"
        )
    if num_local_experts <= 0 or hidden_size <= 0 or ffn_hidden_size <= 0:
        raise ValueError(
            f"num_local_experts={num_local_experts}, hidden_size={hidden_size} and "
            f"ffn_hidden_size={ffn_hidden_size} must all be positive"
        )
    if etp_size <= 0 or ffn_hidden_size % etp_size != 0:
        raise ValueError(
            f"ffn_hidden_size={ffn_hidden_size} must be divisible by etp_size={etp_size}; pick an ETP "
            "that divides the expert FFN size"
        )
    if not 0 <= etp_rank < etp_size:
        raise ValueError(f"etp_rank={etp_rank} must be in [0, etp_size={etp_size})")
    if num_experts % num_local_experts or expert_offset % num_local_experts or expert_offset < 0:
        raise ValueError(
            f"expert_offset={expert_offset} and num_experts={num_experts} must be multiples of "
            f"num_local_experts={num_local_experts} (expert_offset = ep_rank * num_local_experts)"
        )
    if expert_offset + num_local_experts > num_experts:
        raise ValueError(
            f"local experts [{expert_offset}, {expert_offset + num_local_experts}) exceed num_experts={num_experts}"
        )
    if backend not in BACKENDS[1:]:
        raise ValueError(
            f"backend={backend!r}: give the backend that runs, one of {BACKENDS[1:]} (moe.expert_backend=auto "
            "is resolved once, before the experts are built: folding.moe.experts.select.resolve_backend)"
        )
    # the names and their pairing are checked once, in MoEConfig (moe.expert_backend, moe.fp8_recipe)
    assert backend in BACKENDS and (fp8_recipe is None or fp8_recipe in RECIPES), (backend, fp8_recipe)
    assert (backend == "emulated") <= (fp8_recipe is not None), "MoEConfig: emulated needs an fp8_recipe"
    assert (backend == "loop") <= (fp8_recipe is None), "MoEConfig: loop runs no fp8_recipe"


class GroupedMLP(torch.nn.Module):
    """The local experts of one MoE layer (SwiGLU), sharded over ETP along F. See the module docstring."""

    def __init__(
        self,
        *,
        num_experts: int | None = None,
        num_local_experts: int,
        hidden_size: int,
        ffn_hidden_size: int,
        etp_size: int = 1,
        etp_rank: int = 0,
        expert_offset: int = 0,
        backend: str,
        fp8_recipe: str | None = None,
        params_dtype: torch.dtype = torch.float32,
        init_std: float = 0.02,
        output_init_std: float | None = None,
        init_seed: int | None = 0,
        device=None,
        delay_wgrad: bool = False,
        recompute_act: bool = False,
        fp8_act_input_store: bool = False,
    ):
        """Validate the settings and create this rank's shards of the layout-independent initial weights.
        ``num_experts``: the global E (default ``num_local_experts``); ``init_seed=None``: the owner fills
        every parameter from its record; ``backend``: the one that runs, ``auto`` resolved before
        (:func:`folding.moe.experts.select.resolve_backend`); ``delay_wgrad``, ``recompute_act``,
        ``fp8_act_input_store``: see below."""
        super().__init__()
        num_experts = num_local_experts if num_experts is None else num_experts
        sizes = (num_experts, num_local_experts, hidden_size, ffn_hidden_size, etp_size, etp_rank, expert_offset)
        _check_settings(*sizes, backend, fp8_recipe, fp8_act_input_store)
        if device is not None and torch.device(device).type != "meta":
            # the backend's first-use probes (a grouped GEMM forward and backward) run now, at build,
            # never inside an overlap pair (whose second lane may not start a backward)
            check_backend(backend, fp8_recipe, torch.device(device), params_dtype)
        self.num_local_experts = num_local_experts
        self.hidden_size = hidden_size
        self.ffn_hidden_size = ffn_hidden_size
        self.etp_size, self.etp_rank = etp_size, etp_rank
        self.expert_offset = expert_offset
        self.ffn_local = ffn_hidden_size // etp_size
        self.backend = backend
        self.fp8_recipe = fp8_recipe
        self.num_experts = num_experts
        self._create_weights(params_dtype, device, init_std, init_std if output_init_std is None else output_init_std)
        self._te: TEGroupedRunner | None = None
        # amax histories of the emulated ``delayed`` recipe, one per operand of each expert GEMM
        self.delayed_scaling = DelayedScaling() if fp8_recipe == "delayed" else None
        self.delay_wgrad = delay_wgrad
        """``torch`` backend: weight gradients behind the backward's next exchange (``parallel.delay_wgrad``)."""
        self.recompute_act = recompute_act
        """``moe_act``: fc2's input freed after its forward, refilled from fc1's (:mod:`folding.memory.discard`)."""
        self.fp8_act_input_store = fp8_act_input_store
        """``moe.fp8_act_input_store``: the SwiGLU keeps fc1's output in ``fp8_recipe``'s FP8 for its
        backward (:func:`folding.moe.experts.swiglu.swiglu_prob`)."""
        if init_seed is not None and not self.fc1_weight.is_meta:
            initialize_parameters(self, init_seed)

    def _create_weights(self, params_dtype, device, init_std: float, output_init_std: float) -> None:
        """``fc1_weight [L, 2·Fl, H]`` and ``fc2_weight [L, H, Fl]``: this rank's experts and ETP shard,
        each with its record of the full tensor it is a slice of (the layout-independent initialization)."""
        E, fl, h, f = self.num_local_experts, self.ffn_local, self.hidden_size, self.ffn_hidden_size
        kw = dict(dtype=params_dtype, device=device)
        ep_cut = (0, self.expert_offset // E, self.num_experts // E)
        etp_cut = (2, self.etp_rank, self.etp_size)
        self.fc1_weight = mark_param(torch.nn.Parameter(torch.empty(E, 2 * fl, h, **kw)), expert=True, tp_sharded=True)
        set_init_spec(
            self.fc1_weight,
            full_shape=(self.num_experts, 2, f, h),
            shards=(ep_cut, etp_cut),
            std=init_std,
            chunk_dim=0,
        )
        self.fc2_weight = mark_param(torch.nn.Parameter(torch.empty(E, h, fl, **kw)), expert=True, tp_sharded=True)
        set_init_spec(
            self.fc2_weight,
            full_shape=(self.num_experts, h, f),
            shards=(ep_cut, etp_cut),
            std=output_init_std,
            chunk_dim=0,
        )

    def fp8_region_recipe(self) -> str | None:
        """The FP8 recipe of the model chunk's TransformerEngine region when these experts run on
        ``te`` with a recipe, else None."""
        if self.fp8_recipe is None or self.backend != "te":
            return None
        return self.fp8_recipe

    def _te_runner(self, dtype: torch.dtype) -> TEGroupedRunner:
        if self._te is None:  # not a registered submodule: its FP8 state travels by fp8_state()
            runner = TEGroupedRunner(
                num_local_experts=self.num_local_experts,
                hidden_size=self.hidden_size,
                ffn_local=self.ffn_local,
                params_dtype=dtype,
            )
            object.__setattr__(self, "_te", runner)
        return self._te

    def fp8_state(self) -> dict:
        """TransformerEngine's ``delayed`` FP8 state of these experts (scales and amax histories as plain
        tensors), keyed by the experts it belongs to; empty for the other recipes (TE keeps no state
        for them) and before TE has run. Saved with checkpoints (``fp8/rank_<r>.pt``)."""
        if self._te is None or self.fp8_recipe != "delayed":
            return {}
        gemms = self._te.delayed_state()
        if not gemms:
            return {}
        return {
            "expert_offset": self.expert_offset,
            "etp_rank": self.etp_rank,
            "etp_size": self.etp_size,
            "recipe": self.fp8_recipe,
            "gemms": gemms,
        }

    def load_fp8_state(self, state: dict) -> bool:
        """Restore :meth:`fp8_state` into TE's meta tensors if it belongs to the same experts, shard and
        recipe; return whether it did (a checkpoint from another layout or recipe, or one saved as TE's
        pickled extra state, leaves TE to recalibrate its scales)."""
        mine = (self.expert_offset, self.etp_rank, self.etp_size, self.fp8_recipe)
        if not state or (state["expert_offset"], state["etp_rank"], state["etp_size"], state.get("recipe")) != mine:
            return False
        if not all(isinstance(g, dict) for g in state["gemms"].values()):
            return False  # an older checkpoint: TE's extra state, a pickle this engine never hands to TE
        self._te_runner(self.fc1_weight.dtype).load_delayed_state(state["gemms"])
        return True

    def forward(
        self, tokens_NH: torch.Tensor, tokens_per_expert, probs_N: torch.Tensor, replica_weights=None
    ) -> torch.Tensor:
        """Expert outputs ``[N, H]`` for tokens sorted expert-major (a partial sum over F shards under ETP).

        ``tokens_per_expert``: a list (host sizes, validated here), a 1-D int tensor ``[E_local]`` on
        the tokens' device (the ``torch`` backend then builds its offsets there without any host
        copy; other backends read it once), or the dispatcher's
        :class:`~folding.moe.dispatch.base.DispatchRecord` of the call (the device counts for the
        ``torch`` backend, the host counts it already holds for the others); ``probs_N``: the router
        probability of each row. Experts with zero rows and ``N == 0`` are fine.
        ``replica_weights``: ``(fc1 [R, 2·Fl, H], fc2 [R, H, Fl])`` of ``R`` replica slots computed
        after the local experts (``moe.expert_replicas``; the counts then have ``L + R`` entries).
        """
        if tokens_NH.dim() != 2 or tokens_NH.shape[1] != self.hidden_size:
            raise ValueError(f"tokens_NH must be [N, hidden_size={self.hidden_size}]; got {tuple(tokens_NH.shape)}")
        n = tokens_NH.shape[0]
        if probs_N.shape != (n,):
            raise ValueError(f"probs_N must be [N={n}] (one probability per row); got {tuple(probs_N.shape)}")
        backend = self.backend
        counts_L = None  # the device counts, for the FP8 path's offsets (built there, no host copy)
        if isinstance(tokens_per_expert, DispatchRecord):  # the counts this backend wants, no copy
            rec = tokens_per_expert
            device_counts = backend == "torch" and self.fp8_recipe is None
            counts_L = rec.tokens_per_expert
            tokens_per_expert = rec.tokens_per_expert if device_counts else list(rec.tokens_per_expert_host)
        w1, w2 = self.fc1_weight, self.fc2_weight
        if replica_weights is not None:
            if backend == "te":
                raise ValueError(
                    "moe.expert_replicas needs a backend with a variable number of experts; set "
                    "moe.expert_backend=torch (auto resolved to te here) or moe.expert_replicas=0"
                )
            w1, w2 = torch.cat([w1, replica_weights[0]]), torch.cat([w2, replica_weights[1]])
        w1, w2 = w1.to(tokens_NH.dtype), w2.to(tokens_NH.dtype)
        if backend == "te":
            return self._te_forward(tokens_NH, tokens_per_expert, probs_N, w1, w2)
        if backend == "torch" and self.fp8_recipe is not None:
            return self._scaled_forward(tokens_NH, tokens_per_expert, probs_N, w1, w2, counts_L)
        if not isinstance(
            tokens_per_expert, torch.Tensor
        ):  # host counts: validate once for both GEMMs (device counts: see grouped_linear)
            tokens_per_expert = host_counts(tokens_per_expert, w1.shape[0], n)
        kw = dict(delayed=self.delayed_scaling, delay_wgrad=self.delay_wgrad)
        with offload_region("expert_fc1"):
            h = grouped_linear(tokens_NH, w1, tokens_per_expert, backend, self.fp8_recipe, name="fc1", **kw)
        act = self._activation(h, probs_N)
        y = grouped_linear(act, w2, tokens_per_expert, backend, self.fp8_recipe, name="fc2", **kw)
        if self.recompute_act and self.fp8_recipe is None:
            discard_until_backward([act], after=y, refill=lambda: [self._activation(h, probs_N)])
        return y

    def _te_forward(self, x_NH, tokens_per_expert, probs_N, w1, w2) -> torch.Tensor:
        """fc1 → SwiGLU·p → fc2 through TransformerEngine, rows aligned once for the FP8 recipe."""
        counts = host_counts(tokens_per_expert, self.num_local_experts, x_NH.shape[0])
        runner = self._te_runner(x_NH.dtype)
        with expert_region(self.fp8_recipe):
            padded = counts
            if self.fp8_recipe is not None:
                align = FP8_ROW_ALIGN[self.fp8_recipe]
                x_NH, padded = pad_rows_per_expert(x_NH, counts, align)
                probs_N = pad_rows_per_expert(probs_N.unsqueeze(1), counts, align)[0].squeeze(1)
            with offload_region("expert_fc1"):
                h = runner.linear("fc1", x_NH, w1, padded)
            y = runner.linear("fc2", self._activation(h, probs_N), w2, padded)
        return unpad_rows_per_expert(y, counts, padded)

    def _scaled_forward(self, x_NH, tokens_per_expert, probs_N, w1, w2, counts_L=None) -> torch.Tensor:
        """fc1 → SwiGLU·p → fc2 through ``torch._scaled_grouped_mm``, rows aligned once for the recipe.

        Every expert gets at least one aligned block of rows (zeros for an expert without tokens: the
        kernel refuses an empty group). ``counts_L``: the same counts on the device (the dispatch
        record's), from which the kernel's sizes and offsets are built there; without it (host counts
        given directly) they are copied from the host once per GEMM.
        """
        counts = host_counts(tokens_per_expert, w1.shape[0], x_NH.shape[0])
        align = FP8_ROW_ALIGN[self.fp8_recipe]
        x_NpH, padded = pad_rows_per_expert(x_NH, counts, align, min_rows=align)
        probs_Np = pad_rows_per_expert(probs_N.unsqueeze(1), counts, align, min_rows=align)[0].squeeze(1)
        sizes_L = None if counts_L is None else aligned_sizes(counts_L, align)
        kw = dict(delay_wgrad=self.delay_wgrad, device_sizes=sizes_L)
        with offload_region("expert_fc1"):
            h = grouped_linear(x_NpH, w1, padded, "torch", self.fp8_recipe, **kw)
        y = grouped_linear(self._activation(h, probs_Np), w2, padded, "torch", self.fp8_recipe, **kw)
        return unpad_rows_per_expert(y, counts, padded)

    def _activation(self, h_NFl2: torch.Tensor, probs_N: torch.Tensor) -> torch.Tensor:
        """``silu(gate) ⊙ up ⊙ probs`` from fc1's output ``[N, 2·Fl]`` (kept in FP8 under ``fp8_act_input_store``;
        the ``moe_act`` offload region: what it keeps, fc1's output and the probabilities, may wait in host
        memory)."""
        with offload_region("moe_act"):
            return swiglu_prob(h_NFl2, probs_N, self.fp8_recipe if self.fp8_act_input_store else None)

    def extra_repr(self) -> str:
        """Sizes, sharding and backend."""
        return (
            f"experts={self.num_local_experts} (offset {self.expert_offset}), H={self.hidden_size}, "
            f"F={self.ffn_hidden_size} (local {self.ffn_local}, etp {self.etp_rank}/{self.etp_size}), "
            f"backend={self.backend}, fp8_recipe={self.fp8_recipe}"
            + (", fp8_act_input_store=True" if self.fp8_act_input_store else "")
        )
