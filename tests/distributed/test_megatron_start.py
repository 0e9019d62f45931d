"""A long real-world Megatron-LM Mixtral command, translated by ``tools/megatron_args.py``, is a job the
dry run and a real start both accept: the command's ~50 flags (parallel layout, MoE, optimizer, LR
schedule, data, tokenizer, checkpoints, logging) at a tiny size, on 2 ranks (EP2) under ``torchrun``,
for one step that saves asynchronously. The hub tokenizer name becomes a note (never a key the real
start would refuse), ``--async-save`` becomes ``checkpoint.async_save=true``, and ``--no-load-optim``
is refused by name. NVIDIA's Mixtral example script (its flag list as ``tests/unit/test_megatron_args.py`` holds
it), shrunk only in sizes, translates; the dry run refuses its split on the small corpus (and so does the real
start's check, before any collective), and with a split that works the job starts and trains a step on 4
ranks of the gloo rank pool."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "examples", "pretrain_mixtral.py")

# The flags of Megatron-LM's examples/mixtral/train_mixtral_8x7b_distributed.sh and of the MoE README's
# Mixtral recipe, as one would paste them, with the sizes made tiny (2 layers, hidden 32, 4 experts).
TINY_MIXTRAL = """
torchrun --nproc_per_node 2 --nnodes 1 --node_rank 0 --master_addr localhost --master_port 6000 pretrain_gpt.py
--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --expert-model-parallel-size 2
--expert-tensor-parallel-size 1 --sequence-parallel --use-distributed-optimizer --overlap-grad-reduce
--overlap-param-gather --distributed-backend nccl --distributed-timeout-minutes 10
--use-mcore-models --transformer-impl transformer_engine --disable-bias-linear --seq-length 16
--max-position-embeddings 64 --num-layers 2 --hidden-size 32 --ffn-hidden-size 16 --num-attention-heads 4
--group-query-attention --num-query-groups 2 --init-method-std 0.01 --attention-dropout 0.0 --hidden-dropout 0.0
--normalization RMSNorm --norm-epsilon 1e-5 --position-embedding-type rope --rotary-base 1000000 --swiglu
--untie-embeddings-and-output-weights --no-masked-softmax-fusion --no-position-embedding --vocab-size 512
--num-experts 4 --moe-router-topk 2 --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2
--moe-z-loss-coeff 1e-3 --moe-grouped-gemm --moe-permute-fusion --moe-token-dispatcher-type alltoall
--moe-router-dtype fp32
--tokenizer-type HuggingFaceTokenizer --tokenizer-model mistralai/Mixtral-8x7B-v0.1
--data-path DATA --split 90,10,0 --num-workers 2 --no-create-attention-mask-in-dataloader
--micro-batch-size 1 --global-batch-size 4 --train-iters 1 --lr 1e-4 --min-lr 1e-5 --lr-decay-style cosine
--lr-decay-iters 1 --lr-warmup-iters 0 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0
--seed 42 --calculate-per-token-loss --manual-gc
--save SAVE --save-interval 1 --ckpt-format torch_dist --async-save --no-load-rng
--eval-interval 1000 --eval-iters 1 --log-interval 1 --log-throughput --tensorboard-dir SAVE/tb
""".split()


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def _run(cmd, cwd, timeout=300):
    return subprocess.run(cmd, cwd=cwd, env=_env(OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=timeout)


def _translate(argv, cwd):
    return _run([sys.executable, "-m", "tools.megatron_args", *argv], cwd)


def test_long_mixtral_command_runs_as_translated(tmp_path):
    lines = [json.dumps({"text": f"document {i}: the router sends each token to two experts."}) for i in range(200)]
    (tmp_path / "corpus.jsonl").write_text("\n".join(lines) + "\n")
    prep = _run(
        [sys.executable, "-m", "tools.preprocess_data", "--input", "corpus.jsonl", "--output-prefix", "data/corpus"]
        + ["--append-eod", "--no-progress"],
        tmp_path,
    )
    assert prep.returncode == 0, prep.stderr
    argv = [{"DATA": "data/corpus", "SAVE": "ckpt", "SAVE/tb": "ckpt/tb"}.get(t, t) for t in TINY_MIXTRAL]
    flags = [t for t in argv if t.startswith("--")]
    assert len(flags) >= 60, len(flags)  # the launcher's and Megatron-LM's

    p = _translate(argv, tmp_path)
    assert p.returncode == 0, p.stderr
    overrides = p.stdout.split()
    assert "checkpoint.async_save=true" in overrides and "checkpoint.dir=ckpt" in overrides
    assert "parallel.ep=2" in overrides and "parallel.world_size=2" in overrides
    assert not any(o.startswith("data.tokenizer=") for o in overrides)  # a hub name is no local path
    assert "# --tokenizer-model mistralai/Mixtral-8x7B-v0.1: not a local path" in p.stderr
    assert "data.tokenizer=DIR" in p.stderr

    job = [*overrides, "logging.wandb.mode=disabled"]  # the test machine has no W&B
    dry = _run([sys.executable, SCRIPT, *job, "train.dry_run=true"], tmp_path)
    assert dry.returncode == 0, dry.stderr
    assert "dry run: megatron on 2 ranks" in dry.stdout
    assert "MoE ETP1 EP2 EDP1 PP1" in dry.stdout

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", SCRIPT, *job]
    real = _run(cmd, tmp_path, timeout=600)
    assert real.returncode == 0, real.stdout[-3000:] + real.stderr[-3000:]
    saved = [d for d in os.listdir(tmp_path / "ckpt") if d.startswith("step_")]
    assert saved, os.listdir(tmp_path / "ckpt")
    assert os.path.exists(tmp_path / "ckpt" / sorted(saved)[-1] / "COMPLETE")


def test_flags_that_change_the_job_are_translated_or_refused(tmp_path):
    p = _translate(["--async-save", "--no-load-optim", "--save", "ckpt", "--load", "ckpt"], tmp_path)
    assert p.returncode == 2 and p.stdout == ""
    line = p.stderr.strip()
    assert line.startswith("error: --no-load-optim: folding always restores the optimizer state")
    assert len(line.splitlines()) == 1
    p = _translate(["--no-load-rng", "--moe-input-jitter-eps", "0.01"], tmp_path)
    assert p.returncode == 2 and "--no-load-rng with --moe-input-jitter-eps" in p.stderr
    tok = tmp_path / "tok"
    tok.mkdir()
    p = _translate(["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tok)], tmp_path)
    assert p.returncode == 0 and p.stdout.split() == [f"data.tokenizer={tok}"], p.stderr
    # the dry run refuses a tokenizer the real start could not load, as the real start does
    dry = _run([sys.executable, SCRIPT, "data.tokenizer=mistralai/Mixtral-8x7B-v0.1", "train.dry_run=true"], tmp_path)
    assert dry.returncode != 0 and "data.tokenizer" in dry.stderr and "huggingface-cli download" in dry.stderr


# NVIDIA's examples/mixtral/train_mixtral_8x7b_distributed.sh, its flags as tests/unit/test_megatron_args.py
# holds them, shrunk only in sizes (hidden 256 -> 32, FFN 896 -> 64, sequence 256 -> 32, 7 iterations -> 1)
SHRUNK = {"--hidden-size": "32", "--ffn-hidden-size": "64", "--seq-length": "32", "--train-iters": "1"}


def _shrunk(split=None):
    from tests.unit.test_megatron_args import NVIDIA_MIXTRAL_SCRIPT

    out = list(NVIDIA_MIXTRAL_SCRIPT)
    for flag, value in {**SHRUNK, **({"--split": split} if split else {})}.items():
        out[out.index(flag) + 1] = value
    return out


def _start_one_step(tree, run_dir):
    from folding.job.config import job_config_from_dict
    from folding.training.trainer import train

    return train(job_config_from_dict(tree), run_dir=run_dir)["history"]


def test_nvidia_mixtral_script_starts_on_four_ranks(ranks, tmp_path):
    """The script's flags translate without a refusal; its --split 99990,8,2 leaves the embedded corpus' 1,227
    documents no validation document, which the dry run refuses by name with a split that works (and the real
    start, before any collective, with the same line); with that split the job passes the dry run and trains
    a step on 4 ranks (EP2, DP4)."""
    from folding.interop.megatron.args import convert
    from folding.job.config import ConfigError
    from folding.launch.dry_run import dry_run_report
    from folding.training.trainer import prepare
    from tests.unit.test_config_job import compose_tree, job

    configs = os.path.join(ROOT, "configs")
    as_written = convert(_shrunk(), world_size=4, config_dir=configs)
    assert "data.split=[99990,8,2]" in as_written.overrides
    refused = "data.split='99990,8,2' gives the 'valid' split no documents of dataset"
    with pytest.raises(ConfigError, match=refused) as e:
        dry_run_report(job(*as_written.overrides), world_size=4)
    assert "set data.split=98,1,1 (Megatron-LM: --split 98,1,1)" in str(e.value)
    with pytest.raises(ValueError, match=refused):  # the real start's check, before any process group
        prepare(job(*as_written.overrides), world_size=4, rank=0)

    fixed = convert(_shrunk(split="98,1,1"), world_size=4, config_dir=configs).overrides
    overrides = [*fixed, "logging.wandb.mode=disabled", "logging.console=false"]
    report = dry_run_report(job(*overrides), world_size=4)
    assert "documents per split: train 1202, valid 13, test 12 (data.split=98,1,1)" in report
    assert "MoE ETP1 EP2 EDP2 PP1" in report
    histories = ranks(4).run(_start_one_step, compose_tree(*overrides), str(tmp_path))
    assert [[h["step"] for h in hist] for hist in histories] == [[1]] * 4
    losses = {hist[0]["lm_loss"] for hist in histories}
    assert len(losses) == 1 and 0 < losses.pop() < 10  # one global loss, near ln(257) at the start
