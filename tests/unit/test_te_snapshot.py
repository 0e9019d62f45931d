"""The engine's TransformerEngine calls and the CPU stand-in of TE, held to TE 2.20.2's recorded API.

``tests/data/te_api_2.20.2.json`` was parsed from TE's own sources (``python -m tools.te_api_snapshot``).
Checked here: every TE call site in ``folding/`` (found with ``ast``) and every entry of
:data:`folding.moe.experts.te.TE_API` against the recorded signatures; the stand-in's signatures
(parsed the same way) equal TE's, and its behaviours follow TE's recorded rules (extra state per
recipe, the unsafe-pickle loading rule, ``m_splits``, CUDA, ``use_grouped_tensor``); the engine's
``delayed`` FP8 state survives a save → load through the checkpoint's FP8 functions without the
unsafe-pickle opt-in, where TE's own ``set_extra_state`` path would refuse it.
"""

import ast
import inspect
import io
import os

import pytest
import torch

import folding.moe.experts.te as te_mod
from folding.checkpoint.load import _fp8_states, _load_fp8_states
from folding.moe.experts.fp8_shapes import FP8_DIM_MULTIPLE
from folding.moe.experts.grouped import GroupedMLP
from folding.moe.experts.te import DELAYED_STATE, FP8_ROW_ALIGN, TE_API, fp8_region, make_te_recipe
from tests import te_standin, te_standin_recipes
from tests.te_rules import load_snapshot
from tests.te_standin import CALLS, RULES, STANDS_IN_FOR
from tools.te_api_source import dataclass_fields, signature

SNAP = load_snapshot()
ENV = SNAP["extra_state"]["env"]
ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
KW = dict(num_local_experts=3, hidden_size=32, ffn_hidden_size=32, init_seed=2, init_std=0.3)  # FP8-legal shapes


@pytest.fixture
def stand_in(monkeypatch):
    te_standin.install(monkeypatch)
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setattr(te_mod, "te_available", lambda: (True, ""))
    yield  # the experts are given backend="te": nothing resolves it for this CPU


def test_snapshot_records_the_command_and_the_release():
    head = SNAP["header"]
    assert head["version"] == "2.20.2"
    assert head["made_by"].startswith("pip download --no-deps transformer-engine-cu12==2.20.2 -d DIR && ")
    assert "python -m tools.te_api_snapshot DIR/transformer_engine_cu12-2.20.2-" in head["made_by"]
    assert head["made_by"].endswith("--out tests/data/te_api_2.20.2.json")
    assert ENV == "NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE"


# ------------------------------------------------------------------------------ (a) engine call sites
def _te_call_sites():
    """``(qualified TE name, keywords, positional count, where)`` of every call in folding/ on a name
    bound to a ``transformer_engine`` module, and of every call of a recorded TE method name."""
    te_methods = {n.rsplit(".", 1)[1] for n, r in SNAP["callables"].items() if r["kind"] == "method"}
    sites = []
    for dirpath, _, files in os.walk(os.path.join(ROOT, "folding")):
        for f in files:
            if not f.endswith(".py"):
                continue
            path = os.path.join(dirpath, f)
            tree = ast.parse(open(path, encoding="utf-8").read())
            aliases = {}
            for n in ast.walk(tree):
                if isinstance(n, ast.Import):
                    for a in n.names:
                        if a.name.startswith("transformer_engine"):
                            aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
                elif isinstance(n, ast.ImportFrom) and (n.module or "").startswith("transformer_engine"):
                    for a in n.names:
                        aliases[a.asname or a.name] = f"{n.module}.{a.name}"
            for n in ast.walk(tree):
                if not isinstance(n, ast.Call):
                    continue
                chain, node = [], n.func
                while isinstance(node, ast.Attribute):
                    chain.insert(0, node.attr)
                    node = node.value
                where = f"{os.path.relpath(path, ROOT)}:{n.lineno}"
                kws = tuple(k.arg for k in n.keywords)
                if isinstance(node, ast.Name) and node.id in aliases:
                    sites.append((".".join([aliases[node.id]] + chain), kws, len(n.args), where))
                elif chain and chain[-1] in te_methods | {"fp8_autocast"}:
                    sites.append((f"transformer_engine.pytorch.GroupedLinear.{chain[-1]}", kws, len(n.args), where))
    return sites


