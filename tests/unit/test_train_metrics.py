"""Metrics: JSONL appends and never truncates, NaN becomes null, load summaries, console cadence,
and the plot tool draws a PNG from a metrics file."""

import io
import json
import os
import subprocess
import sys

import pytest

from folding.job.config import LoggingConfig, WandbConfig
from folding.training.metrics import MetricsSink, expert_load_summary, progress_bar
from tests.optional import require


def test_expert_load_summary():
    s = expert_load_summary([[1, 1, 1, 1], [4, 0, 0, 0], [0, 0, 0, 0]])
    assert s["load_imbalance"] == [1.0, 4.0, 1.0]
    assert s["load_min"] == [0.25, 0.0, 0.0] and s["load_max"] == [0.25, 1.0, 0.0]


def test_jsonl_one_record_per_step_appends_and_console_interval(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"kind": "old"}\n')
    out = io.StringIO()
    cfg = LoggingConfig(metrics_file=str(path), interval=2, wandb=WandbConfig(mode="disabled"))
    sink = MetricsSink(cfg, run_dir=str(tmp_path), total_steps=5, stream=out)
    for step in range(1, 6):
        sink.log(
            {
                "kind": "train",
                "step": step,
                "loss": float("nan") if step == 3 else 1.0 / step,
                "load_imbalance": [1.5],
                "skipped": step == 3,
            }
        )
    sink.log({"kind": "eval", "step": 5, "lm_loss": 0.5})
    sink.close()
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    assert recs[0] == {"kind": "old"}  # never truncated
    assert [r["step"] for r in recs if r["kind"] == "train"] == [1, 2, 3, 4, 5]
    assert recs[3]["loss"] is None and recs[3]["skipped"] is True
    lines = out.getvalue().splitlines()
    # console: step 1, every 2nd step, the skipped step 3, the last step, and the eval
    assert [ln.split("]")[1].split("|")[0].strip() for ln in lines if ln.startswith("[#") or ln.startswith("[.")] == [
        "1/5",
        "2/5",
        "3/5",
        "4/5",
        "5/5",
    ]
    assert "SKIPPED" in lines[2] and lines[-1].startswith("[eval]")
    assert progress_bar(3, 6, width=6) == "[###...] 3/6"


def test_a_resumed_run_replaces_the_records_of_the_steps_it_replays(tmp_path):
    """A run that wrote steps 1-5 (an eval and a warning at 4, a line cut short by the kill) resumes from its
    step-3 checkpoint: the file keeps one record per step, the replayed steps' marked."""
    path = tmp_path / "m.jsonl"
    cfg = LoggingConfig(metrics_file=str(path), console=False, wandb=WandbConfig(mode="disabled"))
    first = MetricsSink(cfg, run_dir=str(tmp_path), total_steps=8, stream=io.StringIO())
    first.log({"kind": "run", "start_step": 1})
    for step in range(1, 6):
        first.log({"kind": "train", "step": step, "loss": 1.0})
    first.log({"kind": "eval", "step": 4, "lm_loss": 0.5})
    first.warn(4, "something")
    first.close()
    with open(path, "a") as f:
        f.write('{"kind": "train", "st')  # the write the kill cut short
    again = MetricsSink(cfg, run_dir=str(tmp_path), total_steps=8, stream=io.StringIO(), resumed_at=3)
    again.log({"kind": "run", "start_step": 4})
    for step in range(4, 9):
        again.log({"kind": "train", "step": step, "loss": 2.0})
    again.close()
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    train = [r for r in recs if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, 9))  # one record per step
    assert [r["loss"] for r in train] == [1.0] * 3 + [2.0] * 5
    assert [r.get("replayed", False) for r in train] == [False] * 3 + [True] * 2 + [False] * 3
    assert [r["kind"] for r in recs if r.get("step") == 4] == ["train"]  # the first attempt's eval and warning go
    assert [r["start_step"] for r in recs if r["kind"] == "run"] == [1, 4]
    # a fresh sink (no resume) never rewrites the file
    MetricsSink(cfg, run_dir=str(tmp_path), total_steps=8, stream=io.StringIO()).close()
    assert len(path.read_text().splitlines()) == len(recs)


def test_plot_run_writes_png(tmp_path):
    path = tmp_path / "m.jsonl"
    with open(path, "w") as f:
        for step in range(1, 6):
            f.write(
                json.dumps(
                    {
                        "kind": "train",
                        "step": step,
                        "loss": 5 - step * 0.1,
                        "lm_loss": 5 - step * 0.1,
                        "expert_counts": [[step, 2, 3, 4], [4, 3, 2, 1]],
                    }
                )
                + "\n"
            )
        f.write(json.dumps({"kind": "eval", "step": 5, "lm_loss": 4.6}) + "\n")
    out = tmp_path / "p.png"
    root = os.path.join(os.path.dirname(__file__), "..", "..")
    cmd = [sys.executable, "-m", "tools.plot_run", str(path), "--out", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, cwd=root)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000


