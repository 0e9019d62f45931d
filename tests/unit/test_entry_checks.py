"""The entry point's checks before Hydra (one-line errors, key suggestions, ``data.split`` lists, dry
runs), the thread-count rules, the run directory's helpers and the default warm-up clamp."""

import io
import json
import os
import time

import pytest

from folding.job.config import ConfigError, job_config_from_dict
from folding.launch import cli
from folding.launch.run_dir import RunLog, discard_if_empty, read_status, write_status
from folding.launch.threads import cgroup_cpu_limit, pick_threads, usable_cpus

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "..", "configs")


@pytest.fixture(autouse=True)
def _schema():
    from folding.job.schema import register_schema

    register_schema()


def _check(args, capsys, monkeypatch, local_rank="0"):
    monkeypatch.setenv("LOCAL_RANK", local_rank)
    status = cli.check_command_line(args, config_dir=CONFIGS, world_size=1)
    return status, capsys.readouterr()


def test_unknown_key_names_the_closest_valid_key(capsys, monkeypatch):
    status, out = _check(["train.stpes=3"], capsys, monkeypatch)
    assert status == 2 and out.err == "error: train.stpes: unknown key; did you mean train.steps?\n"
    status, out = _check(["moe.router_dtyp=fp64"], capsys, monkeypatch)
    assert status == 2 and "unknown key" in out.err and out.err.count("\n") == 1
    status, out = _check(["nosuch.key=1"], capsys, monkeypatch)
    assert status == 2 and "sections: checkpoint, data, logging, model, moe, optim, parallel, train" in out.err


def test_an_unquoted_pipeline_layout_says_how_to_quote_it(capsys, monkeypatch):
    status, out = _check(["parallel.pp=2", "parallel.pipeline_layout=Et|t|t|tL"], capsys, monkeypatch)
    assert status == 2 and out.err.count("\n") == 1
    assert "parallel.pipeline_layout=Et|t|t|tL: Hydra reads |, (, ) and *" in out.err
    assert "\"parallel.pipeline_layout='Et|t|t|tL'\"" in out.err
    status, out = _check(
        ["parallel.pp=2", "parallel.pipeline_layout='Et|t|t|tL'", "parallel.world_size=2", "train.dry_run=true"],
        capsys,
        monkeypatch,
    )
    assert status == 0 and "PP2 VPP2 (layout Et|t|t|tL)" in out.out and "E|t|t|tL" not in out.err


def test_errors_are_one_line_printed_by_the_lead_process_only(capsys, monkeypatch):
    status, out = _check(["train.steps=abc"], capsys, monkeypatch)
    assert status == 2
    assert out.err == "error: train.steps=abc: Value 'abc' of type 'str' could not be converted to Integer\n"
    status, out = _check(["model=nope"], capsys, monkeypatch)
    assert status == 2 and out.err.count("\n") == 1
    assert "olmoe_tiny, qwen2_57b_a14b, qwen2_moe_tiny, qwen3_235b_a22b" in out.err
    monkeypatch.setattr(cli, "ERROR_GRACE_S", 0.3)
    monkeypatch.setenv("RANK", "1")
    t0 = time.monotonic()
    status, out = _check(["parallel.tp=3"], capsys, monkeypatch, local_rank="1")
    # another rank waits for torchrun to stop it after the lead's exit, and speaks only if it was not
    assert status == 2 and time.monotonic() - t0 >= 0.3 and out.out == ""
    assert out.err.startswith("error (rank 1): world size 1 is not divisible by parallel.tp*cp*pp")
    status, out = _check(["parallel.tp=3"], capsys, monkeypatch)
    assert out.err.startswith("error: world size 1 is not divisible by parallel.tp*cp*pp = 3*1*1")


