"""The names of the offload modules (``train.offload_modules``, Megatron-Core's ``--offload-modules``), apart
from :mod:`folding.memory.offload` (which needs torch), so that the configuration, the memory model and the
planner read them without importing torch."""

OFFLOAD_MODULES = ("attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "expert_fc1", "moe_act")
"""Megatron-Core's offload modules, each a region of the engine's layer: the input norm, the QKV (or MLA's
down-) projections, the attention core, the output projection, the post-attention norm, the experts' fc1,
the experts' activation (fc1's output it keeps)."""