def test_plot_run_needs_only_the_base_install():
    # the README shows plot_run.py right after `pip install -e .`: its imports are base requirements
    import ast

    root = os.path.join(os.path.dirname(__file__), "..", "..")
    with open(os.path.join(root, "setup.py"), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup")
    base = next(kw.value for kw in call.keywords if kw.arg == "install_requires")
    names = {ast.literal_eval(e).split(">")[0].split("=")[0].split("[")[0] for e in base.elts}
    with open(os.path.join(root, "tools", "plot_run.py"), encoding="utf-8") as f:
        imported = {n.names[0].name.split(".")[0] for n in ast.walk(ast.parse(f.read())) if isinstance(n, ast.Import)}
    third_party = imported - {"argparse", "json", "sys", "os", "math", "folding"}
    assert third_party <= names, third_party - names
    assert "matplotlib" in third_party


def test_plot_run_takes_a_resumed_runs_latest_attempt(tmp_path):
    from tools import plot_run

    recs = (
        [{"kind": "run", "start_step": 1}]
        + [{"kind": "train", "step": s, "loss": 1.0} for s in (1, 2, 3, 4)]
        + [{"kind": "eval", "step": 4}, {"kind": "run", "start_step": 3}]
        + [{"kind": "train", "step": s, "loss": 2.0} for s in (3, 4, 5)]
    )
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    out = plot_run.read_records(str(tmp_path))  # a run directory works too
    train = [(r["step"], r["loss"]) for r in out if r["kind"] == "train"]
    assert train == [(1, 1.0), (2, 1.0), (3, 2.0), (4, 2.0), (5, 2.0)]
    assert not [r for r in out if r["kind"] == "eval"]


def test_console_line_shows_the_mtp_loss_only_with_mtp():
    from folding.training.metrics import format_train_line

    rec = dict(step=3, loss=4.5, lm_loss=4.25, grad_norm=1.0, lr=1e-3, tokens_per_s=10.0)
    plain = format_train_line(rec, 10)
    assert "| lm 4.2500 | gnorm" in plain and "mtp" not in plain
    assert "| lm 4.2500 | mtp 2.5000 | gnorm" in format_train_line(dict(rec, mtp_loss=2.5), 10)


def test_plot_run_imbalance_curves_and_heatmap_window(tmp_path):
    import numpy as np

    from tools import plot_run

    # 2 layers of 4 experts; layer 1's hot expert changes every step, so its average looks balanced
    counts = {1: [[2, 2, 2, 2], [8, 0, 0, 0]], 2: [[2, 2, 2, 2], [0, 8, 0, 0]], 3: [[4, 2, 1, 1], [0, 0, 8, 0]]}
    train = [{"kind": "train", "step": s, "loss": 1.0, "lm_loss": 1.0, "expert_counts": c} for s, c in counts.items()]
    steps, imb = plot_run.imbalance_curves(train)
    assert steps == [1, 2, 3]
    np.testing.assert_allclose(imb, [[1.0, 4.0], [1.0, 4.0], [2.0, 4.0]])  # max / mean per step and layer
    assert plot_run.parse_steps("2:3") == (2, 3) and plot_run.parse_steps("2:") == (2, None)
    assert [r["step"] for r in plot_run.in_window(train, steps=(None, 2))] == [1, 2]
    assert [r["step"] for r in plot_run.in_window(train, last=1)] == [3]
    mat = plot_run.load_matrix(train, steps=(2, 3))  # the mean share over steps 2 and 3 only
    np.testing.assert_allclose(mat, [[0.375, 0.25, 0.1875, 0.1875], [0.0, 0.5, 0.5, 0.0]])
    for bad in ("3:2", "10", "a:b"):
        with pytest.raises(SystemExit, match="--steps"):
            plot_run.parse_steps(bad)
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in train))
    root = os.path.join(os.path.dirname(__file__), "..", "..")
    out = tmp_path / "w.png"
    cmd = [sys.executable, "-m", "tools.plot_run", str(tmp_path), "--steps", "2:3", "--out", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, cwd=root)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    empty = subprocess.run(cmd[:-2] + ["--steps", "7:9"], capture_output=True, text=True, cwd=root)
    assert empty.returncode != 0 and "no 'train' records in the chosen steps" in empty.stderr


