"""The CPU-side logic of the bring-up's GPU-only cases (``tools.bringup_device_cases``, section 5 of
``tools.gpu_bringup``): the command lines, the result line, the raw call's verdict, the sync call
sites, the exchange timing (``tools.bringup_overlap_step``, with stand-in events and works), the
report's lines, and a clean skip naming the reason when CUDA is absent (the cases run with CUDA
hidden, so this holds on a GPU host too)."""

import json
import os
import subprocess
import sys
import traceback
import warnings

import pytest

from folding.overlap.exchange import Exchange
from folding.overlap.runtime import OverlapRuntime
from tools import bringup_device_cases as dc
from tools import bringup_overlap_step as ovs
from tools import gpu_bringup

ROOT = dc.ROOT


def _no_cuda_env():
    return dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=ROOT, OMP_NUM_THREADS="1")


def test_every_case_skips_cleanly_without_cuda():
    """Each case's function, in one process with CUDA hidden, returns the skip naming the reason."""
    code = (
        "import json; from tools import bringup_device_cases as dc; "
        "print(json.dumps([dc.fp8_zero_engine(), dc.fp8_zero_raw(), dc.overlap_step()]))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=_no_cuda_env(), capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [{"skipped": ovs.NO_CUDA}] * 3
    assert "CUDA" in ovs.NO_CUDA


def test_command_line_refuses_an_unknown_case():
    proc = subprocess.run(
        [sys.executable, "-m", "tools.bringup_device_cases", "fp8-zero"],
        cwd=ROOT,
        env=_no_cuda_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "invalid choice" in proc.stderr and "fp8-zero-raw" in proc.stderr


def test_bringup_command_line():
    args = gpu_bringup.parse_args(["--only", "1,5", "--cpu-smoke"])
    assert args.only == {1, 5} and args.cpu_smoke and args.argv == ["--only", "1,5", "--cpu-smoke"]
    assert gpu_bringup.parse_args([]).only is None
    assert len(gpu_bringup.SECTIONS) == 5 and gpu_bringup.SECTIONS[4][1] is gpu_bringup._device_cases
    for bad in ("6", "0", "a", "1,,2"):
        with pytest.raises(SystemExit):
            gpu_bringup.parse_args(["--only", bad])


def test_result_line_and_the_raw_verdict():
    assert dc.parse_result('noise\nRESULT {"a": 1}\nmore\nRESULT {"b": 2}\n') == {"b": 2}
    assert dc.parse_result("Traceback ...\n") is None
    assert dc.classify_raw(0, {"skipped": "no GPU"}, "").startswith("not run: no GPU")
    assert dc.classify_raw(0, {"asserted": False, "torch": "2.11"}, "").startswith("no assert")
    died = "RuntimeError: CUDA error: device-side assert triggered\nCUTLASS cannot handle delta=0"
    assert dc.classify_raw(1, None, died).startswith("ASSERTS")
    assert dc.classify_raw(-6, None, "Assertion `delta != 0` failed").startswith("ASSERTS")
    assert dc.classify_raw(1, None, "ValueError: something else").startswith("failed otherwise")


def _warn_here():
    warnings.warn("called a synchronizing CUDA operation", UserWarning)
    return sys._getframe().f_lineno - 1


def test_syncs_are_counted_by_the_line_that_raised_them():
    with ovs.captured_warnings() as records:
        lines = [_warn_here() for _ in range(3)]
        warnings.warn("an unrelated warning")
    assert len(records) == 4
    sites = ovs.sync_sites(records)
    here = os.path.relpath(__file__, ROOT)
    assert sites == {f"{here}:{lines[0]} (_warn_here)": 3}
    # the innermost engine frame wins over outer frames of the repository and over torch's own
    stack = [
        traceback.FrameSummary(os.path.join(ROOT, "tools", "x.py"), 5, "outer"),
        traceback.FrameSummary(os.path.join(ROOT, "folding", "moe", "layer.py"), 10, "forward"),
        traceback.FrameSummary(os.path.join(ROOT, "folding", "moe", "host_sync.py"), 20, "to_host"),
        traceback.FrameSummary("/usr/lib/python3/site-packages/torch/_tensor.py", 30, "tolist"),
    ]
    assert ovs.call_site(stack) == os.path.join("folding", "moe", "host_sync.py") + ":20 (to_host)"
    assert ovs.call_site(stack[3:]) == "?"


class _Work:
    def __init__(self, name, trail):
        self.name, self.trail = name, trail

    def wait(self):
        self.trail.append(self.name)


class _Event:
    clock = [0.0]

    def __init__(self, trail):
        self.trail, self.t = trail, None

    def record(self):
        _Event.clock[0] += 1.5
        self.t = _Event.clock[0]
        self.trail.append("event")

    def elapsed_time(self, end):
        return end.t - self.t


def test_exchange_events_bracket_the_waits():
    trail, runtime = [], OverlapRuntime()
    with runtime.active(), ovs.exchange_events(runtime, lambda: _Event(trail)) as log:
        Exchange([_Work("a", trail), _Work("b", trail)], what="ep dispatch").wait()
        Exchange([_Work("c", trail)], what="ep combine").wait()
        Exchange([], what="empty").wait()  # nothing issued: nothing timed
    assert trail == ["event", "a", "b", "event", "event", "c", "event"]
    assert [w for w, *_ in log] == ["ep dispatch", "ep combine"]
    by = ovs.exposed_by_exchange(log)
    assert by == {
        "ep dispatch": {"count": 1, "total_ms": 1.5, "max_ms": 1.5},
        "ep combine": {"count": 1, "total_ms": 1.5, "max_ms": 1.5},
    }
    # outside the block the exchange is the engine's again
    trail.clear()
    with runtime.active():
        Exchange([_Work("d", trail)], what="x").wait()
    assert trail == ["d"]


def _engine(recipe, **r):
    return (0, {"counts": [4, 0], "recipes": {recipe: r}}, "")


def test_section_lines():
    engine = _engine("rowwise", run=True, finite=True, empty_experts_zero_grad=True)
    engine_no = _engine("mxfp8", run=False, why="needs sm_100")
    raw = (1, None, "RuntimeError: CUTLASS cannot handle delta=0")
    step = (
        0,
        {
            "world": 2,
            "device": "cuda:0",
            "ep": 2,
            "syncs_by_site": {"folding/moe/dispatch/host_sync.py:20 (to_host)": 4},
            "exposed_off": {"ep dispatch": {"count": 4, "total_ms": 8.0, "max_ms": 3.0}},
            "exposed_on": {"ep dispatch": {"count": 4, "total_ms": 2.0, "max_ms": 1.0}},
            "exposed_total_ms_by_rank": {"off": [8.0, 7.0], "on": [2.0, 2.5]},
        },
        f"[W] {dc.SYNC_STDERR}\n",
    )
    ok, lines = dc.section_lines(engine, raw, step)
    text = "\n".join(lines)
    assert ok
    assert "| rowwise | yes | True | True |" in text and "ASSERTS" in text
    assert "| folding/moe/dispatch/host_sync.py:20 (to_host) | 4 |" in text and "outside Python (stderr" in text
    assert "| ep dispatch | 4 / 4 | 8.00 / 2.00 | 3.00 / 1.00 |" in text
    ok, lines = dc.section_lines(engine_no, (0, {"skipped": "x"}, ""), (0, {"skipped": ovs.NO_CUDA}, ""))
    assert ok and "| mxfp8 | no: needs sm_100 | | |" in lines and lines[-1] == f"Not run: {ovs.NO_CUDA}."
    bad = _engine("rowwise", run=True, finite=False, empty_experts_zero_grad=True)
    assert not dc.section_lines(bad, raw, step)[0]
    ok, lines = dc.section_lines(engine, raw, (1, None, "Traceback\nRuntimeError: boom"))
    assert not ok and "RuntimeError: boom" in lines


def test_overlap_step_on_cpu_ranks():
    """The overlap step's plumbing on 2 gloo ranks (host-clock events): every exchange (and count read) of the 8
    micro-batches × 2 layers timed, off and on, and the report's lines from it."""
    rc, res, out = dc.run_case("overlap-step", env={"CUDA_VISIBLE_DEVICES": ""}, extra=["--cpu"], timeout_s=300)
    assert rc == 0, out[-3000:]
    assert res["world"] == 2 and res["ep"] == 2 and res["syncs_by_site"] is None
    # the token exchanges, and the dropless count all-gather read on the host before each dispatch
    names = {"ep counts", "ep dispatch", "ep combine", "ep dispatch backward", "ep combine backward"}
    for mode in ("off", "on"):
        assert set(res[f"exposed_{mode}"]) == names, res
        assert all(r["count"] == 16 and r["total_ms"] >= r["max_ms"] >= 0 for r in res[f"exposed_{mode}"].values())
        assert len(res["exposed_total_ms_by_rank"][mode]) == 2
    # the overlapped step timed with a communicator per concurrent role and with shared groups, every exchange
    # of the shared build timed too
    assert all(len(res["step_ms_by_rank"][k]) == 2 for k in ("own_communicators", "shared")), res
    assert all(t > 0 for k in ("own_communicators", "shared") for t in res["step_ms_by_rank"][k]), res
    assert set(res["exposed_on_shared"]) == names, res
    ok, lines = dc.section_lines(_engine("rowwise", run=False, why="no GPU"), (0, {"skipped": "x"}, ""), (rc, res, out))
    assert ok and any(line.startswith("| ep dispatch | 16 / 16 |") for line in lines), lines
    assert any("a communicator per concurrent role" in line for line in lines), lines
