"""The learning rate of a job that leaves ``optim.lr`` (and ``optim.min_lr``) null: from scratch or fine-tuning.

``configs/config.yaml`` leaves both null. A job that trains from a random initialization then gets the
demo's :data:`DEMO_LR` (with the ``mixtral_tiny`` preset every layer's expert load stays balanced:
docs/routing.md); a job that starts from weights trained elsewhere (``checkpoint.init_from_hf``, which
``model=from_hf`` requires) gets :data:`FINE_TUNE_LR`, since the demo's rate, 150 times a usual fine-tuning
rate, would undo what the weights learned in a few steps. A null ``optim.min_lr`` is ``optim.lr`` /
:data:`MIN_LR_DIVISOR` (the demo's 3e-4 for its 1.5e-3). A rate the job sets (a recipe, the command line)
is kept. For a job from Hugging Face weights a start-up line says where the rate came from.

Usage::

    notes = resolve_learning_rate(optim_values, init_from_hf=tree["checkpoint"].get("init_from_hf"))
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

DEMO_LR = 1.5e-3
"""``optim.lr`` of a job from scratch that leaves it null (the demo's, tuned for ``mixtral_tiny``)."""
FINE_TUNE_LR = 1e-5
"""``optim.lr`` of a job from ``checkpoint.init_from_hf`` weights that leaves it null."""
MIN_LR_DIVISOR = 5
"""A null ``optim.min_lr`` is ``optim.lr`` divided by this."""


def _short(x: float) -> float:
    return float(f"{x:.6g}")


def resolve_learning_rate(optim: Dict[str, Any], *, init_from_hf: Optional[str]) -> List[str]:
    """Fill a null ``lr`` / ``min_lr`` of the ``optim`` section ``optim`` (a plain dict, changed in place) as
    the module docstring says; return the start-up lines that say where the rate came from (one line for a
    job from ``init_from_hf``, none from scratch). A key that is absent keeps the dataclass default."""
    notes = []
    given = optim.get("lr")
    if "lr" in optim and given is None:
        optim["lr"] = FINE_TUNE_LR if init_from_hf else DEMO_LR
    lr = optim.get("lr")
    min_lr_null = "min_lr" in optim and optim["min_lr"] is None
    if min_lr_null and isinstance(lr, (int, float)) and not isinstance(lr, bool):
        optim["min_lr"] = _short(lr / MIN_LR_DIVISOR)
    if not init_from_hf or "lr" not in optim:
        return notes
    tail = f", optim.min_lr {optim['min_lr']} (optim.lr / {MIN_LR_DIVISOR})" if min_lr_null else ""
    if given is None:
        notes.append(
            f"optim.lr: {FINE_TUNE_LR} (the fine-tuning default for weights from checkpoint.init_from_hf; from "
            f"scratch it would be {DEMO_LR}; set optim.lr to choose){tail}"
        )
    else:
        notes.append(
            f"optim.lr: {given} (set by the job; for weights from checkpoint.init_from_hf the default is "
            f"{FINE_TUNE_LR}){tail}"
        )
    return notes
