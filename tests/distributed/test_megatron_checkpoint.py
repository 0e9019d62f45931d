"""A Megatron-Core checkpoint read by ``tools/convert_megatron.py`` gives the engine Megatron-Core's logits.

On 4 gloo ranks, Megatron-Core 0.16.1 builds a ``GPTModel`` with MoE layers (local spec: SequentialMLP
experts, RMSNorm, SwiGLU, RoPE, GQA; ``tests/megatron_cpu.py``) in TP2 (sequence parallel) EP2 ETP1, fp32,
saves it with its own ``dist_checkpointing.save`` (``torch_dist``, into ``DIR/iter_0000007`` with the
``latest_checkpointed_iteration.txt`` tracker, as Megatron-LM lays it out), and runs its forward on fixed
token ids. The tool then converts ``DIR`` on one process, and the engine's model of the converted
checkpoint (``load_model``) must give the same logits within 1e-5, for a Mixtral-style model and a
Qwen3-MoE-style one (per-head q/k RMSNorm, head dim 16 with hidden 32). One pool of 4 ranks serves both.
For the Mixtral-style one, ``checkpoint.init_from_megatron`` as the trainer runs it in TP2 EP2 must give
every rank exactly its slices of the converted tensors.
"""

import os
import zlib

import pytest
import torch

from tests.optional import require

require("megatron.core")

SIZES = dict(layers=2, hidden=32, heads=4, groups=2, experts=4, topk=2, ffn=24, vocab=64)
FAMILIES = {
    "mixtral": dict(qk_norm=False, head_dim=8, preset="mixtral_tiny"),
    "qwen3_moe": dict(qk_norm=True, head_dim=16, preset="qwen3_moe_tiny"),
}
ITERATION = 7


def _ids():
    return torch.randint(0, SIZES["vocab"], (2, 8), generator=torch.Generator().manual_seed(3))


def _save_megatron(family: str, out: str):
    """Every rank: build, perturb the norm weights (ones would hide a swapped norm), save, forward."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from tests.megatron_cpu import destroy_megatron, megatron_gpt_moe

    f = FAMILIES[family]
    model = megatron_gpt_moe(tp=2, ep=2, etp=1, qk_norm=f["qk_norm"], head_dim=f["head_dim"], **SIZES)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # replicated over TP: the same values on every rank
                gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
                p.add_(0.2 * torch.randn(p.shape, generator=gen))
    store = os.path.join(out, f"iter_{ITERATION:07d}")
    if dist.get_rank() == 0:
        os.makedirs(store)
        with open(os.path.join(out, "latest_checkpointed_iteration.txt"), "w") as fh:
            fh.write(str(ITERATION))
    dist.barrier()
    dist_checkpointing.save(model.sharded_state_dict(), store)
    ids = _ids()
    with torch.no_grad():
        S = ids.shape[1]
        causal = torch.triu(torch.ones(S, S, dtype=torch.bool), diagonal=1)[None, None]  # True: masked out
        logits = model(ids, torch.arange(S).expand_as(ids), causal)
    destroy_megatron()
    return logits


def _init_in_layout(family: str, src: str, converted: str):
    """Every rank: ``checkpoint.init_from_megatron`` as the trainer does it (checked, then built on meta and
    filled) in TP2 EP2 ETP1; the names of the parameters whose values are not this rank's slice of the
    converted checkpoint's tensor, and how many parameters were compared."""
    from folding.checkpoint.from_megatron import check_init_megatron, load_megatron_weights
    from folding.checkpoint.load import latest_complete
    from folding.job.config import JobConfig, ParallelConfig
    from folding.parallel import ParallelLayout, build_parallel_state
    from folding.parallel.params import require_spec, take_slice
    from folding.training.trainer import _build_chunks
    from tools.convert_megatron import model_config

    preset, over = _engine_config(family)
    cfg = model_config(preset, _overrides(over))
    job = JobConfig(model=cfg, parallel=ParallelConfig(tp=2, ep=2, etp=1))
    path = check_init_megatron(src, cfg)
    import torch.distributed.checkpoint as dcp

    step = latest_complete(converted)  # what the tool wrote: model/<name> by its full shape
    md = dcp.FileSystemReader(step).read_metadata().state_dict_metadata
    full = {k[len("model/") :]: torch.empty(tuple(v.size)) for k, v in md.items() if k.startswith("model/")}
    dcp.load({f"model/{k}": t for k, t in full.items()}, checkpoint_id=step, no_dist=True)
    with build_parallel_state(ParallelLayout(world_size=4, tp=2, ep=2, etp=1)) as ps:
        chunks = _build_chunks(
            job, ps, torch.device("cpu"), expert_backend=None, init_from=path, init_loader=load_megatron_weights
        )
    bad, n = [], 0
    for c in chunks:
        for name, p in c.named_parameters():
            spec, n = require_spec(p, name), n + 1
            if not torch.equal(
                p.detach(), take_slice(full[name].reshape(spec.full_shape), spec.shards).reshape(p.shape)
            ):
                bad.append(name)
    return bad, n


def _overrides(over):
    return [f"model.{k}={v}" for k, v in over.items() if k != "moe"] + [f"moe.{k}={v}" for k, v in over["moe"].items()]


def _engine_config(family: str):

    f, s = FAMILIES[family], SIZES
    over = dict(
        num_layers=s["layers"],
        hidden_size=s["hidden"],
        num_attention_heads=s["heads"],
        num_kv_heads=s["groups"],
        vocab_size=s["vocab"],
        norm_eps=1e-6,
        rope_theta=10000.0,
        moe={"num_experts": s["experts"], "topk": s["topk"], "ffn_hidden_size": s["ffn"], "pre_softmax": False},
    )
    if family == "qwen3_moe":
        over["head_dim"] = f["head_dim"]
    return f["preset"], over


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_converted_megatron_checkpoint_gives_megatrons_logits(ranks, tmp_path, family):
    from folding.checkpoint.load import load_model
    from tools import convert_megatron

    src, dst = str(tmp_path / "megatron"), str(tmp_path / "engine")
    theirs = ranks(4).run(_save_megatron, family, src)
    assert all(torch.equal(theirs[0], t) for t in theirs[1:])  # every rank holds the whole logits
    preset, over = _engine_config(family)
    args = ["--load", src, "--out", dst, "--model", preset, *_overrides(over)]
    assert convert_megatron.main(args) == 0
    assert os.path.isdir(os.path.join(dst, f"step_{ITERATION:08d}"))
    model = load_model(dst)
    ours = model(_ids())
    assert ours.shape == theirs[0].shape == (2, 8, SIZES["vocab"])
    diff = (ours - theirs[0]).abs().max().item()
    print(f"{family}: max |engine - Megatron-Core| over the logits = {diff:.3g}")
    assert diff <= 1e-5, f"{family}: engine logits differ from Megatron-Core's by {diff:.3g}"
    assert convert_megatron.main(args) == 2  # --out exists: refused, nothing overwritten
    if family == "mixtral":  # checkpoint.init_from_megatron: each rank of TP2 EP2 holds its slices
        for bad, n in ranks(4).run(_init_in_layout, family, src, dst):
            assert not bad and n >= 10, (bad, n)