def test_every_engine_te_call_site_is_in_te_api_and_the_snapshot():
    sites = _te_call_sites()
    found = {q for q, *_ in sites}
    # the module-attribute calls and the method calls the walk must find (a walk finding nothing passes nothing)
    assert {"transformer_engine.pytorch.GroupedLinear", "transformer_engine.pytorch.autocast"} <= found
    assert "transformer_engine.pytorch.GroupedLinear.init_fp8_meta_tensors" in found
    for name, kws, npos, where in sites:
        assert name in TE_API, f"{where}: {name} is called but not listed in TE_API"
        assert name in SNAP["callables"], f"{where}: {name} is not in TE 2.20.2"
        params = {p["name"]: p for p in SNAP["callables"][name]["params"]}
        assert set(kws) <= set(TE_API[name]), f"{where}: keywords {set(kws) - set(TE_API[name])} not in TE_API"
        assert set(kws) <= set(params), f"{where}: {name} has no keyword(s) {set(kws) - set(params)} in TE 2.20.2"
        assert npos == 0, f"{where}: {name} called positionally; the engine passes TE arguments by keyword"
        required = {n for n, p in params.items() if "default" not in p and p["kind"] != "VAR_KEYWORD"}
        if name.endswith(("GroupedLinear", "autocast")) or name.endswith("init_fp8_meta_tensors"):
            assert required <= set(kws), f"{where}: {name} misses required {required - set(kws)}"
    # the engine no longer hands TE's pickled extra state back and forth, nor uses the deprecated fallback
    assert not [s for s in sites if s[0].rsplit(".", 1)[1] in ("get_extra_state", "set_extra_state", "fp8_autocast")]


def test_te_api_keywords_exist_in_the_snapshot():
    for name, kws in TE_API.items():
        assert name in SNAP["callables"], name
        params = [p["name"] for p in SNAP["callables"][name]["params"]]
        assert set(kws) <= set(params), (name, set(kws) - set(params))
    assert set(te_mod._TE_CHECK.values()) <= {n.rsplit(".", 1)[1] for n in TE_API}  # called through getattr
    assert SNAP["callables"]["transformer_engine.pytorch.fp8_autocast"]["deprecated"]


def test_use_grouped_tensor_is_passed_as_false_which_takes_host_m_splits():
    ugt = SNAP["grouped_linear"]["use_grouped_tensor"]
    assert ugt["default"] == "None" and ugt["env"] == "NVTE_GROUPED_LINEAR_USE_FUSED_GROUPED_GEMM"
    assert "requires CUDA ``m_splits``" in ugt["meaning"]
    tree = ast.parse(inspect.getsource(te_mod.TEGroupedRunner.__init__).strip().replace("\n    ", "\n"))
    (call,) = [c for c in ast.walk(tree) if isinstance(c, ast.Call) and ast.unparse(c.func) == "te.GroupedLinear"]
    assert [ast.unparse(k.value) for k in call.keywords if k.arg == "use_grouped_tensor"] == ["False"]


def test_alignment_state_names_and_shape_multiples_are_te_s():
    by_class = {"delayed": "DelayedScaling", "tensorwise": "Float8CurrentScaling",
                "blockwise": "Float8BlockScaling", "mxfp8": "MXFP8BlockScaling"}  # fmt: skip
    for name, cls in by_class.items():
        assert FP8_ROW_ALIGN[name] == SNAP["alignment"]["per_recipe"][cls], name
        kind = "mxfp8" if name == "mxfp8" else "fp8"
        assert FP8_DIM_MULTIPLE[name] == SNAP["shape_rules"]["dim_multiple"][kind], name
    assert FP8_DIM_MULTIPLE["rowwise"] == SNAP["shape_rules"]["dim_multiple"]["fp8"]
    assert {k: tuple(v) for k, v in SNAP["extra_state"]["delayed_tensors"].items()} == DELAYED_STATE


# ------------------------------------------------------------------------------ (b) the stand-in
def _standin_defs():
    defs = {}
    for mod in (te_standin, te_standin_recipes):
        tree = ast.parse(open(mod.__file__, encoding="utf-8").read())
        defs.update({n.name: n for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef))})
    return defs


@pytest.mark.parametrize("te_name", sorted(STANDS_IN_FOR))
def test_stand_in_signatures_equal_the_snapshot(te_name):
    defs, rec = _standin_defs(), SNAP["callables"][te_name]
    cls_name, _, method = STANDS_IN_FOR[te_name].partition(".")
    node = defs[cls_name]
    if method:
        node = next(m for m in node.body if isinstance(m, ast.FunctionDef) and m.name == method)
        parsed = signature(node)
    elif rec["kind"] == "dataclass":
        parsed = dataclass_fields(node)
    elif rec["kind"] == "class":
        parsed = signature(next(m for m in node.body if isinstance(m, ast.FunctionDef) and m.name == "__init__"))
    else:
        parsed = signature(node, bound=False)
    assert parsed == rec["params"]  # names, order, kinds, defaults (as normalized source text)
    obj = getattr(te_standin, cls_name)
    live = inspect.signature(getattr(obj, method) if method else obj).parameters
    names = [p for p in live if not (method and p == "self")]
    assert names == [p["name"] for p in rec["params"]]


