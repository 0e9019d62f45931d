"""``tools/gpu_bringup.sh --cpu-smoke`` runs every section of the GPU bring-up on CPU at toy sizes and writes
the report; without a GPU and without the flag it refuses with the fix; with a GPU the real run runs.

The smoke run and the refusal hide CUDA from the script, so they are the same runs on a GPU host as on
a CPU one; the real run is checked where CUDA is available (its pre-flight section only)."""

import os
import re
import subprocess

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "tools", "gpu_bringup.sh")


def _run(args, tmp_path, hide_cuda=True):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if hide_cuda:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return subprocess.run(["bash", SCRIPT, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)


def _section(report: str, number: int) -> str:
    parts = re.split(r"^## ", report, flags=re.M)
    return next(p for p in parts if p.startswith(f"{number}. "))


def test_cpu_smoke_writes_every_section(tmp_path):
    out = tmp_path / "report"
    proc = _run(["--cpu-smoke", "--out", str(out)], tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = (out / "gpu_bringup.md").read_text()
    for i in range(1, 6):
        assert "(passed in" in _section(report, i), _section(report, i)
    assert "all checks that ran passed" in _section(report, 1)
    numerics = _section(report, 2)
    # the fp32 backends equal the fp32 reference; an FP8 emulation is off by a few percent, not more
    assert re.search(r"^\| loop \| none \| 0\.00e\+00 \| 0\.00e\+00 \| 0\.00e\+00 \| 0\.00e\+00", numerics, re.M)
    mx = re.search(r"^\| emulated \| mxfp8 \| ([0-9.e+-]+) \|", numerics, re.M)
    assert mx and 1e-3 < float(mx.group(1)) < 0.2, numerics
    speed = _section(report, 3)
    assert len(re.findall(r"^\| \d+ \| \d+ \| \d+ \| folding ", speed, re.M)) >= 2, speed
    train = _section(report, 4)
    losses = [float(m) for m in re.findall(r"^\| \d+ \| ([0-9.]+) \|", train, re.M)]
    assert len(losses) == 3 and losses[-1] < losses[0], train
    assert (out / "train_run" / "metrics.jsonl").exists()
    gpu_only = _section(report, 5)  # CUDA hidden: the GPU-only cases say so; the overlap step runs on gloo
    assert "(passed in" in gpu_only and gpu_only.count("Not run: no CUDA device visible") == 1, gpu_only
    assert "not run: no CUDA device visible" in gpu_only, gpu_only  # the raw call's verdict
    assert re.search(r"^\| ep dispatch \| 16 / 16 \|", gpu_only, re.M), gpu_only


def test_without_a_gpu_the_real_run_refuses_with_the_fix(tmp_path):
    proc = _run(["--out", str(tmp_path / "r")], tmp_path)  # CUDA hidden: a host without a GPU
    assert proc.returncode == 2
    assert "no CUDA device" in proc.stderr and "--cpu-smoke" in proc.stderr


def test_the_real_run_on_this_host(tmp_path):
    out = tmp_path / "r"
    proc = _run(["--out", str(out), "--only", "1"], tmp_path, hide_cuda=False)
    if not torch.cuda.is_available():  # this host has no GPU: the real run refuses, as above
        assert proc.returncode == 2 and "no CUDA device" in proc.stderr, proc.stderr[-3000:]
        assert not out.exists()
        return
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = (out / "gpu_bringup.md").read_text()
    device = next(line for line in report.splitlines() if line.startswith("- device: "))
    assert "(sm_" in device and "smoke" not in device, device  # the GPU itself, not the CPU smoke run
    check = _section(report, 1)
    assert "(passed in" in check and "backend nccl" in check and "all checks that ran passed" in check, check
    assert "## 2. " not in report  # --only 1: the pre-flight check alone
