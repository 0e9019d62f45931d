"""Checks shared by the transformers parity tests: an engine model converted from a Hugging Face model
gives its logits, LM loss and every parameter gradient (1 rank, fp32).

Usage::

    hf = MixtralForCausalLM(MixtralConfig(**TRAINABLE_MIXTRAL))      # the trainer can start from it
    job_model = get_preset("mixtral_tiny", **TRAINABLE_MIXTRAL_PRESET)
    hf_model = randomized(MixtralForCausalLM(MixtralConfig(**TINY_HF, ...))).eval()
    rel = assert_matches_hf(from_hf(path), hf_model, ids, "mixtral")    # ids [B, S]
"""

import torch

from folding.model.hf.names import hf_components
from folding.parallel.params import require_spec

TINY_HF = dict(vocab_size=128, hidden_size=32, num_hidden_layers=3, num_attention_heads=4)
"""Sizes every tiny HF test model shares."""

TRAINABLE_MIXTRAL = dict(
    vocab_size=320,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=16,
    num_local_experts=4,
    num_experts_per_tok=2,
    max_position_embeddings=512,
)
"""A transformers ``MixtralConfig`` that the trainer can start from (``checkpoint.init_from_hf``): its
vocabulary holds the byte tokenizer's 257 ids of the default data."""
TRAINABLE_MIXTRAL_PRESET = dict(
    vocab_size=320,
    hidden_size=32,
    num_layers=2,
    num_attention_heads=4,
    num_kv_heads=2,
    max_position_embeddings=512,
    moe=dict(num_experts=4, ffn_hidden_size=16, topk=2),
)
"""The same model as overrides of the ``mixtral_tiny`` preset."""


def randomized(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with every parameter drawn from N(0, 0.1) (seed 0), so that routing and attention are
    not trivial."""
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.1)
    return model


def hf_grads(model, family):
    """HF gradients under the checkpoint's tensor names (fused in-memory experts split per expert)."""
    names = ("w1", "w3", "w2") if family == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    moe = "block_sparse_moe" if family == "mixtral" else "mlp"
    out = {}
    for n, p in model.named_parameters():
        g = p.grad
        if n.endswith("experts.gate_up_proj") or n.endswith("experts.down_proj"):
            prefix = n.rsplit("experts.", 1)[0].replace(".mlp.", f".{moe}.") + "experts"
            for e in range(g.shape[0]):
                if n.endswith("gate_up_proj"):
                    gate, up = g[e].chunk(2)
                    out[f"{prefix}.{e}.{names[0]}.weight"], out[f"{prefix}.{e}.{names[1]}.weight"] = gate, up
                else:
                    out[f"{prefix}.{e}.{names[2]}.weight"] = g[e]
        elif family == "mixtral" and n.endswith("mlp.gate.weight"):
            out[n.replace(".mlp.", ".block_sparse_moe.")] = g
        else:
            out[n] = g
    return out


def assert_matches_hf(model, hf, ids: torch.Tensor, family: str) -> float:
    """Check ``model`` (the engine model) against ``hf`` (the transformers model it was converted from)
    on ``ids [B, S]``: logits within 1e-5 of the largest, the LM loss, and every parameter gradient,
    each HF parameter (tied ones once) compared exactly once. Returns the logits' relative error."""
    out = hf(ids, labels=ids)
    logits = model(ids)
    assert logits.shape == (*ids.shape, hf.config.vocab_size)
    rel = ((logits - out.logits).abs().max() / out.logits.abs().max()).item()
    assert rel <= 1e-5, rel
    # engine labels are already shifted (label t = token t+1); the last position has no target
    labels = torch.roll(ids, -1, dims=1)
    mask = torch.ones(ids.shape)
    mask[:, -1] = 0
    loss = model(ids, labels=labels, loss_mask=mask).sum() / mask.sum()
    torch.testing.assert_close(loss, out.loss, rtol=1e-5, atol=1e-6)
    loss.backward()
    out.loss.backward()
    ref = hf_grads(hf, family)
    checked = 0
    for name, p in model.named_parameters():
        g = p.grad.reshape(require_spec(p, name).full_shape)
        for lead, hf_name in hf_components(name, model.config):
            torch.testing.assert_close(g[lead] if lead else g, ref[hf_name], rtol=1e-4, atol=1e-6, msg=hf_name)
            checked += 1
    assert checked == len(ref)
    return rel
