"""``python -m tools.gpu_check``, 1 process and 2 torchrun ranks, on whatever this host has.

Where CUDA has a device per rank, the check runs on it (NCCL): the device rows name the GPU, no row
says NCCL was skipped, and every backend row is answered (supported, or not with a reason). Elsewhere
(a CPU host, or fewer GPUs than ranks: CUDA is then hidden from the run) it runs on gloo: every check
that can run passes, and the rows that need CUDA are named as skipped or unsupported."""

import os
import re
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = ["-m", "tools.gpu_check"]
ROW = re.compile(r"^(\S.*?)\s{2,}(ok|FAIL|SKIPPED|no)\s+(.*)$")


def _run(cmd, hide_cuda):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    if hide_cuda:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)


def _rows(out):
    """``{check: (status, detail)}`` of the table the tool prints."""
    return {m.group(1): (m.group(2), m.group(3)) for m in map(ROW.match, out.splitlines()) if m}


@pytest.mark.parametrize("launcher", ["python", "torchrun2"])
def test_gpu_check(launcher):
    world = 1 if launcher == "python" else 2
    on_gpu = torch.cuda.is_available() and torch.cuda.device_count() >= world
    cmd = (
        [sys.executable, *TOOL]
        if launcher == "python"
        else [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", *TOOL]
    )
    proc = _run(cmd, hide_cuda=not on_gpu)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    rows = _rows(out)
    assert f"{world} rank(s)" in out
    assert "all checks that ran passed" in out and not any(s == "FAIL" for s, _ in rows.values()), out
    for row in ("uneven all_to_all_single", "fwd+bwd loop/none vs fp32", "fwd+bwd emulated/mxfp8 vs fp32"):
        assert rows[row][0] == "ok", (row, rows[row])
    assert (rows["pipeline p2p, both ways"][0] == "SKIPPED") == (world == 1)
    # on any device: TE has no rowwise recipe, and the loop backend no FP8
    assert rows["backend te/rowwise"][0] == "no" and "no rowwise recipe" in rows["backend te/rowwise"][1]
    assert rows["backend loop/mxfp8"][0] == "no"
    torch_ok = rows["backend torch/none"][0] == "ok"
    assert rows["MoE layer host transfers"][0] == ("ok" if torch_ok else "SKIPPED")
    if on_gpu:
        assert "backend nccl" in out
        assert "rank 0: cuda:0 " in rows["device"][1]
        assert "NCCL (p2p, all-to-all)" not in rows  # it ran: every collective above went through NCCL
        for name, (status, why) in rows.items():
            if name.startswith("backend te/") and name != "backend te/rowwise":
                # TransformerEngine's own verdict for this GPU (or why it does not import), never "not CUDA"
                assert status == "ok" or (status == "no" and why and "not cuda" not in why), (name, why)
    else:
        assert "backend gloo" in out
        assert torch_ok and rows["fwd+bwd torch/none vs fp32"][0] == "ok"
        assert rows["backend te/mxfp8"][0] == "no" and "CUDA" in rows["backend te/mxfp8"][1]
        assert rows["NCCL (p2p, all-to-all)"][0] == "SKIPPED" and "no CUDA device" in rows["NCCL (p2p, all-to-all)"][1]
