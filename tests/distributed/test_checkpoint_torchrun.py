"""A dead rank costs a restart, not the run: ``torchrun --max-restarts 1`` with one rank SIGKILLed
after the first checkpoint resumes from the latest complete checkpoint and ends with the final
loss of an uninterrupted run (2 ranks, tiny model, fp32; a real subprocess job, ~30-60 s)."""

import json
import os
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 30
OVERRIDES = [
    f"train.steps={STEPS}",
    "train.global_batch_size=4",
    "train.micro_batch_size=1",
    "train.seq_length=16",
    "train.eval_interval=0",
    "model.hidden_size=32",
    "moe.ffn_hidden_size=16",
    "parallel.ep=2",
    "parallel.etp=1",
    "logging.console=false",
    "logging.wandb.mode=disabled",
    "hydra/job_logging=disabled",
    "hydra/hydra_logging=disabled",
    "train.collective_timeout_s=60",
]


def _torchrun(run_dir, extra, max_restarts=0):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--standalone",
        "--max-restarts",
        str(max_restarts),
        os.path.join(ROOT, "examples", "pretrain_mixtral.py"),
        *OVERRIDES,
        *extra,
        f"hydra.run.dir={run_dir}",
    ]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _records(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _worker_pid(agent_pid, rank):
    """The pid of the training process with RANK=rank among the descendants of ``agent_pid``."""
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
            with open(f"/proc/{name}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == agent_pid and env.get(b"RANK") == str(rank).encode() and b"TORCHELASTIC_RUN_ID" in env:
            return int(name)
    return None


def test_sigkill_one_rank_resumes_from_last_checkpoint(tmp_path):
    ref_dir, run_dir, ck = str(tmp_path / "ref"), str(tmp_path / "run"), str(tmp_path / "ck")
    ref = _torchrun(ref_dir, [])
    job = _torchrun(run_dir, [f"checkpoint.dir={ck}", "checkpoint.save_interval=3"], max_restarts=1)
    killed_after = None
    deadline = time.monotonic() + 240
    while job.poll() is None and time.monotonic() < deadline:
        if os.path.exists(os.path.join(ck, "step_00000003", "COMPLETE")):
            pid = _worker_pid(job.pid, 1)
            if pid:
                done = [r["step"] for r in _records(run_dir) if r.get("kind") == "train"]
                os.kill(pid, signal.SIGKILL)
                killed_after = max(done) if done else 0
                break
        time.sleep(0.02)
    out_job = job.communicate(timeout=max(1, deadline - time.monotonic()))[0]
    out_ref = ref.communicate(timeout=max(1, deadline - time.monotonic()))[0]
    assert ref.returncode == 0, out_ref[-3000:]
    assert job.returncode == 0, out_job[-3000:]
    assert killed_after is not None and killed_after < STEPS, "the rank was not killed mid-run"
    recs = _records(run_dir)
    runs = [r for r in recs if r.get("kind") == "run"]
    assert len(runs) == 2, runs  # started, then restarted once
    assert runs[0]["resumed_from"] is None
    resumed = runs[1]["resumed_from"]
    assert resumed and os.path.basename(resumed).startswith("step_"), runs[1]
    resumed_step = int(os.path.basename(resumed)[5:])
    assert resumed_step >= 3 and runs[1]["start_step"] == resumed_step + 1
    train = [r for r in recs if r.get("kind") == "train"]
    assert train[-1]["step"] == STEPS
    ref_train = [r for r in _records(ref_dir) if r.get("kind") == "train"]
    assert [r["step"] for r in ref_train] == list(range(1, STEPS + 1))
    final, want = train[-1]["loss"], ref_train[-1]["loss"]
    assert abs(final - want) <= 1e-5 * abs(want), (final, want)
