"""A node lost mid-run: two torchrun "nodes" on this machine (``--nnodes 2``, one worker each, static
rendezvous on node 0) train the tiny model with ``train.collective_timeout_s=10``, and node 1's torchrun is
killed with SIGKILL mid-run. Its worker does not outlive it (gone within seconds, checked by pid); the
surviving rank 0 exits within the timeout with one line naming the lost rank and its node, its run's
``status.json`` says ``failed``, its torchrun exits non-zero, and no worker of either node remains."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "examples", "pretrain_mixtral.py")
TIMEOUT_S = 10
TINY = [
    "train.steps=100000",
    "train.global_batch_size=2",
    "train.micro_batch_size=1",
    "train.seq_length=16",
    "train.eval_interval=0",
    "model.num_layers=1",
    "model.hidden_size=32",
    "moe.ffn_hidden_size=16",
    "logging.wandb.mode=disabled",
    "logging.interval=1000",
    f"train.collective_timeout_s={TIMEOUT_S}",
]
LOST_LINE = re.compile(
    r"^error \(rank 0\): lost rank 1 \(node 1, host \S+\): no heartbeat for [0-9.]+ s "
    rf"\(train.collective_timeout_s={TIMEOUT_S}\): exiting$"
)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _children(pid):
    """Pids of the live processes whose parent is ``pid`` (from /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            if int(fields[1]) == pid and fields[0] != "Z":
                out.append(int(entry))
    return out


def _alive(pid):
    """Whether ``pid`` is a running process (a zombie waiting for its reaper counts as gone)."""
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _wait_gone(pid, seconds):
    deadline = time.monotonic() + seconds
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not _alive(pid)


def _trained(run_dir):
    try:
        return any(json.loads(line).get("kind") == "train" for line in open(os.path.join(run_dir, "metrics.jsonl")))
    except (OSError, ValueError):
        return False


def test_lost_node_ends_the_survivors_and_no_worker_outlives_its_torchrun(tmp_path):
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    agents, workers = [], []
    try:
        for node in (0, 1):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1"]
            cmd += ["--master-addr", "127.0.0.1", "--master-port", str(port), "--node-rank", str(node)]
            cmd += [SCRIPT, *TINY, f"hydra.run.dir=r{node}"]
            out = open(tmp_path / f"node{node}.log", "w")
            agents.append(subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + 300
        while not _trained(tmp_path / "r0") and time.monotonic() < deadline:
            assert all(a.poll() is None for a in agents), (tmp_path / "node0.log").read_text()[-3000:]
            time.sleep(0.2)
        assert _trained(tmp_path / "r0"), (tmp_path / "node0.log").read_text()[-3000:]
        workers = [_children(a.pid) for a in agents]
        assert [len(w) for w in workers] == [1, 1], workers
        (w0,), (w1,) = workers

        agents[1].send_signal(signal.SIGKILL)
        killed = time.monotonic()
        assert _wait_gone(w1, 5.0), "node 1's worker outlived its torchrun"
        assert _wait_gone(w0, TIMEOUT_S + 5.0), "rank 0 did not exit after losing rank 1"
        exited = time.monotonic() - killed
        print(f"rank 0 exited {exited:.1f} s after node 1's torchrun was killed")
        assert agents[0].wait(timeout=60) != 0
        log = (tmp_path / "node0.log").read_text()
        lost = [line for line in log.splitlines() if "lost" in line and "error" in line]
        assert len(lost) == 1 and LOST_LINE.match(lost[0]), log[-3000:]
        assert exited < TIMEOUT_S + 5.0, exited
        status = json.load(open(tmp_path / "r0" / "status.json"))
        assert status["status"] == "failed", status
        assert "lost rank 1 (node 1" in (tmp_path / "r0" / "train.log").read_text()
    finally:
        for pid in [a.pid for a in agents] + [p for w in workers for p in w]:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        for a in agents:
            a.wait(timeout=30)
