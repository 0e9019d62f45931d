"""Checkpoint pieces that need no process group: which directory is loaded (only published ones
with the marker; the latest of a directory; a restarted job's own directory), pruning that leaves
foreign files alone, the model-compatibility check that runs before any tensor is read, and blocks
saved in one sharding and read back in another through DCP."""

import dataclasses
import json
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp

from folding.checkpoint import load as ck
from folding.checkpoint import save as cks
from folding.checkpoint.blocks import Block, BlockLoadPlanner, BlockSavePlanner
from folding.job.config import CheckpointConfig, ConfigError, JobConfig
from folding.job.validate import validate_job
from folding.model.presets import get_preset


def _job(**model_overrides):
    model = get_preset("mixtral_tiny", hidden_size=32, **model_overrides).replace(moe={"ffn_hidden_size": 16})
    return JobConfig(model=model)


def _fake_checkpoint(root, step, *, complete=True, job=None, name=None):
    path = os.path.join(root, name or ck.step_dir_name(step))
    os.makedirs(path)
    meta = {"format": ck.FORMAT, "step": step, "model": ck._plain(dataclasses.asdict((job or _job()).model))}
    with open(os.path.join(path, ck.META), "w") as f:
        json.dump(meta, f)
    if complete:
        open(os.path.join(path, ck.MARKER), "w").close()
    return path


def test_only_published_checkpoints_with_marker_count(tmp_path):
    root = str(tmp_path)
    _fake_checkpoint(root, 2)
    _fake_checkpoint(root, 5)
    _fake_checkpoint(root, 7, complete=False)  # crashed before its marker
    _fake_checkpoint(root, 9, name="step_00000009.tmp-123-456")  # crashed before its rename
    open(os.path.join(root, "notes.txt"), "w").close()
    assert [s for s, _ in ck.list_complete(root)] == [2, 5]
    assert ck.latest_complete(root).endswith("step_00000005")
    assert not ck.is_complete(os.path.join(root, "step_00000007"))
    assert not ck.is_complete(os.path.join(root, "step_00000009.tmp-123-456"))


def test_resolve_resume(tmp_path):
    root = str(tmp_path)
    assert ck.resolve_resume(CheckpointConfig(dir=root)) is None  # empty dir: a fresh start
    two = _fake_checkpoint(root, 2)
    _fake_checkpoint(root, 4)
    assert ck.resolve_resume(CheckpointConfig(dir=root)).endswith("step_00000004")  # torchrun restart
    assert ck.resolve_resume(CheckpointConfig(load=root)).endswith("step_00000004")  # a directory of them
    assert ck.resolve_resume(CheckpointConfig(load=two, dir=root)) == two  # an explicit one wins
    bad = _fake_checkpoint(root, 6, complete=False)
    with pytest.raises(ConfigError, match="incomplete checkpoint"):
        ck.resolve_resume(CheckpointConfig(load=bad))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match="checkpoint.load"):
        ck.resolve_resume(CheckpointConfig(load=str(empty)))


def test_prune_keeps_newest_and_foreign_files(tmp_path):
    root = str(tmp_path)
    for s in (1, 2, 3, 4):
        _fake_checkpoint(root, s)
    _fake_checkpoint(root, 5, complete=False)
    open(os.path.join(root, "README"), "w").close()
    removed = cks.prune(root, 2)
    assert sorted(os.path.basename(p) for p in removed) == ["step_00000001", "step_00000002"]
    assert sorted(os.listdir(root)) == ["README", "step_00000003", "step_00000004", "step_00000005"]
    assert cks.prune(root, None) == []


def test_another_model_fails_before_any_tensor(tmp_path):
    path = _fake_checkpoint(str(tmp_path), 3, job=_job(num_layers=3))  # meta only: no tensor files exist
    meta = ck.read_meta(path)
    with pytest.raises(ConfigError, match=r"model\.num_layers: checkpoint 3, this job 4"):
        ck.check_compatible(meta, _job(num_layers=4))
    ck.check_compatible(meta, _job(num_layers=3, init_std=0.5))  # init_std changes no tensor
    from folding.training.trainer import prepare

    job = dataclasses.replace(_job(num_layers=4), checkpoint=CheckpointConfig(load=path))
    with pytest.raises(ConfigError, match="another model"):
        prepare(job, world_size=1, rank=0)


