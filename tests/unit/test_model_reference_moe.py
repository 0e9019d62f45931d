"""A plain all-gather MoE block used to test the model before and beside the engine's MoE layer.

``ReferenceMoE`` follows the MoE-layer contract of ``folding.model.block`` (``[S/TP, B, H]`` in and
out) and the Hugging Face routers (Mixtral: softmax over the top-k logits; Qwen2-MoE: softmax over
all experts, top-k, optional renormalization, shared expert with a sigmoid gate). Distributed, it
all-gathers tokens and their routing weights over the ETP x EP group, computes this rank's experts
(its ETP slice of F) on every gathered token and reduce-scatters the partial outputs back: exact, not
fast. Parameter names match what ``folding.model.hf.weights`` maps: ``router.weight [E, H]``,
``experts.fc1_weight [E/EP, 2*F/ETP, H]`` (rows [gate shard; up shard]),
``experts.fc2_weight [E/EP, H, F/ETP]``, ``shared_expert.*``, ``shared_expert_gate.weight [1, H]``.

Legend: T tokens, E experts, H hidden, F expert FFN, K top-k.
"""

import torch
import torch.nn.functional as F
from torch import nn

from folding.model.config import ModelConfig
from folding.model.mlp import DenseMLP
from folding.moe.settings import LayerSettings
from folding.parallel.collectives import group_rank, group_size
from folding.parallel.groups import ProcessGroups
from folding.parallel.params import mark_param, set_init_spec
from tests.reference_collectives import domain_gather_v, domain_reduce_scatter_v