def test_sink_warning_goes_to_the_file_and_the_console(tmp_path):
    out = io.StringIO()
    cfg = LoggingConfig(metrics_file="m.jsonl", interval=100, wandb=WandbConfig(mode="disabled"))
    sink = MetricsSink(cfg, run_dir=str(tmp_path), total_steps=50, stream=out)
    sink.warn(7, "router collapse in layer 2: ...", layer=2, experts=[5])
    sink.close()
    assert out.getvalue() == "warning: router collapse in layer 2: ...\n"  # not held back by logging.interval
    rec = json.loads((tmp_path / "m.jsonl").read_text())
    assert rec == {
        "kind": "warning",
        "step": 7,
        "message": "router collapse in layer 2: ...",
        "layer": 2,
        "experts": [5],
    }


def test_plot_run_help_ends_its_sentence():
    root = os.path.join(os.path.dirname(__file__), "..", "..")
    out = subprocess.run(
        [sys.executable, "-m", "tools.plot_run", "--help"], capture_output=True, text=True, cwd=root, check=True
    ).stdout
    text = " ".join(out.split("\n\n")[1].split())  # the description paragraph
    assert text.endswith("and a layer x expert load heatmap."), text


WANDB_SINK = """
import json, sys
from folding.job.config import LoggingConfig, WandbConfig
from folding.training.metrics import MetricsSink
lines = []
sink = MetricsSink(LoggingConfig(metrics_file="m.jsonl", wandb=WandbConfig(mode="offline")), run_dir=sys.argv[1],
                   total_steps=1, echo=lambda line, console=True: lines.append((line, console)))
sink.log({"kind": "train", "step": 1, "loss": 1.0, "lm_loss": 1.0})
sink.close()
print("ECHOED " + json.dumps(lines))
"""


def test_wandb_summary_goes_to_the_log_only(tmp_path):
    require("wandb")
    root = os.path.join(os.path.dirname(__file__), "..", "..")
    env = {**os.environ, "PYTHONPATH": os.path.abspath(root) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = subprocess.run(
        [sys.executable, "-c", WANDB_SINK, str(tmp_path)], capture_output=True, text=True, env=env, timeout=300
    )
    assert p.returncode == 0, p.stderr
    console, echoed = p.stdout.split("ECHOED ")[0] + p.stderr, json.loads(p.stdout.split("ECHOED ")[1])
    assert "Run history" not in console and "wandb sync" not in console  # the closing summary is not shown
    logged = [line for line, shown in echoed if not shown]
    assert any("Run history" in line for line in logged) and any("wandb sync" in line for line in logged), logged
    shown = [line for line, shown in echoed if shown]  # the train record's line, then one line for W&B
    assert len(shown) == 2 and shown[-1] == "W&B run summary and sync command: in train.log", shown


def test_console_tflops_column_is_measured_or_absent():
    from folding.training.metrics import format_train_line

    rec = dict(step=1, loss=4.5, lm_loss=4.25, grad_norm=1.0, lr=1e-3, tokens_per_s=10.0, tflops_per_device=3e-4)
    cpu = format_train_line(dict(rec, mfu=None), 10)  # no peak known (CPU): no column, not "0.000"
    assert "TFLOP/s" not in cpu and "MFU" not in cpu
    gpu = format_train_line(dict(rec, tflops_per_device=412.34, mfu=0.4169), 10)
    assert "| TFLOP/s/dev 412.3 (MFU 41.7%) |" in gpu


def test_console_eta_is_remaining_steps_times_the_median_step(tmp_path):
    import io
    import re

    from folding.job.config import LoggingConfig, WandbConfig
    from folding.training.metrics import MetricsSink, format_duration

    assert [format_duration(s) for s in (4.4, 187, 18720)] == ["4s", "3m07s", "5h12m"]
    out = io.StringIO()
    cfg = LoggingConfig(metrics_file=str(tmp_path / "m.jsonl"), interval=1, wandb=WandbConfig(mode="disabled"))
    sink = MetricsSink(cfg, run_dir=str(tmp_path), total_steps=100, stream=out)
    for step, secs in ((1, 9.0), (2, 1.0), (3, 2.0)):  # the first step's start-up does not skew the median
        sink.log({"kind": "train", "step": step, "loss": 1.0, "step_time_s": secs})
    sink.close()
    lines = out.getvalue().splitlines()
    assert lines[0].endswith("| eta 14m51s")  # 99 steps x 9 s
    assert lines[2].endswith("| eta 3m14s")  # 97 steps x median(9, 1, 2) = 2 s
    assert re.search(r"\b1/\d+ \| loss", lines[0])  # the start-up benchmark's first-step pattern still matches