def test_stand_in_covers_every_te_callable_the_engine_uses():
    assert set(TE_API) <= set(STANDS_IN_FOR)


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise", "blockwise", "mxfp8"])
def test_stand_in_extra_state_per_recipe_follows_te(stand_in, recipe):
    mod = te_standin.GroupedLinear(2, 32, 32, device="cpu")
    assert mod.get_extra_state().numel() == 0  # no FP8 forward yet: empty for every recipe
    with te_standin.autocast(enabled=True, recipe=make_te_recipe(recipe)):
        mod(torch.randn(96, 32), [32, 64])  # rows aligned to 32, dims too: legal for every recipe
    extra = mod.get_extra_state()
    if RULES.is_stateless(make_te_recipe(recipe)):
        assert extra.dtype == torch.uint8 and extra.numel() == 0
        mod.set_extra_state(extra)  # an empty payload is ignored, no opt-in needed
    else:
        assert recipe == "delayed" and extra.numel() > 0
        with pytest.raises(RuntimeError, match=ENV):
            te_standin.GroupedLinear(2, 32, 32, device="cpu").set_extra_state(extra)


def test_stand_in_set_extra_state_applies_te_s_rule(stand_in, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)  # the refusal is what TE does without the opt-in
    mod = te_standin.GroupedLinear(2, 32, 32, device="cpu")
    with te_standin.autocast(enabled=True, recipe=make_te_recipe("delayed")):
        mod(torch.randn(96, 32), [32, 64])  # rows aligned to 32, dims too: legal for every recipe
    payload, other = mod.get_extra_state(), te_standin.GroupedLinear(2, 32, 32, device="cpu")
    with pytest.raises(RuntimeError, match=f"set {ENV}=1"):
        other.set_extra_state(payload)
    with pytest.raises(RuntimeError, match=ENV):
        other.set_extra_state(io.BytesIO(b"x"))
    with pytest.raises(RuntimeError, match="Unsupported checkpoint format"):
        other.set_extra_state([1, 2])
    monkeypatch.setenv(ENV, "1")  # the opt-in: TE unpickles and restores
    other.set_extra_state(payload)
    for key, attr in DELAYED_STATE.values():
        torch.testing.assert_close(getattr(other.fp8_meta[key], attr), getattr(mod.fp8_meta[key], attr))


def test_stand_in_checks_m_splits_cuda_and_use_grouped_tensor(stand_in, monkeypatch):
    mod = te_standin.GroupedLinear(3, 8, 4, device="cpu", use_grouped_tensor=False)
    with pytest.raises(ValueError, match=r"does not match number of GEMMs \(3\)"):
        mod(torch.randn(3, 8), [1, 2])
    monkeypatch.setattr(te_standin, "ALLOW_CPU", False)  # TE itself: CUDA or nothing
    with pytest.raises(RuntimeError, match="Got input on device: cpu"):
        mod(torch.randn(3, 8), [1, 1, 1])
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="TransformerEngine needs CUDA"):
            te_standin.GroupedLinear(3, 8, 4, device="cpu")
    monkeypatch.delenv("NVTE_GROUPED_LINEAR_USE_FUSED_GROUPED_GEMM", raising=False)
    assert RULES.use_grouped_tensor(None) is False
    monkeypatch.setenv("NVTE_GROUPED_LINEAR_USE_FUSED_GROUPED_GEMM", "1")
    with pytest.warns(FutureWarning, match="deprecated"):
        assert RULES.use_grouped_tensor(None) is True
    with pytest.raises(ValueError, match="requires CUDA m_splits"):
        RULES.native_path_check(torch.tensor([1, 1, 1]))


# ------------------------------------------------------------------------------ delayed round trip
def _run_delayed_steps(mlp, steps):
    g = torch.Generator().manual_seed(3)
    for s in range(steps):
        with fp8_region("delayed", amax_reduction_group=None, first_microbatch=s == 0):
            mlp(torch.randn(6, 32, generator=g) * (s + 1), [2, 3, 1], torch.rand(6, generator=g)).sum().backward()


