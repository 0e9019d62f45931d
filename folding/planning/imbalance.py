"""Expert load imbalance for the planner: routed-token counts per step, MoE layer and expert, and what they
cost the slowest expert-parallel rank of a layout.

The planner's balanced model gives every local expert ``tokens·k/local`` rows. Real routing does not. This
module takes per-step, per-MoE-layer, per-expert routed-token counts (``loads_SLE``: ``[steps, layers,
experts]``, from a recorded trace or drawn by :func:`zipf_loads`) and, for one layout, derives per step:

- the tokens each EP rank receives, from the expert placement (expert ``e`` on EP rank ``e // (E/EP)``);
- drops at the capacity factor (``moe.capacity_factor``: an expert keeps at most ``capacity_factor`` times
  its balanced share; with ``moe.pad_to_capacity`` every expert is padded to that share);
- padding of each expert's rows to the recipe's alignment (``moe.fp8_recipe``: 16 rows, 32 for MXFP8;
  none in BF16);
- per MoE layer, the slowest rank's expert rows and all-to-all bytes relative to the balanced ones, then the
  mean over the MoE layers: :class:`RankLoads`.

:func:`folding.planning.step_time.estimate_step_time` takes a step's ``(compute, comm)`` factors as
``moe_load``; :class:`RoutingModel` picks the steps at the p50 and p99 of the slowest rank's load.

Trace files (:func:`load_routing_trace`): ``.npy`` (a ``[steps, layers, experts]`` array), ``.json`` (that
array as nested lists, or an object whose ``"counts"`` holds it); other formats plug in with
:func:`register_trace_reader`.

Usage::

    loads_SLE = zipf_loads(num_experts=64, num_layers=28, steps=100, exponent=1.2, seed=0)
    loads_SLE = load_routing_trace("loads.npy")
    r = rank_loads(loads_SLE, ep=8, rows_per_expert=2048.0, align=1, capacity_factor=None)
    r.compute, r.comm, r.max_over_mean, r.dropped          # each [steps]
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Callable, Dict, Optional, Tuple

import numpy as np

from folding.model.config import FP8_ROW_ALIGN, ModelConfig

#: Quantiles the planner reports, by name (``--rank-by``).
QUANTILES = {"p50": 0.50, "p99": 0.99}

TraceReader = Callable[[str], np.ndarray]


def _read_npy(path: str) -> np.ndarray:
    return np.load(path, allow_pickle=False)


def _read_json(path: str) -> np.ndarray:
    with open(path) as f:
        data = json.load(f)
    if isinstance(data, dict):
        if "counts" not in data:
            raise ValueError(
                f"--routing-trace {path}: a JSON object needs a 'counts' key holding [steps][layers][experts]"
            )
        data = data["counts"]
    return np.asarray(data, dtype=np.float64)


_READERS: Dict[str, TraceReader] = {".npy": _read_npy, ".json": _read_json}


def register_trace_reader(suffix: str, reader: TraceReader) -> None:
    """Make :func:`load_routing_trace` read paths ending in ``suffix`` (e.g. ``".bin"``, or ``"/"`` for a
    directory) with ``reader(path) -> [steps, layers, experts]`` routed-token counts."""
    _READERS[suffix] = reader


def load_routing_trace(path: str) -> np.ndarray:
    """Routed-token counts ``[steps, MoE layers, experts]`` (float64) from a trace file, by its suffix
    (``.npy``, ``.json``, or one registered with :func:`register_trace_reader`)."""
    key = "/" if os.path.isdir(path) else os.path.splitext(path)[1]
    if not os.path.exists(path):
        raise ValueError(f"--routing-trace {path}: no such file")
    if key not in _READERS:
        raise ValueError(f"--routing-trace {path}: unknown format {key!r}; use one of {sorted(_READERS)}")
    loads_SLE = np.asarray(_READERS[key](path), dtype=np.float64)
    if loads_SLE.ndim != 3 or 0 in loads_SLE.shape:
        raise ValueError(
            f"--routing-trace {path}: expected [steps, layers, experts] counts, got shape {loads_SLE.shape}"
        )
    return loads_SLE


def parse_skew(spec: str) -> float:
    """``"zipf:S"`` -> the exponent ``S`` (>= 0)."""
    kind, _, s = spec.partition(":")
    try:
        exponent = float(s)
    except ValueError:
        exponent = -1.0
    if kind != "zipf" or not exponent >= 0 or not math.isfinite(exponent):
        raise ValueError(f"--routing-skew {spec!r}: write zipf:S with S >= 0, e.g. zipf:1.2 (zipf:0 is balanced)")
    return exponent


def topk_feasible(shares_E: np.ndarray, topk: int) -> np.ndarray:
    """``shares_E`` (summing to 1) with no expert above ``1/topk`` of the routed copies (a token picks
    ``topk`` distinct experts): the excess of the capped experts goes to the others in proportion to their
    shares, until none is above. Unchanged when none is above."""
    cap = 1.0 / topk
    shares_E = shares_E.copy()
    while np.any(shares_E > cap * (1 + 1e-12)):
        over = shares_E >= cap
        free = shares_E[~over].sum()
        shares_E[~over] *= (1.0 - cap * over.sum()) / free
        shares_E[over] = cap
    return shares_E


def zipf_loads(
    *, num_experts: int, num_layers: int, steps: int, exponent: float, seed: int, topk: int = 1
) -> np.ndarray:
    """Synthetic routed-token shares ``[steps, layers, experts]``: expert popularity ``∝ 1/rank^exponent``,
    capped at ``1/topk`` of the routed copies (:func:`topk_feasible`: with top-k routing no expert gets
    more), the ranks assigned to the experts by a random permutation drawn per step and layer from
    ``seed`` (so the hottest experts land on different EP ranks from step to step). ``exponent=0`` is
    balanced."""
    if steps < 1:
        raise ValueError(f"--skew-steps={steps} must be >= 1")
    weights_E = 1.0 / np.arange(1, num_experts + 1, dtype=np.float64) ** exponent
    if exponent > 0:
        weights_E = topk_feasible(weights_E / weights_E.sum(), topk)
    rng = np.random.default_rng(seed)
    perm_SLE = np.argsort(rng.random((steps, num_layers, num_experts)), axis=-1)
    return weights_E[perm_SLE]


def check_loads(loads_SLE: np.ndarray, cfg: ModelConfig) -> None:
    """Raise ``ValueError`` unless ``loads_SLE`` has ``cfg``'s MoE layers and experts and sane counts."""
    _, n_layers, n_experts = loads_SLE.shape
    if n_experts != cfg.moe.num_experts or n_layers != cfg.num_moe_layers():
        raise ValueError(
            f"--routing-trace: counts for {n_layers} MoE layers x {n_experts} experts, but {cfg.name} has "
            f"{cfg.num_moe_layers()} x {cfg.moe.num_experts}; use a trace of this model"
        )
    if not np.all(np.isfinite(loads_SLE)) or np.any(loads_SLE < 0):
        raise ValueError("--routing-trace: token counts must be finite and >= 0")
    if np.any(loads_SLE.sum(-1) <= 0):
        raise ValueError("--routing-trace: a step and layer with no routed tokens; drop that step from the trace")


