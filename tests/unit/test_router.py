"""MoEConfig validation and the Router module on one process (no process group: groups of size 1)."""

import dataclasses

import pytest
import torch

from folding.moe.config import MoEConfig
from folding.moe.routing import functions as R
from folding.moe.routing.router import Router, attach_loss
from folding.moe.settings import LayerSettings
from folding.optim.expert_bias import update_expert_biases
from folding.parallel.groups import ProcessGroups
from folding.parallel.params import materialize, param_spec

H = 6


def cfg(**kw):
    base = dict(num_experts=4, topk=2, ffn_hidden_size=8)
    base.update(kw)
    return MoEConfig(**base)


def router(**kw):
    seed = kw.pop("init_seed", 0)
    return Router(hidden_size=H, config=cfg(**kw), groups=ProcessGroups.single(), init_seed=seed)


# ------------------------------------------------------------------------------------ config
@pytest.mark.parametrize(
    "kw,field",
    [
        (dict(topk=5), "moe.topk"),
        (dict(num_experts=6, num_groups=4, group_topk=1), "moe.num_groups"),
        (dict(num_experts=8, num_groups=2, group_topk=3, topk=4), "moe.group_topk"),
        (dict(num_groups=2), "moe.group_topk"),
        (dict(topk=1), "moe.topk"),
        (dict(capacity_factor=0.0), "moe.capacity_factor"),
        (dict(capacity_factor=-1.0), "moe.capacity_factor"),
        (dict(score_function="relu"), "moe.score_function"),
        (dict(drop_policy="random"), "moe.drop_policy"),
        (dict(aux_loss_type="switch"), "moe.aux_loss_type"),
        (dict(router_dtype="bf16"), "moe.router_dtype"),
        (dict(dispatcher="deepep"), "moe.dispatcher"),
        (dict(dispatch_wire="int8"), "moe.dispatch_wire"),
        (dict(expert_backend="cutlass"), "moe.expert_backend"),
        (dict(fp8_recipe="hybrid"), "moe.fp8_recipe"),
        (dict(pad_to_capacity=True), "moe.pad_to_capacity"),
        (dict(aux_loss_coeff=-0.1), "moe.aux_loss_coeff"),
        (dict(shared_expert_gate=True), "moe.shared_expert_gate"),
        (dict(score_function="sigmoid", pre_softmax=True), "moe.pre_softmax"),
    ],
)
def test_config_rejects_with_field_name(kw, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        cfg(**kw)


def test_config_accepts_legal_and_documents_every_field():
    cfg(topk=1, pre_softmax=True)
    cfg(topk=1, score_function="sigmoid")
    cfg(num_experts=8, topk=4, num_groups=4, group_topk=2, capacity_factor=1.25, pad_to_capacity=True)
    src = open(MoEConfig.__module__.replace(".", "/") + ".py").read()
    for f in dataclasses.fields(MoEConfig):  # a docstring line follows every field
        after = src.split(f"\n    {f.name}:", 1)[1].split("\n", 2)[1].strip()
        assert after.startswith('"""'), f.name
    c = cfg()
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.topk = 9  # the one record cannot drift after validation
    with pytest.raises(ValueError, match="moe.topk"):
        c.replace(topk=9)
    with pytest.raises(ValueError, match="unknown MoE option"):
        c.replace(top_k=2)


# ------------------------------------------------------------------------------------ module
def test_init_is_seeded_and_recorded():
    a, b = router(), router()
    assert torch.equal(a.weight, b.weight)
    assert not torch.equal(a.weight, router(init_seed=1).weight)
    assert a.weight.shape == (4, H) and a.weight.dtype == torch.float32
    spec = param_spec(a.weight)
    assert spec.sequence_parallel and spec.full_shape == (4, H) and spec.shards == ()
    # init_seed=None: the owner fills it from the record, e.g. on another device after a meta build
    meta = Router(hidden_size=H, config=cfg(), groups=ProcessGroups.single(), init_seed=None, device="meta")
    materialize(meta, device="cpu", init_seed=0)
    assert torch.equal(meta.weight, a.weight)


@pytest.mark.parametrize("dtype", ["fp32", "fp64"])
def test_forward_matches_pure_functions(dtype):
    r = router(router_dtype=dtype, num_experts=8, topk=4, num_groups=4, group_topk=2, topk_scaling_factor=1.5)
    x = torch.randn(3, 2, H)
    out = r(x)
    probs, rmap = out.probs_TE, out.routing_map_TE
    want = torch.float32 if dtype == "fp32" else torch.float64
    logits = x.reshape(-1, H).to(want) @ r.weight.detach().to(want).T
    ref_p, ref_m = R.topk_routing(logits, topk=4, num_groups=4, group_topk=2, scaling_factor=1.5)
    assert probs.dtype == want and probs.shape == (6, 8)
    torch.testing.assert_close(probs, ref_p)
    assert torch.equal(rmap, ref_m)


@pytest.mark.parametrize("aux_type", ["aux_loss", "seq_aux_loss", "global_aux_loss"])
def test_losses_do_not_change_output_and_add_scaled_gradient(aux_type):
    torch.manual_seed(0)
    x = torch.randn(4, 2, H, dtype=torch.float64)
    G = torch.randn(8, 4, dtype=torch.float64)
    plain = router(router_dtype="fp64")
    lossy = router(router_dtype="fp64", aux_loss_type=aux_type, aux_loss_coeff=0.3, z_loss_coeff=0.05)
    p0 = plain(x).probs_TE
    out = lossy(x, aux_loss_scale=0.7)
    p1 = out.probs_TE
    assert torch.equal(p0, p1)
    (p0 * G).sum().backward()
    (p1 * G).sum().backward()
    # independent reference: the losses computed directly and added with weight 0.7
    W = lossy.weight.detach().clone().requires_grad_()
    logits = x.reshape(-1, H) @ W.double().T
    scores, amap = R.aux_loss_scores(logits, topk=2)
    if aux_type == "seq_aux_loss":
        aux = R.seq_aux_loss(
            scores,
            R.tokens_per_sequence_expert(amap, num_sequences=2),
            num_sequences=2,
            seq_length=4,
            topk=2,
            num_experts=4,
            coeff=0.3,
        )
    else:
        aux = R.switch_aux_loss(scores, amap.sum(0), total_num_tokens=8, topk=2, num_experts=4, coeff=0.3)
    z = R.z_loss(logits, coeff=0.05)
    (0.7 * (aux + z)).backward()
    torch.testing.assert_close(lossy.weight.grad - plain.weight.grad, W.grad)
    torch.testing.assert_close(out.stats.losses[aux_type], aux.detach())
    torch.testing.assert_close(out.stats.losses["z_loss"], z.detach())
    assert not any(v.requires_grad for v in out.stats.losses.values())


def test_losses_off_in_eval_and_seq_aux_needs_sequences():
    r = router(aux_loss_type="seq_aux_loss", aux_loss_coeff=0.1)
    with pytest.raises(ValueError, match="num_sequences"):
        r(torch.randn(8, H))
    assert set(r(torch.randn(8, H), num_sequences=2).stats.losses) == {"seq_aux_loss"}
    r.eval()
    assert r(torch.randn(8, H)).stats.losses == {}
    with pytest.raises(ValueError, match="hidden_size=6"):
        r(torch.randn(8, H + 1))


def test_global_aux_loss_accumulates_until_reset():
    r = router(aux_loss_type="global_aux_loss", aux_loss_coeff=1.0)
    x1, x2 = torch.randn(5, H), torch.randn(5, H)
    r(x1)
    out = r(x2)
    counts = sum(R.aux_loss_scores(x @ r.weight.detach().T, topk=2)[1].sum(0).double() for x in (x1, x2))
    assert r.global_aux_steps == 2 and torch.equal(r.global_tokens_per_expert, counts)
    # the second loss uses the running mean of the counts
    scores, _ = R.aux_loss_scores(x2 @ r.weight.detach().T, topk=2)
    ref = R.switch_aux_loss(scores, counts / 2, total_num_tokens=5, topk=2, num_experts=4, coeff=1.0)
    torch.testing.assert_close(out.stats.losses["global_aux_loss"], ref)
    r.reset_global_aux_loss()
    assert r.global_aux_steps == 0 and not r.global_tokens_per_expert.any()


def test_attach_loss_identity():
    x = torch.randn(3, requires_grad=True)
    w = torch.tensor(2.0, requires_grad=True)
    y = attach_loss(x, w * 3, 0.5)
    assert torch.equal(y, x)
    y.sum().backward()
    assert torch.equal(x.grad, torch.ones(3)) and w.grad.item() == 1.5


def test_capacity_stats_and_force_balance():
    r = router(num_experts=4, topk=2, capacity_factor=0.5, drop_policy="position")
    out = r(torch.randn(8, H))
    m, stats = out.routing_map_TE, out.stats
    cap = R.expert_capacity(8, topk=2, num_experts=4, capacity_factor=0.5)  # = 2
    assert (m.sum(0) <= cap).all() and int(stats.dropped) == 16 - int(m.sum())
    assert torch.equal(stats.tokens_per_expert_E, m.sum(0))
    # every routed pair is kept or dropped at its expert: top-2 of 8 tokens is 16 pairs
    assert int((stats.tokens_per_expert_E + stats.dropped_per_expert_E).sum()) == 16
    fb = router(num_experts=4, topk=2, force_balance=True)
    out = fb(torch.randn(8, H) * 10)
    p, m = out.probs_TE, out.routing_map_TE
    assert m.sum(0).tolist() == [4, 4, 4, 4]
    torch.testing.assert_close(p.sum(1), torch.ones(8))


def test_expert_bias_balances_a_skewed_router():
    torch.manual_seed(0)
    r = router(num_experts=4, topk=1, pre_softmax=True, expert_bias=True, expert_bias_update_rate=0.05)
    with torch.no_grad():
        r.weight[0] += 0.5  # expert 0 attracts most tokens
    x = torch.randn(64, H) + 1.0
    x[:, :] = x.abs()
    loads = []
    for _ in range(40):
        m = r(x).routing_map_TE
        loads.append(m.sum(0))
        before = r.expert_bias.clone()
        counts = r.local_tokens_per_expert.clone()
        update_expert_biases([r], group=None)
        step = r.expert_bias - before
        # each expert moves by exactly ±rate (0 at the mean), downwards when overloaded
        torch.testing.assert_close(step, 0.05 * torch.sign(counts.mean() - counts))
        assert not r.local_tokens_per_expert.any()
    assert loads[0].max() > 40 and loads[-1].max() < loads[0].max() - 15
    # the bias never enters the probabilities: probs of the chosen expert = plain softmax score
    out = r(x)
    p, m = out.probs_TE, out.routing_map_TE
    soft = torch.softmax(x @ r.weight.detach().T, -1)
    torch.testing.assert_close(p[m], soft[m])


def test_routers_are_found_by_their_balancing_interface():
    """find_routers returns every MoE layer's router by its class, not a module that merely has a
    router's attributes; the interface reports the options the training step acts on."""
    from torch import nn

    from folding.model.presets import get_preset
    from folding.model.transformer import MoETransformer
    from folding.moe.routing.balancing import BalancingRouter, find_routers

    model = MoETransformer(
        get_preset("qwen2_moe_tiny", num_layers=3, mlp_only_layers=(1,)), settings=LayerSettings(init_seed=0)
    )
    lookalike = nn.Linear(2, 2)
    lookalike.layer_number, lookalike.has_expert_bias = 9, False
    found = find_routers([model, lookalike])
    assert [r.layer_number for r in found] == [0, 2]
    assert all(isinstance(r, BalancingRouter) for r in found)

    plain, biased = router(), router(expert_bias=True, aux_loss_type="global_aux_loss")
    assert (plain.has_expert_bias, biased.has_expert_bias) == (False, True)
    assert (plain.accumulates_global_aux_loss, biased.accumulates_global_aux_loss) == (False, True)
    with pytest.raises(ValueError, match="layer 0 has no expert bias"):
        plain.expert_demand()
    with pytest.raises(ValueError, match="layer 0 has no expert bias"):
        update_expert_biases([plain], group=None)


def test_config_mirrors_into_a_hydra_structured_schema():
    from omegaconf import OmegaConf
    from omegaconf.errors import ValidationError

    from folding.job.schema import mirror

    schema = OmegaConf.structured(mirror(MoEConfig))  # Literal fields become str for OmegaConf
    over = OmegaConf.from_dotlist(["num_experts=8", "topk=2", "ffn_hidden_size=16", "capacity_factor=1.5"])
    c = MoEConfig(**OmegaConf.to_container(OmegaConf.merge(schema, over)))
    assert c.capacity_factor == 1.5 and c.dispatcher == "alltoall"
    with pytest.raises(ValidationError):
        OmegaConf.merge(schema, OmegaConf.from_dotlist(["capacity_factor=lots"]))
    with pytest.raises(ValueError, match=r"moe\.dispatcher='magic': unknown value"):
        MoEConfig(**OmegaConf.to_container(OmegaConf.merge(schema, over, OmegaConf.from_dotlist(["dispatcher=magic"]))))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none on this machine)")
