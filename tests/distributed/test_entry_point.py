"""The training entry point as a user runs it: ``python`` and ``torchrun`` subprocesses of
``examples/pretrain_mixtral.py`` in a fresh working directory (tiny model, CPU, gloo).

- a config error under ``torchrun --nproc-per-node 2`` is printed once, with no worker traceback, and
  leaves no run directory; a dry run leaves none either;
- a 2-step run without ``OMP_NUM_THREADS`` works (the default warm-up is clamped) and its ``train.log``
  holds the step lines, its ``status.json`` says ``completed``;
- a plain ``.txt`` file is preprocessed and trained on with ``data.split=80,20,0``; the README's
  first-hour commands run on a one-document-per-line file (one document per line by default), and an
  empty split names ``--text-split``;
- a resumed run continues in the run directory of the checkpoint, metrics appended;
- Ctrl-C under ``torchrun`` (SIGINT to torchrun, which forwards it to every worker): every worker saves
  and exits 0 with no traceback, and the run's ``status.json`` says ``stopped``.
"""

import glob
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "examples", "pretrain_mixtral.py")
TINY = [
    "train.global_batch_size=4",
    "train.micro_batch_size=1",
    "train.seq_length=16",
    "train.eval_interval=0",
    "model.hidden_size=32",
    "moe.ffn_hidden_size=16",
    "logging.wandb.mode=disabled",
]
WORKER_FRAME = re.compile(r'File ".*(pretrain_mixtral\.py|/folding/)')