@dataclasses.dataclass(frozen=True)
class RankLoads:
    """Per step (arrays ``[steps]``), the slowest EP rank's load relative to the balanced model, averaged
    over the MoE layers of the per-layer slowest rank."""

    compute: np.ndarray
    """Expert rows (after drops and padding) on the slowest rank / the balanced rows: scales the experts'
    grouped GEMMs and the sort / SwiGLU passes of the received rows."""
    comm: np.ndarray
    """Routed copies the slowest rank receives (after drops, padded with ``pad_to_capacity``) / the
    balanced copies: scales the all-to-all and the ETP all-gather / reduce-scatter."""
    max_over_mean: np.ndarray
    """Tokens per EP rank, max / mean, before drops (1 when balanced)."""
    dropped: np.ndarray
    """Fraction of the routed copies dropped at the capacity factor."""


def rank_loads(
    loads_SLE: np.ndarray,
    *,
    ep: int,
    rows_per_expert: float,
    align: int = 1,
    capacity_factor: Optional[float] = None,
    pad_to_capacity: bool = False,
) -> RankLoads:
    """:class:`RankLoads` of ``loads_SLE`` on ``ep`` EP ranks (experts in contiguous blocks of ``E/ep``).

    ``rows_per_expert``: the balanced model's rows per local expert and micro-batch (for the padding to
    ``align``). Exactly balanced counts give factors of exactly 1.0 (no drops or padding)."""
    S, L, E = loads_SLE.shape
    if E % ep:
        raise ValueError(f"ep={ep} must divide the {E} experts")
    x_SLE = (loads_SLE * E) / loads_SLE.sum(-1, keepdims=True)  # mean 1 per step and layer
    local = E // ep
    per_rank = x_SLE.reshape(S, L, ep, local).sum(-1) / local
    max_over_mean = per_rank.max(-1).mean(-1)
    kept_SLE, dropped = x_SLE, np.zeros(S)
    if capacity_factor is not None:
        kept_SLE = np.minimum(x_SLE, capacity_factor)
        dropped = (x_SLE - kept_SLE).sum(-1).mean(-1) / E
        if pad_to_capacity:
            kept_SLE = np.full_like(x_SLE, capacity_factor)
    comm = kept_SLE.reshape(S, L, ep, local).sum(-1).max(-1).mean(-1) / local
    if align > 1:
        rows_SLE = np.ceil(kept_SLE * rows_per_expert / align) * align / rows_per_expert
        compute = rows_SLE.reshape(S, L, ep, local).sum(-1).max(-1).mean(-1) / local
    else:
        compute = comm
    return RankLoads(compute=compute, comm=comm, max_over_mean=max_over_mean, dropped=dropped)


