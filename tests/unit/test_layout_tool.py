"""``python -m tools.layout``: JSON output of the worked example, tables, and exit status 2 on bad layouts."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(*args):
    return subprocess.run([sys.executable, "-m", "tools.layout", *args], capture_output=True, text=True, cwd=ROOT)


def test_json_worked_example():
    p = _run("--world", "8", "--tp", "2", "--cp", "2", "--ep", "8", "--etp", "1", "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)  # stdout holds only the JSON
    assert out["attention"]["dp-cp"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert out["attention"]["cp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert out["expert"]["ep"] == [list(range(8))]
    assert set(out["attention"]) >= {"tp", "cp", "dp", "dp-cp", "tp-cp", "tp-dp-cp", "pp", "tp-pp"}
    assert set(out["expert"]) >= {"tp", "ep", "dp", "tp-ep", "tp-ep-pp", "pp"}


def test_tables_and_etp_default():
    p = _run("--world", "8", "--tp", "2", "--ep", "4")  # etp defaults to tp=2
    assert p.returncode == 0, p.stderr
    assert "MoE ETP2 EP4 EDP1" in p.stdout
    expert = p.stdout.split("expert (ETP x EP x EDP x PP)")[1].split()
    assert {"etp", "ep", "edp", "etp-ep"} <= set(expert) and "tp" not in expert and "dp" not in expert


def test_impossible_layout_exits_2():
    p = _run("--world", "8", "--tp", "2", "--ep", "8")
    assert p.returncode == 2
    assert p.stdout == ""
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "etp*ep*pp" in lines[0] and "set --etp explicitly, e.g. --etp 1" in lines[0]
    assert "parallel." not in lines[0]
    p = _run("--world", "8", "--ep", "4", "--num-experts", "6", "--json")
    assert p.returncode == 2 and "--num-experts 6 is not divisible by --ep 4" in p.stderr


def test_tools_share_flag_names():
    import importlib

    def load(name):
        return importlib.import_module(f"tools.{name}")

    common = ["--model", "mixtral_tiny", "--world", "8", "--seq-length", "16", "--micro-batch-size", "2"]
    plan = load("plan").parse_args(common + ["--global-batch-size", "16"])
    mem = load("memory").parse_args(common)
    assert (plan.model, plan.gpus, plan.seq_length, plan.micro_batch_size) == ("mixtral_tiny", 8, 16, 2)
    assert (mem.preset, mem.world, mem.seq, mem.mbs) == ("mixtral_tiny", 8, 16, 2)
    old = load("memory").parse_args(["--preset", "mixtral_tiny", "--world", "8", "--seq", "16", "--mbs", "2"])
    assert (old.preset, old.seq, old.mbs) == ("mixtral_tiny", 16, 2)  # the former spellings
    assert load("layout").parse_args(["--world", "8"]).world == 8


def test_readme_names_the_groups_as_the_tables_do():
    # the multi-axis rank lists the tables print are the ones the README's layout section names
    p = _run("--world", "16", "--tp", "2", "--pp", "2", "--ep", "2", "--etp", "1")
    assert p.returncode == 0, p.stderr
    labels = [line.split()[0] for line in p.stdout.splitlines() if line.startswith("  ")]
    joint = {lab for lab in labels if "-" in lab}
    assert {"tp-pp", "etp-ep", "etp-ep-pp"} <= joint
    readme = open(os.path.join(ROOT, "README.md")).read()
    section = readme[readme.index("Groups, by role") : readme.index("Impossible layouts")]
    for lab in ("tp-pp", "etp-ep", "etp-ep-pp"):
        assert f"`{lab}`" in section, lab
    assert _run("--world", "1").stdout.startswith("1 rank, order")  # not "1 ranks"