def test_delayed_state_save_load_round_trip_passes_te_s_loading_rule(stand_in, tmp_path):
    a = GroupedMLP(backend="te", fp8_recipe="delayed", **KW)
    _run_delayed_steps(a, 2)
    path = str(tmp_path / "rank_0.pt")
    torch.save(_fp8_states([a]), path)  # what save_checkpoint writes to fp8/rank_<r>.pt
    saved = torch.load(path, weights_only=True)[(0, "")]
    leaves = [t for g in saved["gemms"].values() for t in g.values()]
    assert len(leaves) == 8 and all(t.dtype == torch.float32 for t in leaves)  # tensors, no pickled payload
    assert not torch.equal(saved["gemms"]["fc1"]["scale_fwd"], torch.ones_like(saved["gemms"]["fc1"]["scale_fwd"]))
    # TE's own path, which the engine used before: its set_extra_state refuses the pickled payload
    with pytest.raises(RuntimeError, match=ENV):
        RULES.should_load_pickle(a._te.gemms["fc1"].get_extra_state().numpy().tobytes(), "GroupedLinear")
    CALLS.clear()
    b = GroupedMLP(backend="te", fp8_recipe="delayed", **KW)
    _load_fp8_states([b], path)  # without the opt-in (the fixture unset it)
    handed = [c[1] for c in CALLS if c[0] == "set_extra_state"]
    for state in handed:  # whatever the engine hands to set_extra_state must pass TE's rule as is
        assert RULES.set_extra_state_gate(b._te.gemms["fc1"], state)[0]
    assert ("init_meta", "DelayedScaling") in CALLS
    for gemm in ("fc1", "fc2"):
        for saved_name, (key, attr) in DELAYED_STATE.items():
            torch.testing.assert_close(getattr(b._te.gemms[gemm].fp8_meta[key], attr), saved["gemms"][gemm][saved_name])
    before = b._te.gemms["fc1"].fp8_meta["scaling_fwd"].amax_history.clone()
    _run_delayed_steps(b, 1)  # TE's first forward keeps the restored state (same recipe class)
    after = b._te.gemms["fc1"].fp8_meta["scaling_fwd"].amax_history
    torch.testing.assert_close(after[:-1], before[1:])  # rolled once on exit, not reallocated


def test_delayed_state_of_other_experts_or_an_older_format_is_not_restored(stand_in):
    a = GroupedMLP(backend="te", fp8_recipe="delayed", **KW)
    _run_delayed_steps(a, 1)
    state = a.fp8_state()
    other = GroupedMLP(backend="te", fp8_recipe="delayed", **dict(KW, expert_offset=3, num_experts=6))
    assert not other.load_fp8_state(state)  # other experts: TE recalibrates instead
    old = dict(state, gemms={n: m.get_extra_state() for n, m in a._te.gemms.items()})
    assert not GroupedMLP(backend="te", fp8_recipe="delayed", **KW).load_fp8_state(old)
    assert [c for c in CALLS if c[0] == "set_extra_state"] == []  # never handed to TE


# ------------------------------------------------------------------------------ the snapshot tool
def test_the_tool_follows_re_exports_and_base_classes(tmp_path):
    from tools.te_api_snapshot import callable_record
    from tools.te_api_source import SourceTree

    files = {
        "pytorch/__init__.py": "from transformer_engine.pytorch.module import GroupedLinear\n",
        "pytorch/module/__init__.py": "from .grouped_linear import GroupedLinear\n",
        "pytorch/module/base.py": "class Base:\n    def get_extra_state(self):\n        return 1\n",
        "pytorch/module/grouped_linear.py": (
            "import warnings\nfrom .base import Base\n\n"
            "class GroupedLinear(Base):\n"
            "    def __init__(self, num_gemms: int, bias: bool = True, *, device='cuda', **kw):\n"
            "        pass\n"
            "def old(x=1):\n    warnings.warn('old is deprecated', DeprecationWarning)\n"
        ),
    }
    for rel, text in files.items():
        path = tmp_path / "transformer_engine" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    src = SourceTree.open(str(tmp_path))
    rec = callable_record(src, "transformer_engine.pytorch.GroupedLinear")
    assert rec["kind"] == "class" and rec["defined_in"] == "transformer_engine.pytorch.module.grouped_linear"
    assert rec["params"] == [
        {"name": "num_gemms", "kind": "POSITIONAL_OR_KEYWORD"},
        {"name": "bias", "kind": "POSITIONAL_OR_KEYWORD", "default": "True"},
        {"name": "device", "kind": "KEYWORD_ONLY", "default": "'cuda'"},
        {"name": "kw", "kind": "VAR_KEYWORD"},
    ]
    got = callable_record(src, "transformer_engine.pytorch.GroupedLinear.get_extra_state")
    assert got == {"defined_in": "transformer_engine.pytorch.module.base", "kind": "method", "params": []}
    old = callable_record(src, "transformer_engine.pytorch.module.grouped_linear.old")
    assert old["kind"] == "function" and old["deprecated"] == "old is deprecated"


@pytest.mark.skipif(not os.environ.get("TE_WHEEL"), reason="set TE_WHEEL to the 2.20.2 wheel to re-derive the JSON")
def test_the_committed_snapshot_is_what_the_tool_makes_from_the_wheel():
    from tools.te_api_snapshot import snapshot

    wheel = os.environ["TE_WHEEL"]
    assert snapshot(wheel, SNAP["header"]["made_by"]) == SNAP
