"""Multi-token prediction at 1 rank: the modules' losses equal a reference assembled by hand from
the same weights (explicit index arithmetic for the tokens and labels ahead, plain RMSNorm and
cross-entropy), forward and every gradient, for 2 depths; each depth reads exactly the tokens it
should (a changed token moves only the losses that may see it); the shift helper; the objective's
weighting; the MTP layer's router joins the MoE statistics; bad settings fail by name."""

import pytest
import torch
import torch.nn.functional as F

from folding.model.mtp import shift_left
from folding.model.presets import get_preset
from folding.model.transformer import MoETransformer
from folding.moe.settings import LayerSettings

S, B = 12, 2


def _model(depth=2, **kw):
    cfg = get_preset("deepseek_v3_tiny", mtp_num_layers=depth, mtp_loss_scaling_factor=0.3, **kw)
    return MoETransformer(cfg, settings=LayerSettings(init_seed=11, expert_backend="loop")).double()  # fp64: loop


def _batch(cfg, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (B, S), generator=g)
    labels = torch.randint(0, cfg.vocab_size, (B, S), generator=g)
    mask = (torch.rand(B, S, generator=g) > 0.2).double()
    return ids, labels, mask


def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _reference(model, ids, labels, mask):
    """(lm loss [B, S], mean MTP loss [B, S]) assembled without the engine's MTP code."""
    cfg = model.config
    eps = cfg.norm_eps
    rope = model.rope(S)
    h = _rms(model.run_layers(model.embed(ids), S), model.final_norm.weight, eps)  # [S, B, H]
    W = model.output_weight

    def ce(h_SBH, target_BS):
        logits = h_SBH.transpose(0, 1) @ W.t()  # [B, S, V]
        return F.cross_entropy(logits.reshape(B * S, -1), target_BS.reshape(-1), reduction="none").view(B, S)

    lm = ce(h, labels) * mask
    mtp = torch.zeros_like(lm)
    pos = torch.arange(S)
    for k, module in enumerate(model.mtp, 1):
        ahead = pos + k
        valid = ahead < S  # positions whose token k ahead exists
        idx = ahead.clamp(max=S - 1)
        tok = torch.where(valid, ids[:, idx], torch.zeros_like(ids))
        emb = model.embedding.weight[tok].transpose(0, 1)  # [S, B, H]
        x = torch.cat([_rms(emb, module.enorm.weight, eps), _rms(h, module.hnorm.weight, eps)], -1)
        x = x @ module.eh_proj.weight.t()
        h = _rms(module.layer(x, rope), module.head_norm.weight, eps)
        target = torch.where(valid, labels[:, idx], torch.zeros_like(labels))
        weight = torch.where(valid, mask[:, idx], torch.zeros_like(mask))
        mtp = mtp + ce(h, target) * weight
    return lm, mtp / len(model.mtp)