def _env(**extra):
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("OMP_NUM_THREADS", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def _python(cwd, args, **env):
    return subprocess.run(
        [sys.executable, SCRIPT, *args], cwd=cwd, env=_env(**env), capture_output=True, text=True, timeout=300
    )


def _torchrun(cwd, nproc, args, **popen):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--standalone", *args]
    return subprocess.Popen(
        cmd,
        cwd=cwd,
        env=_env(OMP_NUM_THREADS="1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        **popen,
    )


def _records(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def test_config_error_under_torchrun_printed_once_without_worker_traceback(tmp_path):
    # the third case starts the lead (local rank 0) 3 s late: rank 1 finds the error first and must
    # not end the job before the lead has printed it (torchrun stops every worker when one exits)
    late_lead = [
        "--no-python",
        "bash",
        "-c",
        f'[ "$LOCAL_RANK" = 0 ] && sleep 3; exec "{sys.executable}" "{SCRIPT}" "$@"',
        "bash",
    ]
    for launch, bad, expect in (
        ([SCRIPT], "train.stpes=3", "error: train.stpes: unknown key; did you mean train.steps?"),
        ([SCRIPT], "parallel.tp=3", "error: world size 2 is not divisible by parallel.tp*cp*pp = 3"),
        (late_lead, "parallel.tp=3", "error: world size 2 is not divisible by parallel.tp*cp*pp = 3"),
    ):
        job = _torchrun(tmp_path, 2, [*launch, bad, *TINY])
        out = job.communicate(timeout=180)[0]
        assert job.returncode != 0, out
        lines = [line for line in out.splitlines() if line.startswith("error:")]
        assert len(lines) == 1 and lines[0].startswith(expect), out
        assert not WORKER_FRAME.search(out), out  # torchrun's own summary only
        assert not (tmp_path / "outputs").exists()


def test_dry_run_and_failed_checks_leave_no_run_directory(tmp_path):
    dry = _python(tmp_path, ["recipes=qwen2_57b_a14b", "train.dry_run=true"])
    assert dry.returncode == 0 and "dry run: qwen2_57b_a14b" in dry.stdout, dry.stderr
    bad = _python(tmp_path, ["optim.lr=-1", *TINY])
    assert bad.returncode == 2 and bad.stderr.count("error: optim.lr") == 1, bad.stderr
    data = _python(tmp_path, ["data.paths=[missing/prefix]", *TINY])  # caught after Hydra made the directory
    assert data.returncode == 2 and "missing/prefix.bin and missing/prefix.idx do not exist" in data.stderr, data.stderr
    assert "Traceback" not in dry.stderr + bad.stderr + data.stderr
    assert not (tmp_path / "outputs").exists(), list((tmp_path / "outputs").rglob("*"))


def test_two_step_run_without_omp_setting_logs_steps_and_status(tmp_path):
    run = _python(tmp_path, ["train.steps=2", *TINY])
    assert run.returncode == 0, run.stderr[-3000:]
    (run_dir,) = list((tmp_path / "outputs").glob("*/*"))
    log = (run_dir / "train.log").read_text()
    assert "optim.warmup_steps: 1 (the default 5" in log
    assert "experts: moe.expert_backend=auto -> torch (moe.fp8_recipe=None, cpu" in log  # said at start
    assert re.search(r"threads: \d+ per process \(\d+ usable CPUs / 1 process on this node\)", log), log
    # what the engine decided where the job leaves it open: said at start, and resolved in resolved_config.yaml
    assert "nodes: 1 of 1 ranks (the world: one node)" in log, log
    assert "dispatch: moe.dispatcher=alltoall: one exchange over the EP group of 1 ranks" in log, log
    assert "recompute: none (train.recompute=none)" in log, log
    resolved = yaml.safe_load((run_dir / "resolved_config.yaml").read_text())
    assert (resolved["parallel"]["world_size"], resolved["parallel"]["etp"], resolved["parallel"]["nvlink_domain"]) == (
        1,
        1,
        1,
    )
    assert len(re.findall(r"^\[#*\.*\] [12]/2 \| loss", log, re.M)) == 2, log
    assert json.loads((run_dir / "status.json").read_text()) == {"status": "completed", "step": 2, "checkpoint": None}
    assert sorted(p.name for p in run_dir.iterdir()) == [
        "metrics.jsonl",
        "resolved_config.yaml",
        "status.json",
        "train.log",
    ]


def test_plain_text_preprocessing_and_training_with_split_list(tmp_path):
    text = "\n\n".join(f"paragraph {i}: the router sends tokens to experts.\nsecond line {i}." for i in range(40))
    (tmp_path / "notes.txt").write_text(text + "\n")
    prep = subprocess.run(
        [
            sys.executable,
            "-m",
            "tools.preprocess_data",
            "--input",
            "notes.txt",
            "--output-prefix",
            "data/notes",
            "--append-eod",
        ],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert prep.returncode == 0 and "40 documents" in prep.stdout, prep.stderr
    run = _python(
        tmp_path,
        [
            "data.paths=[data/notes]",
            "data.split=80,20,0",
            "train.steps=3",
            "train.eval_interval=3",
            *TINY[:3],
            *TINY[4:],
        ],
    )
    assert run.returncode == 0, run.stderr[-3000:]
    (run_dir,) = list((tmp_path / "outputs").glob("*/*"))
    recs = _records(run_dir)
    assert [r["step"] for r in recs if r["kind"] == "train"] == [1, 2, 3]
    assert [r["kind"] for r in recs].count("eval") == 1


def _readme_first_hour():
    """The README's first-hour commands that preprocess notes.txt and train on it, as written."""
    text = open(os.path.join(ROOT, "README.md")).read()
    block = text.split("### The first hour", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    lines = [line.split("#", 1)[0].split() for line in block.splitlines()]
    prep = next(t for t in lines if t[1:3] == ["-m", "tools.preprocess_data"])
    train = next(t for t in lines if t[1:2] == ["examples/pretrain_mixtral.py"] and "data.paths=[data/notes]" in t)
    return prep, train


def test_readme_first_hour_on_one_document_per_line_text(tmp_path):
    # the common plain-text form: one document per line, no blank lines (Megatron's JSONL rule)
    lines = [f"note {i}: the router sends each token to two of eight experts." for i in range(120)]
    (tmp_path / "notes.txt").write_text("\n".join(lines) + "\n")
    prep, train = _readme_first_hour()
    assert prep[prep.index("--input") + 1] == "notes.txt"
    p = subprocess.run(
        [sys.executable, *prep[1:]], cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 0, p.stderr
    assert "120 documents (one per line, --text-split auto)" in p.stdout
    # the training command as written; only its length is cut (and W&B off) to keep the test short:
    # the split that used to be empty is built before the first step, and evaluated at step 3
    run = _python(tmp_path, [*train[2:], "train.steps=3", "train.eval_interval=3", *TINY[4:]])
    assert run.returncode == 0, run.stderr[-3000:]
    (run_dir,) = list((tmp_path / "outputs").glob("*/*"))
    recs = _records(run_dir)
    assert [r["step"] for r in recs if r["kind"] == "train"] == [1, 2, 3]
    assert [r["kind"] for r in recs].count("eval") == 1


def test_an_empty_split_names_text_split(tmp_path):
    (tmp_path / "one.txt").write_text("a single paragraph\nof two lines\n")
    p = subprocess.run(
        [sys.executable, "-m", "tools.preprocess_data", "--input", "one.txt", "--output-prefix", "d/one"]
        + ["--text-split", "paragraph"],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0 and "1 documents (one per paragraph)" in p.stdout, p.stdout + p.stderr
    run = _python(tmp_path, ["data.paths=[d/one]", "data.split=80,20,0", "train.steps=1", *TINY])
    assert run.returncode != 0 and "--text-split line" in run.stderr, run.stderr[-3000:]


def test_resume_continues_in_the_checkpoints_run_directory(tmp_path):
    ck, first, second = tmp_path / "ck", tmp_path / "first", tmp_path / "second"
    a = _python(tmp_path, ["train.steps=3", f"checkpoint.dir={ck}", f"hydra.run.dir={first}", *TINY])
    assert a.returncode == 0, a.stderr[-3000:]
    b = _python(tmp_path, ["train.steps=5", f"checkpoint.dir={ck}", f"hydra.run.dir={second}", *TINY])
    assert b.returncode == 0, b.stderr[-3000:]
    assert not second.exists()  # the resumed launch's own directory was removed
    assert f"run directory: {first} (resumed run: log and metrics appended)" in b.stdout
    recs = _records(first)
    runs = [r for r in recs if r["kind"] == "run"]
    assert [r["start_step"] for r in runs] == [1, 4] and runs[1]["resumed_from"].endswith("step_00000003")
    assert [r["step"] for r in recs if r["kind"] == "train"] == [1, 2, 3, 4, 5]
    assert json.loads((first / "status.json").read_text())["status"] == "completed"
    assert len(list(first.glob("resolved_config*.yaml"))) == 2
    assert (first / "train.log").read_text().count("run directory:") == 2


def test_ctrl_c_under_torchrun_stops_every_worker_cleanly(tmp_path):
    run_dir, ck, logs = tmp_path / "run", tmp_path / "ck", tmp_path / "workers"
    logs.mkdir()
    scratch_before = sorted(glob.glob(os.path.join(tempfile.gettempdir(), "folding-rank*")))
    # each worker is a shell that records its python's exit status and stderr (torchrun forwards the
    # signal to the worker's whole process group; the shell waits for python, then writes the status)
    worker = f'"{sys.executable}" "{SCRIPT}" "$@" 2> "{logs}/err_$RANK.txt"; echo $? > "{logs}/exit_$RANK"'
    job = _torchrun(
        tmp_path,
        4,
        [
            "--no-python",
            "bash",
            "-c",
            worker,
            "bash",
            "train.steps=500",
            "parallel.tp=2",
            "parallel.ep=4",
            "parallel.etp=1",
            f"checkpoint.dir={ck}",
            f"hydra.run.dir={run_dir}",
            *TINY,
        ],
        start_new_session=True,
    )
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and job.poll() is None:
        if (run_dir / "metrics.jsonl").exists() and any(
            r.get("kind") == "train" and r["step"] >= 3 for r in _records(run_dir)
        ):
            break
        time.sleep(0.1)
    assert job.poll() is None, job.communicate()[0][-3000:]
    os.killpg(job.pid, signal.SIGINT)  # what Ctrl-C in the terminal does
    out = job.communicate(timeout=120)[0]
    assert job.returncode != 0  # stock torchrun re-raises the signal it received
    exits = {r: (logs / f"exit_{r}").read_text().strip() for r in range(4)}
    assert exits == {r: "0" for r in range(4)}, (exits, out[-3000:])
    for r in range(4):
        assert "Traceback" not in (logs / f"err_{r}.txt").read_text(), (logs / f"err_{r}.txt").read_text()
    status = json.loads((run_dir / "status.json").read_text())
    assert status["status"] == "stopped" and 3 <= status["step"] < 500, status
    assert status["checkpoint"] == str(ck / f"step_{status['step']:08d}")
    assert os.path.exists(os.path.join(status["checkpoint"], "COMPLETE"))
    # ranks other than 0 create no directory anywhere (no per-rank scratch directories either)
    assert sorted(glob.glob(os.path.join(tempfile.gettempdir(), "folding-rank*"))) == scratch_before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "run", "workers"]
    log = (run_dir / "train.log").read_text()
    assert log.count(f"stop requested by a signal: stopped after step {status['step']}, checkpoint saved") == 1


PROBE = """
import os, sys, threading
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from folding.launch import run as launch
from folding.job.schema import register_schema
register_schema()
with initialize_config_dir(config_dir=os.path.join(sys.argv[1], "configs"), version_base="1.3"):
    tree = OmegaConf.to_container(compose("config", overrides=sys.argv[3:]), resolve=True)
native = lambda: len(os.listdir("/proc/self/task")) - threading.active_count()
before = native()
status = launch.run_job(tree, run_dir=os.path.join(sys.argv[2], "run"))
line = f"rank {os.environ['RANK']} status {status} native threads before {before} after {native()}\\n"
os.write(1, line.encode())  # one write: the ranks share torchrun's stdout, print's two writes can interleave
"""


def test_run_job_leaves_no_process_group_threads_for_interpreter_shutdown(tmp_path):
    # every live gloo group keeps native threads; one alive while the interpreter finalizes can abort
    # the process (SIGABRT) when it releases a tensor: run_job must have freed them all when it returns
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    job = _torchrun(
        tmp_path,
        2,
        [
            str(probe),
            ROOT,
            str(tmp_path),
            "train.steps=2",
            "parallel.ep=2",
            "parallel.etp=1",
            "checkpoint.dir=ck",
            *TINY,
        ],
    )
    out = job.communicate(timeout=180)[0]
    assert job.returncode == 0, out[-3000:]
    lines = sorted(re.findall(r"rank \d+ status \S+ native threads before \d+ after \d+", out))
    assert lines == [f"rank {r} status 0 native threads before 0 after 0" for r in (0, 1)], out[-3000:]


INTERRUPTED = """
import os, signal, sys
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from folding.launch import run as launch
from folding.job.schema import register_schema
signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal, whatever launched this test
register_schema()
with initialize_config_dir(config_dir=os.path.join(sys.argv[1], "configs"), version_base="1.3"):
    tree = OmegaConf.to_container(compose("config", overrides=sys.argv[3:]), resolve=True)
real_prepare, real_release = launch.prepare, launch.release_process_groups
def prepare(*a, **k):  # the first Ctrl-C: while the job is being set up, before any training step
    os.kill(os.getpid(), signal.SIGINT)
    return real_prepare(*a, **k)
def release():  # the second Ctrl-C: while the run winds down
    os.kill(os.getpid(), signal.SIGINT)
    real_release()
launch.prepare, launch.release_process_groups = prepare, release
status = launch.run_job(tree, run_dir=os.path.join(sys.argv[2], "run"))
os.kill(os.getpid(), signal.SIGINT)  # a third, after the job: ignored as well
print(f"status {status}", flush=True)
"""


def test_ctrl_c_during_set_up_and_again_while_winding_down_exits_cleanly(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(INTERRUPTED)
    p = subprocess.run(
        [sys.executable, str(probe), ROOT, str(tmp_path), "train.steps=50", "checkpoint.dir=ck", *TINY],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert p.stdout.splitlines()[-1] == "status 0"
    assert "stop requested by a signal: stopped after step 1, checkpoint saved" in p.stdout
    status = json.loads((tmp_path / "run" / "status.json").read_text())
    assert status["status"] == "stopped" and status["step"] == 1
    assert os.path.exists(os.path.join(status["checkpoint"], "COMPLETE"))


def test_ctrl_c_outside_the_job_is_one_line():
    from folding.training.faults import INTERRUPTED_STATUS, interrupt_exits_quietly

    previous = signal.getsignal(signal.SIGINT)
    err = []
    try:
        try:
            with interrupt_exits_quietly(stream=type("S", (), {"write": err.append, "flush": lambda s: None})()):
                raise KeyboardInterrupt  # e.g. while the command line is checked
        except SystemExit as e:
            assert e.code == INTERRUPTED_STATUS and e.__cause__ is None
        assert "".join(err) == "interrupted\n"
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN  # a second Ctrl-C cannot interrupt the exit
    finally:
        signal.signal(signal.SIGINT, previous)
