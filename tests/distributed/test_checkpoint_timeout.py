"""``train.collective_timeout_s`` reaches the process groups: a collective that one rank never joins
fails on the other after the timeout (3 s here) with an error that says so, instead of hanging. Run as a real
2-process torchrun job with the trainer's own group set-up (``init_world`` and
``build_parallel_state(timeout_s=...)``)."""

import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = textwrap.dedent("""
    import os, time, torch, torch.distributed as dist
    from folding.parallel import ParallelLayout, build_parallel_state
    from folding.launch.run import init_world
    # both ranks past their imports first: on a loaded machine one may start seconds after the other,
    # and the 3 s timeout also bounds the rendezvous and the group set-up
    here = os.path.dirname(os.path.abspath(__file__))
    open(os.path.join(here, f"ready{os.environ['RANK']}"), "w").close()
    deadline = time.monotonic() + 60
    while not all(os.path.exists(os.path.join(here, f"ready{r}")) for r in (0, 1)) and time.monotonic() < deadline:
        time.sleep(0.05)
    init_world(3.0)                                  # what run_job does with train.collective_timeout_s
    ps = build_parallel_state(ParallelLayout(world_size=2, tp=2), timeout_s=3.0)
    if dist.get_rank() == 0:                         # rank 1 never joins this all-reduce
        t0 = time.monotonic()
        try:
            dist.all_reduce(torch.ones(1), group=ps.groups.tp)
        except RuntimeError as e:
            print(f"FAILED_AFTER {time.monotonic() - t0:.1f} s: {e}", flush=True)
    else:
        time.sleep(8)
    print("EXITED", flush=True)
    os._exit(0)
""")


def test_hung_collective_fails_after_timeout(tmp_path):
    script = tmp_path / "hang.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    line = next(l for l in out.stdout.splitlines() if l.startswith("FAILED_AFTER"))
    waited = float(line.split()[1])
    assert 2.5 <= waited < 7.5 and "timed out" in line.lower(), line
    assert out.stdout.count("EXITED") == 2
