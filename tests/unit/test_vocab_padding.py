"""``model.make_vocab_size_divisible_by``: the embedding and the output layer get the padded rows, a padded
model trains like the unpadded one with the same weights (the padded ids are never predicted: the same losses,
``-inf`` logits, no gradient on the padded rows), a TP rank's slice is masked from its first global id, and
the Hugging Face export holds the unpadded vocabulary (and loads back into a padded model)."""

import json
import os

import pytest
import torch

from folding.model.fused_cross_entropy import mask_padding
from folding.model.presets import get_preset
from folding.model.transformer import MoETransformer
from folding.moe.settings import LayerSettings
from tests.optional import require

pytestmark = pytest.mark.usefixtures("one_thread")

SIZES = dict(hidden_size=32, moe=dict(ffn_hidden_size=16))


def _pair():
    """A padded model (512 ids in 768 rows) and the unpadded one, with the same weights on the real rows."""
    padded = MoETransformer(get_preset("mixtral_tiny", make_vocab_size_divisible_by=384, **SIZES))
    plain = MoETransformer(get_preset("mixtral_tiny", **SIZES), settings=LayerSettings(init_seed=5))
    with torch.no_grad():
        for name, p in padded.named_parameters():
            q = dict(plain.named_parameters())[name]
            p[: q.shape[0]].copy_(q)  # the padded rows keep their own (random) values
    return padded, plain


def test_the_tables_have_the_padded_rows():
    cfg = get_preset("mixtral_tiny", make_vocab_size_divisible_by=384, **SIZES)
    assert (cfg.vocab_size, cfg.padded_vocab_size) == (512, 768)
    model = MoETransformer(cfg)
    assert model.embedding.weight.shape == model.output_weight.shape == (768, 32)
    assert cfg.embedding_params(tp=2) == 384 * 32
    odd = get_preset("mixtral_tiny", vocab_size=511, make_vocab_size_divisible_by=3, **SIZES)
    with pytest.raises(ValueError, match=r"model.vocab_size=511 \(padded to 513\) is not divisible by parallel.tp=2"):
        odd.check_divisible(tp=2)
    with pytest.raises(ValueError, match="model.make_vocab_size_divisible_by=0 must be an integer >= 1"):
        get_preset("mixtral_tiny", make_vocab_size_divisible_by=0)


def test_padded_ids_are_never_predicted():
    padded, plain = _pair()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 512, (2, 16), generator=g)
    losses = []
    for model in (padded, plain):
        model.zero_grad()
        loss = model(ids, labels=ids)
        loss.sum().backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-6, atol=0)
    for name in ("embedding.weight", "output_weight"):  # no gradient reaches the padded rows
        grad = dict(padded.named_parameters())[name].grad
        assert torch.count_nonzero(grad[512:]) == 0, name
        assert torch.count_nonzero(grad[:512]) > 0, name
        torch.testing.assert_close(grad[:512], dict(plain.named_parameters())[name].grad, rtol=1e-5, atol=1e-7)
    with torch.no_grad():
        logits, want = padded(ids), plain(ids)
    assert logits.shape == (2, 16, 768) and bool(torch.isneginf(logits[..., 512:]).all())
    torch.testing.assert_close(logits[..., :512], want, rtol=1e-5, atol=1e-6)


def test_a_vocabulary_slice_is_masked_from_its_first_global_id():
    # vocabulary 10 in 16 rows over TP4: slices [0, 4), [4, 8), [8, 12), [12, 16)
    for start, masked in ((0, 0), (4, 0), (8, 2), (12, 4)):
        out = mask_padding(torch.zeros(3, 4), start, 10)
        assert int(torch.isneginf(out).sum(-1)[0]) == masked, start
        assert bool(torch.isneginf(out[:, 4 - masked :]).all())


def test_the_hugging_face_export_is_unpadded(tmp_path):
    load_file = require("safetensors.torch").load_file

    from folding.model.hf.weights import from_hf, to_hf

    padded, _ = _pair()
    to_hf(padded, str(tmp_path))
    tensors = load_file(os.path.join(tmp_path, "model.safetensors"))
    assert tensors["model.embed_tokens.weight"].shape == tensors["lm_head.weight"].shape == (512, 32)
    assert torch.equal(tensors["lm_head.weight"], padded.output_weight.detach()[:512])
    assert json.load(open(os.path.join(tmp_path, "config.json")))["vocab_size"] == 512
    back = from_hf(str(tmp_path), config_overrides={"make_vocab_size_divisible_by": 384})
    assert back.embedding.weight.shape == (768, 32)
    assert torch.equal(back.embedding.weight[:512], padded.embedding.weight.detach()[:512])
    assert torch.count_nonzero(back.embedding.weight[512:]) == 0  # the padding starts at zero
    ids = torch.randint(0, 512, (1, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(back(ids), padded(ids))
    # a training job that pads may start from the unpadded weights (checkpoint.init_from_hf)
    from folding.checkpoint.from_hf import check_init_source

    assert check_init_source(str(tmp_path), padded.config) == str(tmp_path)


def test_a_checkpoint_written_before_the_new_fields_matches_their_defaults():
    import dataclasses

    from folding.checkpoint.load import config_differences

    cfg = get_preset("mixtral_tiny", **SIZES)
    old = {
        k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("make_vocab_size_divisible_by", "hidden_dropout")
    }
    assert config_differences(old, cfg, free_model_fields=(), moe_fields=()) == []
    padded = cfg.replace(make_vocab_size_divisible_by=384)
    assert config_differences(old, padded, free_model_fields=(), moe_fields=()) == [
        ("model.make_vocab_size_divisible_by", 1, 384)
    ]