def test_cuda_router_matches_cpu():
    kw = dict(
        num_experts=8,
        topk=2,
        capacity_factor=1.0,
        pad_to_capacity=True,
        expert_bias=True,
        aux_loss_type="seq_aux_loss",
        aux_loss_coeff=0.1,
        z_loss_coeff=0.01,
        router_dtype="fp64",
    )
    cpu, gpu = router(**kw), router(**kw).cuda()
    x = torch.randn(4, 2, H, dtype=torch.float64)
    (p0, m0), (p1, m1) = ((o.probs_TE, o.routing_map_TE) for o in (cpu(x), gpu(x.cuda())))
    torch.testing.assert_close(p1.cpu(), p0)
    assert torch.equal(m1.cpu(), m0)
    p0.sum().backward()
    p1.sum().backward()
    torch.testing.assert_close(gpu.weight.grad.cpu(), cpu.weight.grad)
    update_expert_biases([gpu], group=None)


@pytest.mark.parametrize("aux_type", ["aux_loss", "seq_aux_loss", "global_aux_loss"])
def test_padding_tokens_count_nowhere(aux_type):
    torch.manual_seed(1)
    S, B = 4, 2
    x = torch.randn(S, B, H, dtype=torch.float64)
    G = torch.randn(S, B, 4, dtype=torch.float64)
    pad = torch.zeros(S, B, dtype=torch.bool)
    pad[3, 0] = pad[2, 1] = pad[3, 1] = True  # sequence 0 has 3 tokens, sequence 1 has 2
    kw = dict(router_dtype="fp64", aux_loss_type=aux_type, aux_loss_coeff=0.3, z_loss_coeff=0.05, expert_bias=True)
    padded = router(**kw)
    out = padded(x, padding_mask=pad)
    p, m = out.probs_TE, out.routing_map_TE
    assert m.sum(1).eq(2).all()  # padding tokens are still routed
    (p * G.reshape(-1, 4).masked_fill(pad.reshape(-1, 1), 0)).sum().backward()
    # reference: the valid tokens alone, with the losses written out per definition
    W = padded.weight.detach().clone().requires_grad_()
    valid = ~pad.reshape(-1)
    logits = (x.reshape(-1, H) @ W.double().T)[valid]
    probs, _ = R.topk_routing(logits, topk=2)
    scores, amap = R.aux_loss_scores(logits, topk=2)
    if aux_type == "seq_aux_loss":
        seq_of = torch.arange(S * B).remainder(B)[valid]  # token t = s·B + b
        aux = (
            sum(
                R.switch_aux_loss(
                    scores[seq_of == b], amap[seq_of == b].sum(0), total_num_tokens=n, topk=2, num_experts=4, coeff=0.3
                )
                for b, n in ((0, 3), (1, 2))
            )
            / B
        )
    else:
        aux = R.switch_aux_loss(scores, amap.sum(0), total_num_tokens=5, topk=2, num_experts=4, coeff=0.3)
    z = R.z_loss(logits, coeff=0.05)
    ((probs * G.reshape(-1, 4)[valid]).sum() + aux + z).backward()
    torch.testing.assert_close(out.stats.losses[aux_type], aux.detach())
    torch.testing.assert_close(out.stats.losses["z_loss"], z.detach())
    torch.testing.assert_close(padded.weight.grad, W.grad)
    assert padded.local_tokens_per_expert.sum() == 5 * 2  # expert-bias demand: valid tokens only
    with pytest.raises(ValueError, match="padding_mask"):
        padded(x, padding_mask=pad.reshape(-1))
