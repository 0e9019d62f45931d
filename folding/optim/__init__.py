"""Folded gradient reduction, the distributed optimizer, clipping and LR schedules.

Usage::

    from folding.optim import FoldedOptimizer, OptimConfig, lr_at
    opt = FoldedOptimizer(model, OptimConfig(lr=3e-4, distributed=True), parallel_state=ps,
                          train_steps=1000)
"""

from .config import OptimConfig, OptimConfigError
from .expert_bias import update_expert_biases
from .optimizer import FoldedOptimizer
from .param_groups import ParamClass, classify, uses_weight_decay
from .schedules import lr_at

__all__ = [
    "OptimConfig",
    "OptimConfigError",
    "FoldedOptimizer",
    "ParamClass",
    "classify",
    "uses_weight_decay",
    "lr_at",
    "update_expert_biases",
]