class ReferenceMoE(nn.Module):
    def __init__(self, *, config: ModelConfig, layer_number: int, groups, settings: LayerSettings = LayerSettings()):
        super().__init__()
        if settings.overlap_comm or settings.delay_wgrad:
            raise ValueError("ReferenceMoE has no communication overlap: build it with overlap_comm=delay_wgrad=False")
        device, dtype = settings.device, settings.params_dtype
        c = config
        E, Fe, H = c.moe.num_experts, c.moe.ffn_hidden_size, c.hidden_size
        ep, etp = group_size(groups.ep), group_size(groups.etp)
        epr, etpr = group_rank(groups.ep), group_rank(groups.etp)
        self.config, self.groups = c, groups
        self.E_local, self.first_expert = E // ep, epr * (E // ep)
        self.router = nn.Module()
        self.router.weight = nn.Parameter(torch.empty(E, H, device=device, dtype=dtype))
        mark_param(self.router.weight, sequence_parallel=True)
        set_init_spec(self.router.weight, full_shape=(E, H), std=c.init_std)
        self.experts = nn.Module()
        self.experts.fc1_weight = nn.Parameter(torch.empty(E // ep, 2 * Fe // etp, H, device=device, dtype=dtype))
        self.experts.fc2_weight = nn.Parameter(torch.empty(E // ep, H, Fe // etp, device=device, dtype=dtype))
        mark_param(self.experts.fc1_weight, expert=True, tp_sharded=True)
        mark_param(self.experts.fc2_weight, expert=True, tp_sharded=True)
        set_init_spec(
            self.experts.fc1_weight,
            full_shape=(E, 2, Fe, H),
            shards=((0, epr, ep), (2, etpr, etp)),
            std=c.init_std,
            chunk_dim=0,
        )
        set_init_spec(
            self.experts.fc2_weight,
            full_shape=(E, H, Fe),
            shards=((0, epr, ep), (2, etpr, etp)),
            std=c.output_init_std,
            chunk_dim=0,
        )
        if c.moe.shared_expert_ffn_hidden_size:
            self.shared_expert = DenseMLP(
                H,
                c.moe.shared_expert_ffn_hidden_size,
                tp_group=groups.tp,
                name="moe.shared_expert_ffn_hidden_size",
                init_std=c.init_std,
                output_init_std=c.output_init_std,
                device=device,
                dtype=dtype,
            )
            if c.moe.shared_expert_gate:
                self.shared_expert_gate = nn.Module()
                self.shared_expert_gate.weight = nn.Parameter(torch.empty(1, H, device=device, dtype=dtype))
                mark_param(self.shared_expert_gate.weight, sequence_parallel=True)
                set_init_spec(self.shared_expert_gate.weight, full_shape=(1, H), std=c.init_std)

    def route(self, x_TH):
        c = self.config
        logits_TE = F.linear(x_TH, self.router.weight)
        if c.moe.pre_softmax:  # softmax over all experts, top-k, no renormalization
            scores_TE = torch.softmax(logits_TE.float(), dim=-1)
            top_TK, idx_TK = scores_TE.topk(c.moe.topk, dim=-1)
        else:
            top_logits_TK, idx_TK = logits_TE.topk(c.moe.topk, dim=-1)
            top_TK = torch.softmax(top_logits_TK.float(), dim=-1)
        return torch.zeros_like(logits_TE).scatter(1, idx_TK, top_TK.to(logits_TE.dtype))

    def forward(self, x_SBH):
        shape = x_SBH.shape
        x_TH = x_SBH.reshape(-1, shape[-1])
        weights_TE = self.route(x_TH)
        etp, ep = self.groups.etp, self.groups.ep  # the ETP x EP domain: gather over ETP, then EP
        xa_TH, sizes = domain_gather_v(x_TH, etp, ep)
        wa_TE, _ = domain_gather_v(weights_TE, etp, ep)
        out_TH = torch.zeros_like(xa_TH)
        for e in range(self.E_local):
            w_T = wa_TE[:, self.first_expert + e]
            rows = (w_T > 0).nonzero().squeeze(1)
            if rows.numel() == 0:
                continue
            gate, up = F.linear(xa_TH[rows], self.experts.fc1_weight[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.experts.fc2_weight[e]) * w_T[rows, None]
            out_TH = out_TH.index_add(0, rows, y)
        y_TH = domain_reduce_scatter_v(out_TH, etp, ep, sizes)
        y = y_TH.view(shape)
        if hasattr(self, "shared_expert"):
            s = self.shared_expert(x_SBH)
            if hasattr(self, "shared_expert_gate"):
                s = torch.sigmoid(F.linear(x_SBH, self.shared_expert_gate.weight)) * s
            y = y + s
        return y


def reference_moe_factory(**kwargs):
    return ReferenceMoE(**kwargs)


def test_reference_moe_matches_per_token_loop():
    """The reference MoE equals a per-token loop over the chosen experts (Mixtral and Qwen2 routing)."""
    from folding.model.presets import get_preset
    from folding.parallel.params import initialize_parameters

    for name in ("mixtral_tiny", "qwen2_moe_tiny"):
        cfg = get_preset(
            name,
            hidden_size=16,
            moe=dict(ffn_hidden_size=8, shared_expert_ffn_hidden_size=None if name == "mixtral_tiny" else 8),
        )
        moe = ReferenceMoE(config=cfg, layer_number=0, groups=ProcessGroups.single())
        initialize_parameters(moe, 3)
        x = torch.randn(5, 2, 16)
        y = moe(x)
        xt = x.reshape(-1, 16)
        for t in range(xt.shape[0]):
            logits = moe.router.weight @ xt[t]
            p = torch.softmax(logits, -1)
            top, idx = p.topk(cfg.moe.topk)
            if not cfg.moe.pre_softmax:  # post-softmax: the softmax of the k selected logits
                top = top / top.sum()
            ref = torch.zeros(16)
            for k in range(cfg.moe.topk):
                w1 = moe.experts.fc1_weight[idx[k]]
                g, u = (w1 @ xt[t]).chunk(2)
                ref += top[k] * (moe.experts.fc2_weight[idx[k]] @ (F.silu(g) * u))
            if cfg.moe.shared_expert_ffn_hidden_size:
                se = moe.shared_expert
                s = se.down_proj.weight @ (F.silu(se.gate_proj.weight @ xt[t]) * (se.up_proj.weight @ xt[t]))
                ref += torch.sigmoid(moe.shared_expert_gate.weight[0] @ xt[t]) * s
            torch.testing.assert_close(y.reshape(-1, 16)[t], ref, rtol=1e-5, atol=1e-6)
