"""tools/layout.py: JSON output of the worked example, tables, and exit status 2 on bad layouts."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(*args):
    return subprocess.run([sys.executable, os.path.join(ROOT, "tools", "layout.py"), *args],
                          capture_output=True, text=True, cwd=ROOT)


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


def test_impossible_layout_exits_2():
    p = _run("--world", "8", "--tp", "2", "--ep", "8")
    assert p.returncode == 2
    assert p.stdout == ""
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "parallel.etp*ep*pp" in lines[0]
    p = _run("--world", "8", "--ep", "4", "--num-experts", "6", "--json")
    assert p.returncode == 2 and "num_experts=6" in p.stderr
