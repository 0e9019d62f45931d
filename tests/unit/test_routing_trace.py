"""The routing trace file and ``tools/routing_trace.py`` on hand-made traces: the re-layout read
(``--ep``), the step window, a resumed writer that drops the steps it redoes, the picture, and the
errors (bad ``--ep``, a resume with other geometry, an empty ``moe.trace_dir``)."""

import json

import numpy as np
import pytest

from folding.moe.config import MoEConfig
from folding.training.telemetry.trace_file import TraceWriter, check_resume, make_header, read_trace, trace_path
from tools.routing_trace import main, summarize

E = 8


def _write(tmp_path, steps, *, start_step=1, ranks=2, ep=2):
    header = make_header(
        model="hand",
        layer_numbers=[1, 3],
        num_experts=E,
        topk=2,
        source_ranks=ranks,
        layout={"ep": ep, "world_size": ranks},
    )
    w = TraceWriter(trace_path(str(tmp_path)), header, start_step=start_step)
    for step, counts_LRE in steps:
        w.append(step, counts_LRE, np.zeros_like(counts_LRE))
    w.close()
    return read_trace(str(tmp_path))


def _skewed():
    """Layer 1: expert 0 gets 40 rows from each of 2 source ranks, experts 1-7 get 10; layer 3 is
    balanced (10 per expert and rank)."""
    counts_LRE = np.full((2, 2, E), 10)
    counts_LRE[0, :, 0] = 40
    return counts_LRE


def test_relayout_read_places_experts_by_ep_rank(tmp_path):
    trace = _write(tmp_path, [(1, _skewed()), (2, _skewed())])
    # per step, layer 1 totals: expert 0 = 80, others 20; total 220
    for ep, want in ((2, 140 / 110), (4, 100 / 55), (8, 80 / 27.5), (1, 1.0)):
        lay1, lay3 = summarize(trace, ep=ep)["layers"]
        assert lay1["max_over_mean"]["p50"] == pytest.approx(want)
        assert lay1["max_over_mean"]["p99"] == pytest.approx(want)
        assert lay3["max_over_mean"]["max"] == pytest.approx(1.0)
        assert len(lay1["ep_rank_tokens"]) == ep and sum(lay1["ep_rank_tokens"]) == 440
    s = summarize(trace, ep=4)
    assert s["layers"][0]["ep_rank_tokens"] == [200, 80, 80, 80]  # experts 0-1 on EP rank 0
    assert s["layers"][0]["ep_load_over_mean_per_step"][0] == pytest.approx([100 / 55, 40 / 55, 40 / 55, 40 / 55])
    assert s["layers"][0]["hottest"][0] == {"expert": 0, "tokens": 160, "share": pytest.approx(160 / 440)}
    assert s["layers"][0]["expert_totals"] == [160] + [40] * 7
    with pytest.raises(ValueError, match="--ep 3: must divide"):
        summarize(trace, ep=3)


def test_percentiles_and_window(tmp_path):
    balanced = np.full((2, 2, E), 10)
    trace = _write(tmp_path, [(s, _skewed() if s == 4 else balanced) for s in range(1, 5)])
    lay1 = summarize(trace, ep=2)["layers"][0]
    assert lay1["max_over_mean_per_step"] == pytest.approx([1.0, 1.0, 1.0, 140 / 110])
    assert lay1["max_over_mean"]["p50"] == pytest.approx(1.0)
    assert lay1["max_over_mean"]["p99"] == pytest.approx(1 + 0.97 * (140 / 110 - 1))  # linear interpolation
    win = summarize(trace, ep=2, steps=(2, 3))
    assert win["steps"] == [2, 3] and win["layers"][0]["expert_totals"] == [40] * E
    with pytest.raises(ValueError, match="no record"):
        summarize(trace, steps=(9, None))


def test_resumed_writer_drops_redone_steps_and_keeps_the_range(tmp_path):
    ones = np.ones((2, 2, E))
    _write(tmp_path, [(s, ones * s) for s in range(1, 6)])
    trace = _write(tmp_path, [(4, ones * 40)], start_step=4)  # resumed from a checkpoint at step 3
    assert trace.steps.tolist() == [1, 2, 3, 4]
    assert (trace.header["first_step"], trace.header["last_step"]) == (1, 4)
    assert trace.counts_SLRE[-1].max() == 40
    fresh = _write(tmp_path, [(1, ones)])  # a run from step 1 replaces the file
    assert fresh.steps.tolist() == [1]
    other = make_header(model="hand", layer_numbers=[1, 3], num_experts=E, topk=2, source_ranks=4, layout={"ep": 4})
    assert "source_ranks 2 -> 4" in check_resume(trace_path(str(tmp_path)), other)
    with pytest.raises(ValueError, match="moe.trace_dir: .*another directory"):
        TraceWriter(trace_path(str(tmp_path)), other, start_step=2)


def test_command_line_json_text_plot_and_errors(tmp_path, capsys):
    _write(tmp_path, [(1, _skewed()), (2, _skewed())])
    png = tmp_path / "load.png"
    assert main([str(tmp_path), "--ep", "4", "--plot", str(png)]) == 0
    text = capsys.readouterr().out
    assert "8 experts on EP4 (recorded with EP2 on 2 ranks)" in text and "1.818" in text
    assert png.stat().st_size > 1000
    assert main([trace_path(str(tmp_path)), "--json", "--steps", ":1"]) == 0
    assert json.loads(capsys.readouterr().out)["steps"] == [1]
    assert main([str(tmp_path), "--ep", "3"]) == 2
    assert "--ep 3" in capsys.readouterr().err
    assert main([str(tmp_path), "--steps", "5"]) == 2


def test_trace_dir_setting_is_checked():
    assert MoEConfig(num_experts=8, topk=2, ffn_hidden_size=8, trace_dir="t").trace_dir == "t"
    with pytest.raises(ValueError, match="moe.trace_dir='': must be a directory path; set moe.trace_dir=PATH"):
        MoEConfig(num_experts=8, topk=2, ffn_hidden_size=8, trace_dir="")


def test_resume_with_other_geometry_fails_before_anything_starts(tmp_path):
    from folding.job.config import ConfigError
    from folding.job.validate import validate_job
    from folding.training.telemetry.trace_record import check_trace_dir, trace_header
    from tests.distributed.test_routing_trace import _readme_job

    job = _readme_job([f"moe.trace_dir={tmp_path}", "parallel.ep=2", "parallel.etp=1"])
    layout = validate_job(job, world_size=2)
    header = trace_header(job, layout, world_size=2)
    assert (header["source_ranks"], header["ep"], header["layout"]["dp"]) == (2, 2, 2)
    TraceWriter(trace_path(str(tmp_path)), header, start_step=1).close()
    check_trace_dir(job, layout, world_size=2, resuming=True)  # same geometry: appends
    job4 = _readme_job([f"moe.trace_dir={tmp_path}", "parallel.ep=4", "parallel.etp=1"])
    layout4 = validate_job(job4, world_size=4)
    check_trace_dir(job4, layout4, world_size=4, resuming=False)  # a fresh run replaces the file
    with pytest.raises(ConfigError, match=r"moe.trace_dir=.*source_ranks 2 -> 4.*another directory"):
        check_trace_dir(job4, layout4, world_size=4, resuming=True)
