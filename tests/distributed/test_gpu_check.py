"""``python -m tools.gpu_check`` runs on a CPU machine (gloo), 1 process and 2 torchrun ranks: every check
that can run here passes, and the rows that need CUDA are named as skipped or unsupported."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = ["-m", "tools.gpu_check"]


def _run(cmd):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)


@pytest.mark.parametrize("launcher", ["python", "torchrun2"])
def test_gpu_check_on_cpu(launcher):
    cmd = (
        [sys.executable, *TOOL]
        if launcher == "python"
        else [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", *TOOL]
    )
    proc = _run(cmd)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    lines = {line.split("  ")[0].strip(): line for line in out.splitlines() if "  " in line}
    world = 1 if launcher == "python" else 2
    assert f"{world} rank(s)" in out
    assert "all checks that ran passed" in out
    for row in (
        "uneven all_to_all_single",
        "fwd+bwd torch/none vs fp32",
        "fwd+bwd emulated/mxfp8 vs fp32",
        "MoE layer host transfers",
    ):
        assert " ok " in lines[row], lines[row]
    assert ("SKIPPED" in lines["pipeline p2p, both ways"]) == (world == 1)
    assert " no " in lines["backend te/mxfp8"] and "CUDA" in lines["backend te/mxfp8"]
    assert "SKIPPED" in lines["NCCL (p2p, all-to-all)"] and "no CUDA device" in lines["NCCL (p2p, all-to-all)"]
