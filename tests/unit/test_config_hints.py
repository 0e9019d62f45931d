"""Every hint of a rejected setting points somewhere that works: follow the suggestion and the check passes.

- an expert layout that does not fit the world suggests a size that fits (not the one already set);
- a raw text file given as a dataset prefix suggests the preprocessing command with ``--input`` and a prefix
  without ``.txt``, and that command and prefix train;
- a bare string where a list is expected suggests the bracketed form;
- a key spelled another way (``optim.learning_rate``, ``num_expert``, Megatron-LM's argument names) gets
  "did you mean" with the key that takes it;
- a Megatron-LM flag on the entry point's command line gets its overrides, not Hydra's usage message.
"""

import os
import re
import shlex

import pytest

from folding.data import DataConfig, build_data
from folding.data.indexed import IndexedDatasetError
from folding.launch import cli
from folding.parallel import LayoutError, ParallelLayout

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "..", "configs")


@pytest.fixture(autouse=True)
def _schema(monkeypatch):
    from folding.job.schema import register_schema

    register_schema()
    monkeypatch.setenv("LOCAL_RANK", "0")


def _check(args, capsys, world_size=1):
    status = cli.check_command_line(args, config_dir=CONFIGS, world_size=world_size)
    return status, capsys.readouterr().err


def _suggested(message):
    return dict(re.findall(r"parallel\.(\w+)=(\d+)", message))


def test_expert_layout_hint_suggests_sizes_that_fit(capsys):
    # The reported case: etp=1 is already set, so the fix is EP (or the world), never "set etp=1".
    status, err = _check(["parallel.ep=3", "parallel.etp=1"], capsys)
    assert status == 2 and "parallel.etp=1" not in err.split(";", 1)[1], err
    assert "e.g. parallel.ep=1" in err and "launch a multiple of 3 ranks" in err
    assert _check(["parallel.ep=1", "parallel.etp=1"], capsys)[0] is None
    # etp left to default to tp: setting it explicitly is the fix, and it is said so.
    status, err = _check(["parallel.tp=2", "parallel.ep=8"], capsys, world_size=8)
    assert status == 2 and "etp defaults to tp=2: set parallel.etp explicitly, e.g. parallel.etp=1" in err
    assert _check(["parallel.tp=2", "parallel.ep=8", "parallel.etp=1"], capsys, world_size=8)[0] is None
    # Exhaustively: each size suggested, applied alone, gives a legal layout (experts divisible too).
    tried = 0
    sizes = [(t, e, x, p) for t in (1, 2) for e in (2, 3, 4, 8) for x in (None, 1, 2, 4) for p in (1, 2)]
    for world in (1, 6, 8, 16):
        for tp, ep, etp, pp in sizes:
            kw = dict(world_size=world, tp=tp, ep=ep, etp=etp, pp=pp, num_experts=8)
            if world % (tp * pp):
                continue
            try:
                ParallelLayout(**kw)
                continue
            except LayoutError as e:
                message = str(e)
            if "etp*ep*pp" not in message:
                continue
            for name, size in _suggested(message).items():
                assert not (name == "etp" and etp is not None and int(size) == etp), message
                ParallelLayout(**{**kw, name: int(size)})  # raises if the suggestion does not fit
                tried += 1
    assert tried > 20


def test_the_expert_layout_hint_builds_few_layouts(monkeypatch):
    # The hint tries candidate sizes by building layouts; each must be one that divides the world, or
    # building it would ask for a hint again (the planner checks thousands of illegal layouts).
    built = []
    post_init = ParallelLayout.__post_init__
    monkeypatch.setattr(ParallelLayout, "__post_init__", lambda self: (built.append(1), post_init(self)))
    with pytest.raises(LayoutError, match="e.g. parallel.ep=2"):
        ParallelLayout(world_size=16, ep=64, etp=8, num_experts=64)
    assert len(built) <= 1 + 7 + 63


def test_text_file_as_dataset_prefix_suggests_a_command_that_works(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("\n\n".join(f"Paragraph {i}: " + "words " * 40 for i in range(60)))
    data = dict(seq_length=16, global_batch_size=4, micro_batch_size=1, dp_rank=0, dp_size=1)
    with pytest.raises(IndexedDatasetError) as info:
        build_data(DataConfig(paths=["notes.txt"], split="80,20,0"), **data)
    message = str(info.value)
    assert message.startswith("data.paths entry 'notes.txt': notes.txt.bin and notes.txt.idx do not exist")
    command = re.search(r"run (python -m tools\.preprocess_data [^,]*), then set data\.paths=\[(\w+)\]", message)
    assert command, message
    argv = shlex.split(command.group(1))[3:]
    assert argv[argv.index("--input") + 1] == "notes.txt" and argv[argv.index("--output-prefix") + 1] == "notes"
    from tools.preprocess_data import main as preprocess

    assert preprocess(argv) == 0
    built = build_data(DataConfig(paths=[command.group(2)], split="80,20,0"), **data)
    assert next(iter(built.train)) is not None
    # a prefix that is not a text file: the command names the prefix and asks for the input
    with pytest.raises(IndexedDatasetError, match=r"--input <your \.txt or \.jsonl file> --output-prefix data/x"):
        build_data(DataConfig(paths=["data/x"]), **data)


def test_a_string_where_a_list_is_expected_suggests_brackets(capsys):
    status, err = _check(["data.paths=data/x"], capsys)
    assert status == 2 and err.rstrip().endswith("data.paths takes a list: write data.paths=[data/x]"), err
    assert _check(["data.paths=[data/x]"], capsys)[0] is None  # the bracketed form composes and validates


@pytest.mark.parametrize(
    "given, meant",
    [
        ("optim.learning_rate=1e-3", "optim.lr"),
        ("learning_rate=1e-3", "optim.lr"),
        ("num_expert=4", "moe.num_experts"),
        ("model.num_expert=4", "moe.num_experts"),
        ("optim.lr_warmup_steps=3", "optim.warmup_steps"),
        ("warmup=3", "optim.warmup_steps"),
        ("micro_batch_size=2", "train.micro_batch_size"),
        ("global_batch_size=8", "train.global_batch_size"),
        ("tensor_model_parallel_size=1", "parallel.tp"),
        ("parallel.expert_model_parallel_size=1", "parallel.ep"),
        ("moe.moe_router_topk=4", "moe.topk"),
        ("train.lr=1e-3", "optim.lr"),
        ("model.num_key_value_heads=4", "model.num_kv_heads"),
        ("train_iters=3", "train.steps"),
    ],
)
def test_a_key_spelled_another_way_gets_did_you_mean(given, meant, capsys):
    status, err = _check([given], capsys)
    key, value = given.split("=")
    assert status == 2 and err == f"error: {key}: unknown key; did you mean {meant}?\n"
    assert _check([f"{meant}={value}"], capsys)[0] is None  # the suggestion takes the same value


def test_megatron_flags_on_the_entry_point_get_their_overrides(capsys):
    status, err = _check(["--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "4"], capsys)
    assert status == 2 and err.count("\n") == 1
    assert (
        "Megatron-LM flags; this entry point takes Hydra overrides, here: parallel.tp=2 parallel.ep=4 parallel.etp=2"
        in err
    )
    assert "python -m tools.megatron_args" in err and "usage" not in err
    status, err = _check(["--moe-foo", "3", "train.steps=2"], capsys)
    assert status == 2 and err.startswith("error: --moe-foo: not a flag of this entry point") and "--moe-foo" in err
    assert cli.check_command_line(["--cfg", "job"], config_dir=CONFIGS, world_size=1) is None  # Hydra's own flag
