"""Pipeline layout strings (``parallel.pipeline_layout``): Megatron-Core's ``--pipeline-model-parallel-layout``.

A layout lists what every virtual pipeline stage holds, stage after stage in model order, stages
separated by ``|``. Virtual stage ``v`` runs on pipeline rank ``v % pp`` as its model chunk ``v // pp``
(the order of interleaved 1F1B), so a layout of ``V`` stages on ``pp`` ranks implies ``vpp = V / pp``.
Symbols:

=======  =====================================================================================
``E``    the embedding (exactly once, opening the first virtual stage)
``t``    one transformer (decoder) layer; the stages' ``t`` counts add up to ``model.num_layers``
``m``    one multi-token-prediction module (``model.mtp_num_layers`` of them, in the last stage)
``L``    the loss: final norm, output layer and cross-entropy (exactly once, closing the last stage)
``|``    the boundary between two virtual stages; a stage may be empty (the pipeline passes the
         hidden states through it) or hold no transformer layer (``E`` alone, ``mL``)
``,``    ignored (a visual separator)
=======  =====================================================================================

Repetition: ``x*N`` repeats one symbol (``t*3`` is ``ttt``, ``|*2`` is ``||``) and ``(...)*N`` a group
without nested parentheses (``(tt|)*2`` is ``tt|tt|``). So ``Et|(tt|)*30mL`` on pp8 is 32 virtual
stages (vpp4): the embedding and layer 0, thirty stages of two layers, and a last stage with the
multi-token-prediction module and the loss but no transformer layer: 61 layers.

Megatron-Core also accepts the MTP modules in the last chunk of another pipeline rank ("standalone"
MTP) and the embedding after empty stages; folding runs the MTP modules with the loss, in the last
virtual stage, and the embedding in the first, and refuses the others naming the fix. Every pipeline
rank must hold something (a rank of empty stages only would pass hidden states through and hold no
parameter).

Usage::

    expand_pipeline_layout("Et|(tt|)*2mL")                        # ('Et', 'tt', 'tt', 'mL')
    stages = check_pipeline_layout("Et|(tt|)*30mL", pp=8)          # the 32 stages, structure checked
    layer_ranges(stages, num_layers=61, mtp_num_layers=1)          # [(0, 1), (1, 3), ..., (61, 61)]
    compact_stage("tttttt")                                        # 't*6'

Every malformed or impossible layout raises :class:`~folding.parallel.rank_math.LayoutError` (a
``ValueError``) whose message starts ``parallel.pipeline_layout='...'`` and says how to fix it.
"""

from __future__ import annotations

import functools
from typing import List, Optional, Sequence, Tuple

from .rank_math import LayoutError

SYMBOLS = {"E": "the embedding", "t": "a transformer layer", "m": "a multi-token-prediction module", "L": "the loss"}
"""The symbols of a layout string and what each stands for."""

SYNTAX = "stages of E, t, m, L separated by '|', with x*N and (...)*N repetition"


def _fail(text: str, why: str, fix: str) -> None:
    raise LayoutError(f"parallel.pipeline_layout={text!r}: {why}; {fix}")


def _count(text: str, s: str, i: int, *, required: bool) -> Tuple[int, int]:
    """``(N, next index)`` of a ``*N`` at ``s[i:]``; ``(1, i)`` when there is none and none is required."""
    if i >= len(s) or s[i] != "*":
        if required:
            group = s[s.rfind("(", 0, i) + 1 : i - 1]
            _fail(text, f"the group ({group}) has no repeat count", "write (...)*N, e.g. (tt|)*30")
        return 1, i
    j = i + 1
    while j < len(s) and s[j].isdigit():
        j += 1
    if j == i + 1:
        _fail(text, "a '*' is not followed by a count", "write x*N or (...)*N with a number N")
    return int(s[i + 1 : j]), j