def test_async_save_is_a_boolean():
    validate_job(dataclasses.replace(_job(), checkpoint=CheckpointConfig(dir="ck", async_save=True)), world_size=1)
    job = dataclasses.replace(_job(), checkpoint=CheckpointConfig(dir="ck", async_save="yes"))
    with pytest.raises(ConfigError, match="checkpoint.async_save"):
        validate_job(job, world_size=1)


def test_unreadable_meta_is_a_clear_error(tmp_path):
    path = tmp_path / "step_00000001"
    path.mkdir()
    (path / ck.MARKER).write_text("ok")
    with pytest.raises(ConfigError, match="meta.json"):
        ck.read_meta(str(path))


def test_blocks_reshard_through_dcp(tmp_path):
    """Save a full [E=4, 2, F=6, H=3] expert tensor, read it back as EP4 blocks and as an EP2 x ETP3
    block held as [E/EP, 2*F/ETP, H] (sharded saves from many ranks: tests/distributed)."""
    from folding.parallel.params import ParamSpec

    full = torch.arange(4 * 2 * 6 * 3, dtype=torch.float32).view(4, 2, 6, 3)
    whole = Block.whole(full.clone())
    dcp.save({"w": whole}, checkpoint_id=str(tmp_path / "c"), planner=BlockSavePlanner(), no_dist=True)
    for ep in range(4):
        spec = ParamSpec(full_shape=tuple(full.shape), shards=((0, ep, 4),))
        dest = torch.zeros(1, 2 * 6, 3)
        dcp.load(
            {"w": Block.for_spec(dest, spec)},
            checkpoint_id=str(tmp_path / "c"),
            planner=BlockLoadPlanner(),
            no_dist=True,
        )
        assert torch.equal(dest, full[ep : ep + 1].reshape(1, 12, 3))
    spec = ParamSpec(full_shape=tuple(full.shape), shards=((0, 1, 2), (2, 2, 3)))
    dest = torch.zeros(2, 4, 3)
    dcp.load(
        {"w": Block.for_spec(dest, spec)}, checkpoint_id=str(tmp_path / "c"), planner=BlockLoadPlanner(), no_dist=True
    )
    assert torch.equal(dest, full[2:4, :, 4:6].reshape(2, 4, 3))


def test_block_rejects_mismatched_shapes():
    from folding.parallel.params import ParamSpec

    with pytest.raises(ValueError, match="not the block"):
        Block.for_spec(torch.zeros(5), ParamSpec(full_shape=(4, 2), shards=((0, 0, 2),)))
    with pytest.raises(ValueError, match="exceeds"):
        Block(torch.zeros(2, 2), (3, 2), (2, 0))


class _Experts(torch.nn.Module):
    """Stands in for GroupedMLP's FP8-state interface."""

    def __init__(self, offset, state=None):
        super().__init__()
        self.offset, self.state, self.loaded = offset, state, None

    def fp8_state(self):
        return self.state or {}

    def load_fp8_state(self, state):
        if state["expert_offset"] != self.offset:
            return False
        self.loaded = state
        return True


def test_fp8_state_saved_per_rank_and_restored_only_into_the_same_experts(tmp_path):
    from folding.checkpoint.load import _fp8_states, _load_fp8_states

    saved_chunks = [
        torch.nn.ModuleDict({"a": _Experts(0, {"expert_offset": 0, "scale": torch.ones(2)}), "b": _Experts(4)})
    ]  # b never ran TE: nothing saved
    states = _fp8_states(saved_chunks)
    assert list(states) == [(0, "a")]
    path = tmp_path / "rank_0.pt"
    torch.save(states, path)
    same = [torch.nn.ModuleDict({"a": _Experts(0), "b": _Experts(4)})]
    _load_fp8_states(same, str(path))
    assert torch.equal(same[0]["a"].loaded["scale"], torch.ones(2))
    other = [torch.nn.ModuleDict({"a": _Experts(2), "b": _Experts(4)})]  # another layout's experts
    with pytest.warns(UserWarning, match="0 of 1 expert modules restored"):
        _load_fp8_states(other, str(path))
    assert other[0]["a"].loaded is None
    _load_fp8_states(same, str(tmp_path / "absent.pt"))  # no FP8 state saved: nothing to do