def quantile_step(keys: Tuple[np.ndarray, ...], q: float) -> int:
    """Index of the step at quantile ``q`` (nearest rank) of the steps sorted by ``keys`` (first key most
    significant)."""
    order = np.lexsort(tuple(reversed(keys)))
    return int(order[max(0, math.ceil(q * len(order)) - 1)])


def row_alignment(cfg: ModelConfig) -> int:
    """Rows per expert the grouped GEMMs pad to under ``cfg.moe.fp8_recipe`` (1: none; the engine's own
    ``FP8_ROW_ALIGN`` table)."""
    recipe = cfg.moe.fp8_recipe
    return 1 if recipe is None else FP8_ROW_ALIGN.get(recipe, 16)


@dataclasses.dataclass(frozen=True)
class LoadAt:
    """The slowest rank's load at one quantile of the steps."""

    compute: float
    """:attr:`RankLoads.compute` of that step."""
    comm: float
    """:attr:`RankLoads.comm` of that step."""
    max_over_mean: float
    """:attr:`RankLoads.max_over_mean` of that step."""
    dropped: float
    """:attr:`RankLoads.dropped` of that step."""


class RoutingModel:
    """Routed-token counts for the planner, with the load each layout sees at p50 and p99 of the steps."""

    def __init__(self, loads_SLE: np.ndarray, cfg: ModelConfig, *, rank_by: str = "p50"):
        """``loads_SLE``: ``[steps, MoE layers, experts]`` counts or shares; ``rank_by``: ``p50`` or ``p99``."""
        if rank_by not in QUANTILES:
            raise ValueError(f"--rank-by {rank_by!r}: use one of {sorted(QUANTILES)}")
        check_loads(loads_SLE, cfg)
        self.loads_SLE = loads_SLE
        self.rank_by = rank_by
        self._align = row_alignment(cfg)
        self._cf = cfg.moe.capacity_factor
        self._pad = bool(cfg.moe.pad_to_capacity)
        self._cache: Dict[tuple, Dict[str, LoadAt]] = {}

    def at_quantiles(self, *, ep: int, rows_per_expert: float) -> Dict[str, LoadAt]:
        """``{"p50": LoadAt, "p99": LoadAt}`` for EP ``ep``, steps ordered by the slowest rank's expert rows
        (then its all-to-all bytes)."""
        key = (ep, rows_per_expert if self._align > 1 else None)
        if key not in self._cache:
            r = rank_loads(
                self.loads_SLE,
                ep=ep,
                rows_per_expert=rows_per_expert,
                align=self._align,
                capacity_factor=self._cf,
                pad_to_capacity=self._pad,
            )
            out = {}
            for name, q in QUANTILES.items():
                i = quantile_step((r.compute, r.comm), q)
                out[name] = LoadAt(
                    compute=float(r.compute[i]),
                    comm=float(r.comm[i]),
                    max_over_mean=float(r.max_over_mean[i]),
                    dropped=float(r.dropped[i]),
                )
            self._cache[key] = out
        return self._cache[key]