def test_mtp_matches_a_hand_assembled_reference():
    model = _model()
    ids, labels, mask = _batch(model.config)
    lm, mtp = model.stage_forward(ids, labels=labels, loss_mask=mask, loss_parts=True)
    ref_lm, ref_mtp = _reference(model, ids, labels, mask)
    # the engine's cross-entropy is fp32 (the fused vocab-parallel loss): compare at fp32 round-off
    torch.testing.assert_close(lm, ref_lm.float(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(mtp, ref_mtp.float(), rtol=1e-6, atol=1e-6)
    assert float(mtp[:, -1].abs().max()) == 0.0  # past the end for both depths
    total = model(ids, labels=labels, loss_mask=mask)
    torch.testing.assert_close(total, (ref_lm + 0.3 * ref_mtp).float(), rtol=1e-6, atol=1e-6)
    params = [p for p in model.parameters()]
    got = torch.autograd.grad(total.sum(), params)
    want = torch.autograd.grad((ref_lm + 0.3 * ref_mtp).sum(), params, allow_unused=True)
    names = [n for n, _ in model.named_parameters()]
    for n, a, b in zip(names, got, want):
        assert b is not None, n
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7, msg=n)
    # every MTP parameter learns, and the second module's projection sees the first module's output
    for n, g in zip(names, got):
        if n.startswith("mtp."):
            assert float(g.abs().max()) > 0, n


def test_each_depth_reads_the_tokens_it_should():
    """Changing token j changes the LM loss only at positions >= j, depth 1 at >= j-1 (it embeds the
    token one ahead), depth 2 at >= j-2; all earlier positions stay unchanged (to round-off)."""
    model = _model()
    cfg = model.config
    ids, labels, mask = _batch(cfg, seed=1)
    mask = torch.ones_like(mask)
    j = 7
    other = ids.clone()
    other[:, j] = (ids[:, j] + 1) % cfg.vocab_size
    with torch.no_grad():
        per_depth = []
        for x in (ids, other):
            model.mtp = model.mtp[:1]  # depth 1 alone, then both
            _, d1 = model.stage_forward(x, labels=labels, loss_mask=mask, loss_parts=True)
            per_depth.append(d1)
        model2 = _model()
        lm_a, both_a = model2.stage_forward(ids, labels=labels, loss_mask=mask, loss_parts=True)
        lm_b, both_b = model2.stage_forward(other, labels=labels, loss_mask=mask, loss_parts=True)
    d2_a, d2_b = 2 * both_a - per_depth[0], 2 * both_b - per_depth[1]  # depth 2's loss

    def same(a, b):  # expert GEMMs batch other rows differently: allow round-off of the fp32 loss
        return torch.allclose(a, b, rtol=0, atol=1e-6)

    def moved(a, b):
        return bool(((a - b).abs() > 1e-6).all())

    assert same(lm_a[:, :j], lm_b[:, :j]) and moved(lm_a[:, j], lm_b[:, j])
    assert same(per_depth[0][:, : j - 1], per_depth[1][:, : j - 1])
    assert moved(per_depth[0][:, j - 1], per_depth[1][:, j - 1])
    assert same(d2_a[:, : j - 2], d2_b[:, : j - 2]) and moved(d2_a[:, j - 2], d2_b[:, j - 2])


def test_shift_left():
    t = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    assert torch.equal(shift_left(t, 0, 0), t)
    assert torch.equal(shift_left(t, 1, 0), torch.tensor([[2, 3, 4, 0], [6, 7, 8, 0]]))
    assert torch.equal(shift_left(t, 3, -1), torch.tensor([[4, -1, -1, -1], [8, -1, -1, -1]]))
    assert torch.equal(shift_left(t, 9, 0), torch.zeros_like(t))


def test_without_labels_the_model_returns_the_main_logits():
    model = _model()
    ids, _, _ = _batch(model.config)
    base = MoETransformer(
        model.config.replace(mtp_num_layers=0), settings=LayerSettings(init_seed=11, expert_backend="loop")
    ).double()
    with torch.no_grad():
        torch.testing.assert_close(model(ids), base(ids), rtol=0, atol=0)


def test_mtp_router_joins_the_moe_statistics():
    from folding.training.telemetry.moe_stats import MoEStats

    model = _model(depth=1)
    cfg = model.config
    stats = MoEStats([model], model_config=cfg)
    assert stats.moe_layers == [1, 2, 3, 4]  # layer 0 is dense; 4 is the MTP layer
    ids, labels, mask = _batch(cfg)
    model(ids, labels=labels, loss_mask=mask)
    assert not stats.counts_LE.any()  # nothing until the step collects the layers' records
    stats.collect()
    counts = stats.counts_LE.sum(-1)
    assert torch.equal(counts, torch.full((4,), float(B * S * cfg.moe.topk), dtype=counts.dtype))
    stats.close()


@pytest.mark.parametrize(
    "field, value", [("mtp_num_layers", -1), ("mtp_num_layers", 1.5), ("mtp_loss_scaling_factor", -0.1)]
)
def test_bad_mtp_settings_fail_by_name(field, value):
    with pytest.raises(ValueError, match=f"model.{field}"):
        get_preset("deepseek_v3_tiny", **{field: value})
