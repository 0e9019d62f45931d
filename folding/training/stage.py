"""This rank's model chunks and one step's micro-batches: the two calls the trainer swaps.

``build_stage_chunks`` builds the chunks of the model this rank holds and ``run_microbatches`` runs
the forward (and backward) of a step's micro-batches through them. When the pipeline package provides
both (``folding.pipeline.stage``) they are used; otherwise the versions here serve ``parallel.pp=1``
(one chunk: the whole model, TP/SP/CP/EP inside it).

Loss contract: each micro-batch contributes ``masked_loss_sum * loss_scale`` to the objective, with
``loss_scale = 1 / global_unmasked_tokens`` so that gradients are *summed* over DP×CP and EDP
(REFERENCE.md §4b). ``run_microbatches`` returns ``lm_loss_sum``: the detached sum of this rank's
masked token losses (on the last pipeline stage; at this CP rank's positions; identical on TP ranks).

Usage::

    chunks = build_stage_chunks(model_config=m, moe_config=moe, parallel_state=ps, recompute="none",
                                params_dtype=torch.float32, init_seed=1234, device=dev)
    out = run_microbatches(chunks, microbatches, parallel_state=ps, loss_scale=1 / n_tokens,
                           forward_only=False, no_sync=opt.no_sync)
"""
from __future__ import annotations

import contextlib
import inspect
from typing import Callable, Dict, List, Optional, Sequence

import torch
from torch import nn

from ..model.config import ModelConfig


def moe_factory_for(moe_config) -> Callable[..., nn.Module]:
    """A model ``moe_factory`` building :class:`folding.moe.layer.MoELayer` blocks with ``moe_config``
    (the preset's options with the job's ``moe.*`` overrides)."""
    def factory(*, config: ModelConfig, layer_number: int, groups, init_seed: int = 0, device=None,
                dtype=torch.float32) -> nn.Module:
        from ..moe.layer import MoELayer
        return MoELayer(config=moe_config, hidden_size=config.hidden_size, ep_group=groups.ep,
                        etp_group=groups.etp, tp_cp_group=groups.tp_cp, tp_dp_cp_group=groups.tp_dp_cp,
                        tp_group=groups.tp, layer_number=layer_number, init_seed=init_seed)
    return factory


def _pipeline_stage():
    try:
        from ..pipeline import stage
    except ImportError:
        return None
    return stage if hasattr(stage, "build_stage_chunks") and hasattr(stage, "run_microbatches") else None


def build_stage_chunks(*, model_config: ModelConfig, moe_config, parallel_state, recompute: str = "none",
                       params_dtype: torch.dtype = torch.float32, init_seed: int = 0,
                       device=None) -> List[nn.Module]:
    """The model chunks this rank holds (one per virtual pipeline stage), on ``device`` in
    ``params_dtype``, initialized identically whatever the layout."""
    stage = _pipeline_stage()
    if stage is not None:
        return stage.build_stage_chunks(model_config=model_config, moe_config=moe_config,
                                        parallel_state=parallel_state, recompute=recompute,
                                        params_dtype=params_dtype, init_seed=init_seed, device=device)
    if parallel_state.layout.pp > 1:
        raise NotImplementedError("parallel.pp > 1 needs folding.pipeline.stage, which this installation "
                                  "lacks; set parallel.pp=1")
    from ..model.transformer import MoETransformer
    kwargs = dict(parallel_state=parallel_state, init_seed=init_seed, moe_factory=moe_factory_for(moe_config),
                  device=device, dtype=params_dtype)
    if "recompute" in inspect.signature(MoETransformer.__init__).parameters:
        kwargs["recompute"] = recompute
    elif recompute != "none":
        raise NotImplementedError(f"train.recompute={recompute!r} is not supported by this model build; "
                                  "set train.recompute=none")
    return [MoETransformer(model_config, **kwargs)]


def run_microbatches(chunks: Sequence[nn.Module], microbatches: Sequence[Dict[str, torch.Tensor]], *,
                     parallel_state, loss_scale: float, forward_only: bool = False,
                     no_sync: Optional[Callable[[], contextlib.AbstractContextManager]] = None
                     ) -> Dict[str, torch.Tensor]:
    """Forward (and, unless ``forward_only``, backward) every micro-batch of one step.

    ``no_sync`` (e.g. the optimizer's) wraps every micro-batch but the last so that gradient
    reduction runs once. Returns ``{"lm_loss_sum": tensor}`` (see the module docstring).
    """
    stage = _pipeline_stage()
    if stage is not None:
        return stage.run_microbatches(chunks, microbatches, parallel_state=parallel_state,
                                      loss_scale=loss_scale, forward_only=forward_only, no_sync=no_sync)
    if len(chunks) != 1:
        raise ValueError(f"without pipeline stages there is one model chunk, got {len(chunks)}")
    model = chunks[0]
    device = next(model.parameters()).device
    lm_loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    n = len(microbatches)
    for i, mb in enumerate(microbatches):
        ctx = no_sync() if (no_sync is not None and not forward_only and i < n - 1) else contextlib.nullcontext()
        with ctx, torch.set_grad_enabled(not forward_only):
            loss_BS = model(mb["tokens"].to(device), labels=mb["labels"].to(device),
                            loss_mask=mb["loss_mask"].to(device))
            loss_sum = loss_BS.float().sum()
            if not forward_only:
                (loss_sum * loss_scale).backward()
        lm_loss_sum += loss_sum.detach().double()
    return {"lm_loss_sum": lm_loss_sum}