def test_valid_job_goes_on_and_dry_run_stops_with_zero(capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    assert _check(["train.steps=2"], capsys, monkeypatch)[0] is None
    status, out = _check(["recipes=qwen2_57b_a14b", "train.dry_run=true"], capsys, monkeypatch)
    assert status == 0 and out.out.startswith("dry run: qwen2_57b_a14b on 64 ranks")
    assert list(tmp_path.iterdir()) == []  # nothing written
    assert cli.check_command_line(["-m", "parallel.ep=1,2"], config_dir=CONFIGS) is None  # Hydra's sweep


def test_split_list_on_the_command_line(capsys, monkeypatch):
    args = cli.normalize_overrides(["data.split=80,20,0", "parallel.ep=2", "data.split='1,2'"])
    assert args == ["data.split=[80,20,0]", "parallel.ep=2", "data.split='1,2'"]
    tree = cli.compose_tree(args[:1], config_dir=CONFIGS, config_name="config")
    assert tree["data"]["split"] == [80, 20, 0]
    assert job_config_from_dict(tree).data.split == "80,20,0"
    assert _check(args[:1], capsys, monkeypatch)[0] is None


def test_default_warmup_is_clamped_to_the_run_and_explicit_warmup_is_checked():
    from folding.job.schema import preset_node

    base = preset_node("mixtral_tiny")  # {"model": ..., "moe": ...}
    job = job_config_from_dict({**base, "train": {"steps": 2}, "optim": {"warmup_steps": None}})
    assert job.optim.warmup_steps == 1 and job.notes and "at most half of the 2-step schedule" in job.notes[0]
    job = job_config_from_dict({**base, "train": {"steps": 60}, "optim": {"warmup_steps": None}})
    assert job.optim.warmup_steps == 5 and job.notes == ()
    from folding.job.validate import validate_job

    with pytest.raises(ConfigError, match="optim.warmup_steps=5: exceeds the decay horizon"):
        validate_job(job_config_from_dict({**base, "train": {"steps": 2}, "optim": {"warmup_steps": 5}}), world_size=1)


def test_thread_count_rules(tmp_path):
    quota = tmp_path / "cpu.max"
    quota.write_text("150000 100000\n")
    assert cgroup_cpu_limit(str(quota)) == 1.5
    assert usable_cpus(str(quota)) <= 2
    quota.write_text("max 100000\n")
    assert cgroup_cpu_limit(str(quota)) is None and cgroup_cpu_limit(str(tmp_path / "none")) is None
    assert pick_threads(3, env={"OMP_NUM_THREADS": "1"}) == (3, "train.threads")
    assert pick_threads(None, env={"OMP_NUM_THREADS": "1"}) == (1, "OMP_NUM_THREADS=1")
    assert pick_threads(None, env={"LOCAL_WORLD_SIZE": "4"}, cpus=16) == (
        4,
        "16 usable CPUs / 4 processes on this node",
    )
    assert pick_threads(None, env={"LOCAL_WORLD_SIZE": "8"}, cpus=2)[0] == 1
    assert pick_threads(None, env={}, cpus=2) == (2, "2 usable CPUs / 1 process on this node")


def test_run_directory_helpers(tmp_path):
    fresh = tmp_path / "outputs" / "2026-01-01" / "10-00-00"
    fresh.mkdir(parents=True)
    (tmp_path / "outputs" / "keep.txt").write_text("x")
    assert discard_if_empty(str(fresh), stop_at=str(tmp_path))
    assert not (tmp_path / "outputs" / "2026-01-01").exists() and (tmp_path / "outputs" / "keep.txt").exists()
    used = tmp_path / "used"
    used.mkdir()
    (used / "metrics.jsonl").write_text("{}\n")
    assert not discard_if_empty(str(used), stop_at=str(tmp_path)) and (used / "metrics.jsonl").exists()
    write_status(str(used), "running", step=None)
    write_status(str(used), "stopped", step=7, checkpoint="/ck/step_00000007")
    assert read_status(str(used)) == {"status": "stopped", "step": 7, "checkpoint": "/ck/step_00000007"}
    assert sorted(p.name for p in used.iterdir()) == ["metrics.jsonl", "status.json"]
    with pytest.raises(ValueError, match="not one of"):
        write_status(str(used), "done")
    out = io.StringIO()
    log = RunLog(str(used), stream=out)
    log.echo("step line")
    log.echo("log only", console=False)
    import logging

    log.capture_records()
    logging.getLogger("folding.test").warning("a warning")
    log.close()
    assert out.getvalue() == "step line\n"
    text = (used / "train.log").read_text()
    assert text.splitlines() == ["step line", "log only", "[folding.test] WARNING: a warning"]
    assert json.loads((used / "status.json").read_text())["step"] == 7


def test_check_hands_back_the_config_hydra_would_run(capsys, monkeypatch):
    """The config a rank other than 0 runs without Hydra's main is the one the check composed: the overrides
    applied, plain values; none where Hydra has to compose (a sweep) or the job stops (a dry run, an error)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    monkeypatch.setenv("LOCAL_RANK", "0")
    args = ["parallel.tp=2", "parallel.ep=4", "parallel.etp=1", "logging.wandb.mode=disabled"]
    status, tree = cli.check_and_compose(args, config_dir=CONFIGS, world_size=4)
    assert status is None and tree["parallel"]["tp"] == 2 and tree["logging"]["wandb"]["mode"] == "disabled"
    with initialize_config_dir(config_dir=os.path.abspath(CONFIGS), version_base="1.3"):
        want = OmegaConf.to_container(compose(config_name="config", overrides=args), resolve=True)
    assert tree == want
    assert cli.check_and_compose(["-m", "parallel.ep=1,2"], config_dir=CONFIGS) == (None, None)
    assert cli.check_and_compose(["train.dry_run=true"], config_dir=CONFIGS, world_size=1) == (0, None)
    assert cli.check_and_compose(["train.stpes=3"], config_dir=CONFIGS, world_size=1) == (2, None)
    capsys.readouterr()


def test_hydra_reads_the_mode_of_a_plain_run_without_composing():
    from hydra._internal.hydra import Hydra

    from folding.launch.run import mode_from_command_line

    original = Hydra.get_mode
    with mode_from_command_line(["parallel.tp=2"]):
        assert Hydra.get_mode is not original and Hydra.get_mode(None, "config", []) is None
    assert Hydra.get_mode is original
    for args in (["-m", "parallel.ep=1,2"], ["hydra.mode=MULTIRUN"], ["+hydra.mode=RUN"]):
        with mode_from_command_line(args):
            assert Hydra.get_mode is original  # Hydra's own look-up
