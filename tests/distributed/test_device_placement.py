"""Every builder creates every parameter and buffer on the requested device (``meta`` included),
and a meta build materialized on a real device equals a direct build, on 1 rank and 4 gloo ranks.

On a GPU, a tensor left on the CPU makes the first ``F.linear`` raise a device mismatch; on CPU it
goes unnoticed. Building on ``meta`` shows it here: every tensor that is not ``meta`` is listed.
"""

import os
import tempfile

import torch
import torch.distributed as dist

from folding.model.chunks import build_stage_chunks
from folding.model.hf.weights import from_hf, to_hf
from folding.model.moe_block import default_moe_factory
from folding.model.presets import get_preset
from folding.model.transformer import MoETransformer
from folding.moe.settings import LayerSettings
from folding.parallel import ParallelLayout, build_parallel_state
from folding.parallel.params import materialize

PRESETS = ("mixtral_tiny", "qwen2_moe_tiny")
LAYOUTS_4 = (dict(tp=2, ep=4, etp=1), dict(ep=2, etp=2), dict(pp=2, vpp=2, ep=2, etp=1))


def off_device(modules, device_type="meta"):
    """Names of the parameters and buffers of ``modules`` that are not on ``device_type``."""
    out = []
    for i, m in enumerate(modules):
        for name, t in list(m.named_parameters()) + list(m.named_buffers()):
            if t.device.type != device_type:
                out.append(f"{i}:{name}@{t.device}")
    return out


def _builders(preset, ps, hf_dir):
    """``name -> callable(device) -> list of modules`` for every builder of the engine."""
    cfg = get_preset(preset)
    builders = {
        "build_stage_chunks": lambda dev: build_stage_chunks(
            model_config=cfg, parallel_state=ps, settings=LayerSettings(device=dev, init_seed=7)
        ),
        "build_stage_chunks+default_moe_factory": lambda dev: build_stage_chunks(
            model_config=cfg,
            parallel_state=ps,
            settings=LayerSettings(device=dev, init_seed=7),
            moe_factory=default_moe_factory,
        ),
    }
    if ps is None or ps.layout.pp == 1:  # whole models; a pipelined one is built in chunks
        builders["from_hf"] = lambda dev: [from_hf(hf_dir, parallel_state=ps, device=dev)]
        builders["MoETransformer"] = lambda dev: [
            MoETransformer(cfg, parallel_state=ps, settings=LayerSettings(device=dev, init_seed=7))
        ]
        builders["MoETransformer+default_moe_factory"] = lambda dev: [
            MoETransformer(
                cfg, parallel_state=ps, settings=LayerSettings(device=dev, init_seed=7), moe_factory=default_moe_factory
            )
        ]
    if ps is None:
        del builders["build_stage_chunks"], builders["build_stage_chunks+default_moe_factory"]
    return builders


def _check(preset, ps, hf_dir):
    """``(builder, off-device list on meta, mismatching tensors after materialize)`` per builder."""
    report = []
    for name, build in _builders(preset, ps, hf_dir).items():
        meta = build("meta")
        stray = off_device(meta)
        mismatch = []
        if name != "from_hf":  # a meta from_hf reads nothing: it has no values to compare
            direct = build("cpu")
            for m in meta:
                materialize(m, device="cpu", init_seed=7)
            for i, (a, b) in enumerate(zip(meta, direct)):
                sa, sb = a.state_dict(), b.state_dict()
                mismatch += [f"{i}:{k}" for k in sb if torch.is_tensor(sb[k]) and not torch.equal(sa[k], sb[k])]
                for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
                    if vars(p) != vars(q):  # init specs and gradient-reduction tags survive
                        mismatch.append(f"{i}:{n} attributes")
        report.append((name, stray, mismatch))
    return report


def _hf_dirs(root):
    out = {}
    for preset in PRESETS:
        out[preset] = os.path.join(root, preset)
        to_hf(MoETransformer(get_preset(preset), settings=LayerSettings(init_seed=3)), out[preset])
    return out


def test_one_rank_builders_place_everything_on_meta():
    with tempfile.TemporaryDirectory() as root:
        dirs = _hf_dirs(root)
        for preset in PRESETS:
            for name, stray, mismatch in _check(preset, None, dirs[preset]):
                assert stray == [], (preset, name, stray)
                assert mismatch == [], (preset, name, mismatch)


def _run_layouts(hf_dirs):
    out = []
    for layout_kw in LAYOUTS_4:
        with build_parallel_state(ParallelLayout(world_size=dist.get_world_size(), **layout_kw)) as ps:
            for preset in PRESETS:
                out.append((layout_kw, preset, _check(preset, ps, hf_dirs[preset])))
    return out


def test_four_rank_builders_place_everything_on_meta(ranks):
    with tempfile.TemporaryDirectory() as root:
        dirs = _hf_dirs(root)
        results = ranks(4).run(_run_layouts, dirs)
    checked = 0
    for rank_out in results:
        for layout_kw, preset, report in rank_out:
            for name, stray, mismatch in report:
                assert stray == [], (layout_kw, preset, name, stray)
                assert mismatch == [], (layout_kw, preset, name, mismatch)
                checked += 1
    # five builders per layout without pipelining, the two chunk builders with it
    assert checked == 4 * len(PRESETS) * sum(5 if kw.get("pp", 1) == 1 else 2 for kw in LAYOUTS_4)
