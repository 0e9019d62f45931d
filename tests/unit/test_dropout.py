"""Dropout (``model.hidden_dropout``, ``model.attention_dropout``): the mask hash against an independent
SplitMix64 in Python integers, masks that depend on an element's coordinates and not on how the rows are
split (a CP×TP shard drops what one rank drops there), the unfused attention core against SDPA when nothing
is dropped, and the model: no dropout in eval mode, the same masks for the same samples whatever the global
RNG, recompute replaying them bit for bit (multi-head latent attention and multi-token prediction too), and a
clear error without sample indices."""

import pytest
import torch

from folding.model.context_parallel import causal_sdpa, cp_positions, dropout_attention
from folding.model.dropout import DropoutKeys, hidden_dropout, mix, probs_dropout
from folding.model.presets import get_preset
from folding.model.transformer import MoETransformer
from folding.moe.settings import LayerSettings

pytestmark = pytest.mark.usefixtures("one_thread")


def _splitmix64(x: int) -> int:
    """SplitMix64's output function (Steele, Lea, Flood 2014), written from its definition."""
    m = 2**64 - 1
    z = (x + 0x9E3779B97F4A7C15) & m
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    return z ^ (z >> 31)


def test_the_hash_is_splitmix64_on_the_unsigned_bits():
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-(2**63), 2**63 - 1, (200,), dtype=torch.int64, generator=g)
    x = torch.cat([x, torch.tensor([0, 1, -1, 2**63 - 1, -(2**63)])])
    got = [int(v) % 2**64 for v in mix(x)]
    assert got == [_splitmix64(int(v) % 2**64) for v in x]


def _keys(p_hidden, p_attn, sample, positions, queries=None, seed=7):
    return DropoutKeys(
        hidden=p_hidden,
        attention=p_attn,
        seed=seed,
        sample_B=torch.tensor(sample),
        positions_S=positions,
        query_positions_S=positions if queries is None else queries,
    ).at_layer(3)


def test_a_shard_drops_what_one_rank_drops_at_its_coordinates():
    S, B, H, cp, tp = 32, 2, 24, 2, 2
    full = hidden_dropout(torch.ones(S, B, H), _keys(0.25, 0.0, [40, 41], torch.arange(S)), "mlp_out")
    assert abs(float((full == 0).float().mean()) - 0.25) < 0.03  # the rate
    assert torch.equal(full.unique(), torch.tensor([0.0, 1 / 0.75]))  # kept elements scaled by 1/(1-p)
    for cp_rank in range(cp):  # this CP rank's chunks, then the TP split of the sequence
        pos = cp_positions(S, cp_rank, cp)
        n = pos.shape[0] // tp
        for tp_rank in range(tp):
            rows = pos[tp_rank * n : (tp_rank + 1) * n]
            shard = hidden_dropout(torch.ones(n, B, H), _keys(0.25, 0.0, [40, 41], rows), "mlp_out")
            assert torch.equal(shard, full[rows])
    # every coordinate counts: another sample, layer, kind or seed drops other elements
    others = [
        hidden_dropout(torch.ones(S, B, H), _keys(0.25, 0.0, [42, 41], torch.arange(S)), "mlp_out")[:, 0],
        hidden_dropout(torch.ones(S, B, H), _keys(0.25, 0.0, [40, 41], torch.arange(S)).at_layer(4), "mlp_out")[:, 0],
        hidden_dropout(torch.ones(S, B, H), _keys(0.25, 0.0, [40, 41], torch.arange(S)), "attention_out")[:, 0],
        hidden_dropout(torch.ones(S, B, H), _keys(0.25, 0.0, [40, 41], torch.arange(S), seed=8), "mlp_out")[:, 0],
    ]
    for other in others:
        assert not torch.equal(other, full[:, 0])
    # the attention probabilities: a CP rank's queries and a TP rank's heads are the full tensor's
    probs = torch.ones(B, 4, S, S)
    whole = probs_dropout(probs, _keys(0.0, 0.2, [40, 41], torch.arange(S)), head_offset=0)
    pos = cp_positions(S, 1, cp)
    part = probs_dropout(probs[:, 2:, : pos.shape[0]], _keys(0.0, 0.2, [40, 41], pos, queries=pos), head_offset=2)
    assert torch.equal(part, whole[:, 2:][:, :, pos])
    assert abs(float((whole == 0).float().mean()) - 0.2) < 0.02