def _unroll(text: str, s: str, *, in_group: bool) -> str:
    """``s`` with every ``x*N`` and ``(...)*N`` written out (groups only at the top level)."""
    out: List[str] = []
    i = 0
    while i < len(s):
        c = s[i]
        if c == "(" and not in_group:
            close = s.find(")", i + 1)
            body = s[i + 1 : close] if close > 0 else ""
            if close < 0 or not body or "(" in body:
                why = "a '(' is never closed" if close < 0 else "a group is empty or nested"
                _fail(text, why, f"write {SYNTAX} (groups hold symbols, not groups)")
            n, i = _count(text, s, close + 1, required=True)
            out.append(_unroll(text, body, in_group=True) * n)
        elif c in SYMBOLS or c == "|":
            n, i = _count(text, s, i + 1, required=False)
            out.append(c * n)
        else:
            _fail(text, f"{c!r} is not a layout symbol", f"write {SYNTAX}")
    return "".join(out)


def expand_pipeline_layout(text: str) -> Tuple[str, ...]:
    """The virtual stages of a layout string, each its symbols in order (repetitions written out,
    commas dropped): ``"Et|(tt|)*2mL"`` gives ``('Et', 'tt', 'tt', 'mL')``. Checks the syntax only."""
    if not isinstance(text, str) or not text.strip():
        _fail(str(text), "is not a layout string", f"write {SYNTAX}, e.g. Et|(tt|)*30mL")
    return _expand(text)


@functools.lru_cache(maxsize=256)
def _expand(text: str) -> Tuple[str, ...]:
    return tuple(_unroll(text, text.replace(",", ""), in_group=False).split("|"))


