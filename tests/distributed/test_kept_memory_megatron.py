"""The MoE block keeps no more for backward than Megatron-Core's ``MoELayer`` (0.16.1) of the same shape, in bf16.

The same census as ``tests/unit/test_kept_memory.py`` (:class:`folding.testing.kept_memory.KeptCensus`: every
storage a forward creates and leaves alive, the block's input included when the block keeps it), on one gloo
rank (Megatron-Core builds its layer inside a process group): Megatron-Core's ``MoELayer`` with SequentialMLP
experts, the fused weighted SwiGLU, an fp32 router with the Switch aux loss and the all-to-all dispatcher
(``tests/megatron_cpu.py``), against folding's MoE block with the same sizes: hidden 256, 8 experts, top-2,
expert FFN 128, 512 tokens, bf16. folding's block must keep at most 1.05 times Megatron-Core's bytes.
"""

import torch

from tests.optional import require

require("megatron.core")

H, E, K, F, T = 256, 8, 2, 128, 512


def _blocks():
    from folding.model.presets import get_preset
    from folding.model.transformer import MoETransformer
    from folding.moe.settings import LayerSettings
    from folding.testing.kept_memory import KeptCensus
    from tests.megatron_cpu import megatron_moe_kept

    theirs = sum(k.nbytes for k in megatron_moe_kept(hidden=H, experts=E, topk=K, ffn=F, tokens=T))
    moe = {"num_experts": E, "topk": K, "ffn_hidden_size": F, "aux_loss_coeff": 0.01}
    cfg = get_preset("mixtral_tiny", num_layers=1, hidden_size=H, moe=moe)
    block = MoETransformer(cfg, settings=LayerSettings(init_seed=1, params_dtype=torch.bfloat16)).layers["0"].mlp
    x0 = torch.randn(T, 1, H, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(0))
    with KeptCensus(block) as census:
        x = census.make(lambda: x0.clone().requires_grad_())
        y = block(x)
    return sum(k.nbytes for k in census.kept(y)), theirs


def test_moe_block_keeps_at_most_megatron_cores_bytes(ranks):
    ours, theirs = ranks(1).run(_blocks)[0]
    # both keep the expert rows, fc1's output and fc2's input per routed row, the router's input and scores
    assert theirs > 2 * T * K * (H + 3 * F), theirs  # not an empty census
    assert ours <= 1.05 * theirs, f"folding keeps {ours / T:.0f} B/token, Megatron-Core {theirs / T:.0f}"