def test_the_unfused_core_is_causal_attention_when_nothing_is_dropped():
    g = torch.Generator().manual_seed(1)
    B, A, K, S, D = 2, 4, 2, 16, 8
    q, k, v = (torch.randn(B, n, S, D, generator=g) for n in (A, K, K))
    keep_all = _keys(0.0, 1e-15, [0, 1], torch.arange(S))  # rounds to a threshold of 0: every element kept
    got = dropout_attention(q, k, v, scale=D**-0.5, dropout=keep_all, head_offset=0)
    want = causal_sdpa(q, k, v, scale=D**-0.5, chunk_starts=(0,), enable_gqa=True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    pos = cp_positions(S, 0, 2)  # CP rank 0 of 2: chunks 0 and 3 attend the whole prefix
    got = dropout_attention(q[:, :, pos], k, v, scale=D**-0.5, dropout=_keys(0.0, 1e-15, [0, 1], pos), head_offset=0)
    want = causal_sdpa(q[:, :, pos], k, v, scale=D**-0.5, chunk_starts=(0, 12), enable_gqa=True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def _model(recompute="none", preset="mixtral_tiny", **dropout):
    cfg = get_preset(preset, hidden_size=32, moe=dict(ffn_hidden_size=16), **dropout)
    return MoETransformer(cfg, settings=LayerSettings(init_seed=3, recompute=recompute))


def _loss_and_grads(model, ids, sample):
    model.zero_grad()
    loss = model(ids, labels=ids, sample_index=sample).sum()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_the_model_drops_by_sample_and_replays_the_masks_in_recompute():
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(2))
    sample = torch.tensor([8, 9])
    rates = dict(hidden_dropout=0.1, attention_dropout=0.2)
    plain = _model()
    model = _model(**rates)
    model.eval()  # eval mode: no dropout, whatever the rates
    assert torch.equal(model(ids, labels=ids), plain.eval()(ids, labels=ids))
    model.train()
    loss, grads = _loss_and_grads(model, ids, sample)
    with torch.no_grad():
        assert abs(float(loss) - float(plain(ids, labels=ids).sum())) > 1e-2  # dropout acted
    torch.manual_seed(123)  # the masks draw nothing from the global generator
    again, _ = _loss_and_grads(model, ids, sample)
    assert torch.equal(loss, again)
    other, _ = _loss_and_grads(model, ids, torch.tensor([10, 9]))
    assert not torch.equal(loss, other)  # another sample, other masks
    for recompute in ("full", "core_attn,layernorm,moe"):  # the recomputed forwards drop the same elements
        r_loss, r_grads = _loss_and_grads(_model(recompute, **rates), ids, sample)
        assert torch.equal(r_loss, loss), recompute
        assert sorted(r_grads) == sorted(grads)
        for name in grads:
            assert torch.equal(r_grads[name], grads[name]), (recompute, name)
    with pytest.raises(ValueError, match="need each sequence's global sample index: pass sample_index="):
        model(ids, labels=ids)


def test_latent_attention_and_multi_token_prediction_replay_their_masks():
    """DeepSeek-V3's attention core (MLA's widths) and its MTP module (an embedding and a layer of its own)
    drop too, and recomputing the core and the up-projections drops the same elements."""
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(4))
    sample, rates = torch.tensor([3, 4]), dict(hidden_dropout=0.1, attention_dropout=0.2)
    model = _model(preset="deepseek_v3_tiny", **rates)
    assert model.config.mla is not None and model.config.mtp_num_layers > 0
    loss, grads = _loss_and_grads(model, ids, sample)
    with torch.no_grad():
        plain = _model(preset="deepseek_v3_tiny")(ids, labels=ids, sample_index=sample).sum()
    assert abs(float(loss) - float(plain)) > 1e-2
    r_loss, r_grads = _loss_and_grads(_model("core_attn,mla_up_proj", "deepseek_v3_tiny", **rates), ids, sample)
    assert torch.equal(r_loss, loss)
    for name in grads:
        assert torch.equal(r_grads[name], grads[name]), name


def test_rates_outside_zero_to_one_name_the_key():
    for key, value in (("hidden_dropout", 1.0), ("attention_dropout", -0.1), ("hidden_dropout", "0.1")):
        with pytest.raises(ValueError, match=f"model.{key}=.* must be a number in \\[0, 1\\)"):
            get_preset("mixtral_tiny", **{key: value})