def check_pipeline_layout(text: str, *, pp: int, vpp: Optional[int] = None) -> Tuple[str, ...]:
    """The virtual stages of ``text`` (:func:`expand_pipeline_layout`) after checking its structure on
    ``pp`` pipeline ranks: a multiple of ``pp`` stages (``vpp``, when given, must be that multiple),
    ``E`` once, opening the first stage, ``L`` once, closing the last, the ``m`` symbols in the last
    stage between its transformer layers and ``L``, and something on every pipeline rank."""
    stages = expand_pipeline_layout(text)
    V = len(stages)
    if V % pp:
        _fail(text, f"lists {V} virtual stages, not a multiple of parallel.pp={pp}", "list pp x vpp stages")
    if vpp not in (None, V // pp) and not (vpp == 1 and V == pp):
        _fail(
            text,
            f"lists {V} virtual stages, which on parallel.pp={pp} means {V // pp} per rank, not parallel.vpp={vpp}",
            f"set parallel.vpp={V // pp} or null (the layout implies it), or list {pp * vpp} stages",
        )
    flat = "".join(stages)
    if flat.count("E") != 1 or not stages[0].startswith("E"):
        _fail(text, "E (the embedding) must open the first virtual stage, once", "start the layout with E")
    if flat.count("L") != 1 or not stages[-1].endswith("L"):
        _fail(text, "L (the loss) must close the last virtual stage, once", "end the layout with L")
    last = stages[-1][:-1]  # the last stage without its final L
    early_m = "m" in "".join(stages[:-1])
    t_after_m = "m" in last and "t" in last[last.index("m") :]
    if early_m or t_after_m:
        _fail(
            text,
            "m (a multi-token-prediction module) must sit in the last virtual stage, after its transformer "
            "layers and before L (folding runs the modules with the loss; MTP on another stage is not supported)",
            "move every m to just before the final L, e.g. ...|ttmL",
        )
    for r in range(pp):
        mine = range(r, V, pp)
        if not any(stages[v] for v in mine):
            _fail(
                text,
                f"pipeline rank {r} (virtual stages {', '.join(map(str, mine))}) holds nothing",
                "give every pipeline rank at least one symbol, or use fewer pipeline ranks",
            )
    return stages


def check_layout_vs_model(text: str, stages: Sequence[str], *, num_layers: int, mtp_num_layers: int) -> None:
    """Check that the layout's ``t`` count is ``num_layers`` (``model.num_layers``) and its ``m`` count
    ``mtp_num_layers`` (``model.mtp_num_layers``)."""
    flat = "".join(stages)
    t, m = flat.count("t"), flat.count("m")
    if t != num_layers:
        _fail(
            text,
            f"lists {t} transformer layers (t) but model.num_layers={num_layers}",
            f"list exactly {num_layers} t symbols (their sum over the stages)",
        )
    if m != mtp_num_layers:
        if not mtp_num_layers:
            _fail(
                text,
                f"lists {m} multi-token-prediction module(s) (m) but the model has none (model.mtp_num_layers=0)",
                "remove the m symbols, or set model.mtp_num_layers",
            )
        _fail(
            text,
            f"lists {m} multi-token-prediction module(s) (m) but model.mtp_num_layers={mtp_num_layers}",
            f"write m {mtp_num_layers} time(s) just before the final L",
        )


def layer_ranges(
    stages: Sequence[str], *, num_layers: int, mtp_num_layers: int, text: str = ""
) -> List[Tuple[int, int]]:
    """``[start, end)`` of the transformer layers of every virtual stage (empty where it holds none),
    after :func:`check_layout_vs_model`; ``text`` names the layout in its errors."""
    check_layout_vs_model(text or "|".join(stages), stages, num_layers=num_layers, mtp_num_layers=mtp_num_layers)
    out, start = [], 0
    for stage in stages:
        end = start + stage.count("t")
        out.append((start, end))
        start = end
    return out


def stage_symbols(ranges: Sequence[Tuple[int, int]], *, mtp_num_layers: int = 0) -> Tuple[str, ...]:
    """The layout symbols of virtual stages with layer ranges ``ranges`` as the engine builds them: ``E``
    opening the first, ``t`` per layer, ``m`` per multi-token-prediction module and ``L`` closing the
    last (the inverse of :func:`layer_ranges` for a checked layout)."""
    out = ["t" * (e - s) for s, e in ranges]
    out[0] = "E" + out[0]
    out[-1] = out[-1] + "m" * mtp_num_layers + "L"
    return tuple(out)


def compact_stage(symbols: str) -> str:
    """One stage's symbols with runs of more than three equal symbols as ``x*N``: ``'Etttttt'`` gives
    ``'Et*6'``; an empty stage is ``'-'``."""
    if not symbols:
        return "-"
    out, i = [], 0
    while i < len(symbols):
        j = i
        while j < len(symbols) and symbols[j] == symbols[i]:
            j += 1
        out.append(symbols[i] * (j - i) if j - i <= 3 else f"{symbols[i]}*{j - i}")
        i = j
    return "".join(out)


def balanced_layout(*, num_layers: int, mtp_num_layers: int, stages: int) -> Optional[str]:
    """The layout of ``stages`` virtual stages that counts the embedding, each multi-token-prediction
    module and the loss as one layer each and gives every stage the same count ``n = (num_layers +
    mtp_num_layers + 2) / stages``: ``E`` and ``n - 1`` layers first, ``n`` layers in each stage between,
    the last ``n - 1 - mtp_num_layers`` layers with the modules and ``L`` last (Megatron-Core's
    ``account_for_embedding_in_pipeline_split`` / ``account_for_loss_in_pipeline_split`` idea, written
    as a layout). ``None`` when that count is not whole, or leaves the last stage no room for its
    modules, or ``stages < 2``. Worked examples: DeepSeek-V3 (61 layers, one module) over 32 stages:
    64 / 32 = 2, ``Et|(tt|)*30mL``; Qwen3-235B-A22B (94 layers) over 32: 96 / 32 = 3, ``Ett|(ttt|)*30ttL``."""
    slots = num_layers + mtp_num_layers + 2
    if stages < 2 or slots % stages:
        return None
    n = slots // stages
    if n - 1 - mtp_num_layers < 0:
        return None
    between = "t" * n
    middle = f"({between}|)*{stages - 2}" if stages > 3 else f"{between}|" * (stages - 2)
    return f"E{'t' * (n - 1)}|{middle}{'t' * (n - 1 - mtp_num_layers)}{'m' * mtp_num_layers}L"
