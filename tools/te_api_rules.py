"""The rules of TransformerEngine that the engine and the tests depend on, extracted from its sources.

Each function reads one concern out of a :class:`~tools.te_api_source.SourceTree` (TE's parsed
sources) and returns plain data for :mod:`tools.te_api_snapshot`: TE's decisions as control flow
(:func:`~tools.te_api_source.flow`) with expressions as source text, which ``tests/te_rules.py``
executes on CPU, and the numbers (alignment, block sizes, quantizer counts) read out of the code.

Usage::

    data = extra_state(SourceTree.open(wheel))     # the extra-state save/load rules
"""

from __future__ import annotations

import ast

from tools.te_api_source import SourceTree, calls_named, constant, flow, if_nodes, signature

PT = "transformer_engine.pytorch"
"""TE's PyTorch package."""
RECIPE_MODULE = "transformer_engine.common.recipe"
"""Where TE's recipe classes live."""
RECIPES = ("DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling", "MXFP8BlockScaling")
"""The recipe classes the engine builds (``delayed``, ``tensorwise``, ``blockwise``, ``mxfp8``)."""


def _function(src: SourceTree, module: str, name: str) -> ast.FunctionDef:
    node, _ = src.top_level(module, name)
    return node


def extra_state(src: SourceTree) -> dict:
    """Save and load rules of TE's ``_extra_state`` (``pytorch/_extra_state.py``, ``module/base.py``)."""
    mod = f"{PT}._extra_state"
    tree = src.tree(mod)
    policies = {}
    for stmt in tree.body:
        if isinstance(stmt, ast.AnnAssign) and ast.unparse(stmt.target) == "_RECIPE_POLICIES":
            for k, v in zip(stmt.value.keys, stmt.value.values):
                module_name = constant(tree, k.elts[0].id) if isinstance(k.elts[0], ast.Name) else k.elts[0].value
                policies[f"{module_name}.{k.elts[1].value}"] = v.attr
    impl = _function(src, mod, "_classify_extra_state_pickle_impl")
    loop = next(n for n in impl.body if isinstance(n, ast.For))
    string_ops = next(
        ast.literal_eval(c.comparators[0])
        for c in ast.walk(loop)
        if isinstance(c, ast.Compare) and isinstance(c.comparators[0], ast.Set)
    )
    global_ops = sorted(
        c.comparators[0].value
        for c in ast.walk(loop)
        if isinstance(c, ast.Compare) and isinstance(c.comparators[0], ast.Constant) and "opcode.name" in ast.unparse(c)
    )
    functions = {
        name: {"params": [p["name"] for p in signature(fn, bound=False)], "flow": flow(fn.body)}
        for name, fn in (
            (n, _function(src, mod, n))
            for n in (
                "should_load_extra_state_pickle",
                "_classify_extra_state_pickle",
                "_classify_extra_state_pickle_impl",
                "unsafe_pickle_extra_state_enabled",
                "extra_state_pickle_advisory",
                "is_stateless_recipe",
                "recipe_extra_state_policy",
            )
        )
    }
    base = f"{PT}.module.base"
    cls, _ = src.top_level(base, "TransformerEngineBaseModule")
    get_fn, _ = src.member(cls, base, "get_extra_state")
    set_fn, _ = src.member(cls, base, "set_extra_state")
    prefix = []
    for stmt in get_fn.body:  # the early returns, up to the first write of the payload
        if isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Dict):
            break
        if not isinstance(stmt, ast.FunctionDef):
            prefix.append(stmt)
    payload, tensors = [], {}
    for stmt in ast.walk(get_fn):
        if isinstance(stmt, ast.Assign) and isinstance(stmt.targets[0], ast.Subscript):
            t = stmt.targets[0]
            if ast.unparse(t.value) == "state":
                key = ast.literal_eval(t.slice)
                payload.append(key)
                sub = [
                    n
                    for n in ast.walk(stmt.value)
                    if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Subscript)
                ]
                if sub and "fp8_meta" in ast.unparse(sub[0].value):
                    tensors[key] = [ast.literal_eval(sub[0].value.slice), sub[0].attr]
    dispatch_end = next(
        i for i, s in enumerate(set_fn.body) if isinstance(s, ast.If) and "isinstance" in ast.unparse(s.test)
    )
    return {
        "env": constant(tree, "UNSAFE_PICKLE_EXTRA_STATE_ENV"),
        "constants": {
            "UNSAFE_PICKLE_EXTRA_STATE_ENV": constant(tree, "UNSAFE_PICKLE_EXTRA_STATE_ENV"),
            "_RECIPE_KEY": constant(tree, "_RECIPE_KEY"),
            "_FLOAT8_DELAYED_SCALING_STATE_KEYS": sorted(constant(tree, "_FLOAT8_DELAYED_SCALING_STATE_KEYS")),
        },
        "recipe_policies": policies,
        "string_opcodes": sorted(string_ops),
        "global_opcodes": global_ops,
        "functions": functions,
        "get_extra_state": {"prefix": flow(prefix), "payload_keys": payload, "serialized_with": _serializer(get_fn)},
        "set_extra_state": {"dispatch": flow(set_fn.body[: dispatch_end + 1])},
        "delayed_tensors": tensors,
    }


def _serializer(fn: ast.FunctionDef) -> str:
    names = {ast.unparse(c.func) for c in ast.walk(fn) if isinstance(c, ast.Call)}
    return "pickle.dumps" if "pickle.dumps" in names else "unknown"


def delayed_meta(src: SourceTree) -> dict:
    """Where the ``delayed`` recipe's scales and amax histories live (``fp8_meta[key].attr``), their
    shapes and initial values (``DelayedScalingRecipeState``), and how many quantizers a GEMM has."""
    base = f"{PT}.module.base"
    cls, _ = src.top_level(base, "TransformerEngineBaseModule")
    setter, _ = src.member(cls, base, "set_meta_tensor")
    ifexp = next(n for n in ast.walk(setter) if isinstance(n, ast.IfExp) and "num_gemms" in ast.unparse(n))
    per_gemm = {"fwd": ifexp.body.right.value, "bwd": ifexp.orelse.right.value}
    key_if = next(n for n in ast.walk(setter) if isinstance(n, ast.Assign) and "scaling_fwd" in ast.unparse(n.value))
    state_cls, _ = src.top_level(f"{PT}.quantization", "DelayedScalingRecipeState")
    init, _ = src.member(state_cls, f"{PT}.quantization", "__init__")
    buffers = next(
        ast.literal_eval(s.value)
        for s in state_cls.body
        if isinstance(s, ast.Assign) and ast.unparse(s.targets[0]) == "_persistent_state_buffers"
    )
    shapes = {}
    for s in ast.walk(init):
        if (
            isinstance(s, ast.Assign)
            and ast.unparse(s.targets[0]).startswith("self.")
            and isinstance(s.value, ast.Call)
        ):
            name = ast.unparse(s.targets[0])[5:]
            if name in buffers:
                shapes[name] = {
                    "fill": ast.unparse(s.value.func),
                    "shape": [ast.unparse(a) for a in s.value.args],
                    "dtype": next(ast.unparse(k.value) for k in s.value.keywords if k.arg == "dtype"),
                }
    return {
        "key": ast.unparse(key_if.value),
        "quantizers_per_gemm": per_gemm,
        "quantizer_count": ast.unparse(ifexp),
        "buffers": list(buffers),
        "buffer_init": shapes,
    }


def grouped_linear(src: SourceTree) -> dict:
    """``use_grouped_tensor`` and the checks of ``GroupedLinear`` the stand-in reproduces."""
    mod = f"{PT}.module.grouped_linear"
    cls, _ = src.top_level(mod, "GroupedLinear")
    init, _ = src.member(cls, mod, "__init__")
    fwd, _ = src.member(cls, mod, "forward")
    ugt = if_nodes(init, "use_grouped_tensor is None")[0]
    env = next(c for c in calls_named(ugt, "getenv"))
    doc = ast.get_docstring(cls)
    para = doc.split("use_grouped_tensor :")[1].split("\n\n")[0]
    meaning = " ".join(line.strip() for line in para.splitlines()[1:])
    native = if_nodes(src.tree(mod), "m_splits.device.type", raising=True)[0]
    m_checks = [s for s in fwd.body if isinstance(s, ast.If) and "m_splits" in ast.unparse(s.test)]
    lets = [s for s in fwd.body if isinstance(s, ast.Assign) and ast.unparse(s.targets[0]) == "num_gemms"]
    base = f"{PT}.module.base"
    base_cls, _ = src.top_level(base, "TransformerEngineBaseModule")
    base_init, _ = src.member(base_cls, base, "__init__")
    prep, _ = src.member(base_cls, base, "prepare_forward")
    weights = sorted(
        {ast.unparse(c.args[0]) for c in calls_named(init, "register_parameter") if "weight" in ast.unparse(c.args[0])}
    )
    return {
        "use_grouped_tensor": {
            "default": next(p["default"] for p in signature(init) if p["name"] == "use_grouped_tensor"),
            "env": ast.literal_eval(env.args[0]),
            "init": flow([ugt]),
            "meaning": meaning,
            "native_path_m_splits": flow([native]),
        },
        "forward_checks": flow(lets + m_checks),
        "cuda_checks": {
            "construct": flow(if_nodes(base_init, "cuda", raising=True)),
            "forward": flow(if_nodes(prep, "is_cuda", raising=True)),
        },
        "weight_parameters": weights,
    }


def alignment(src: SourceTree) -> dict:
    """Row alignment per recipe: ``get_align_size_for_quantization`` evaluated with the recipe
    predicates of ``Recipe`` (``mxfp8()`` is ``issubclass(cls, MXFP8BlockScaling)``, ...)."""
    fn, mod = src.find(f"{PT}.quantization.get_align_size_for_quantization")
    recipe_cls, _ = src.top_level(RECIPE_MODULE, "Recipe")
    predicates = {}
    for m in recipe_cls.body:
        if isinstance(m, ast.FunctionDef) and len(m.body) >= 1 and isinstance(m.body[-1], ast.Return):
            ret = m.body[-1].value
            if isinstance(ret, ast.Call) and ast.unparse(ret.func) == "issubclass":
                arg = ret.args[1]
                predicates[m.name] = [e.id for e in (arg.elts if isinstance(arg, ast.Tuple) else [arg])]
    per_recipe = {}
    for r in RECIPES:
        value = None
        for stmt in fn.body:
            if isinstance(stmt, ast.If):
                pred = ast.unparse(stmt.test).replace("recipe.", "").replace("()", "")
                if r in predicates.get(pred, []):
                    value = ast.literal_eval(stmt.body[0].value)
                    break
            elif isinstance(stmt, ast.Return):
                value = ast.literal_eval(stmt.value)
                break
        per_recipe[r] = value
    return {"get_align_size_for_quantization": flow(fn.body), "recipe_predicates": predicates, "per_recipe": per_recipe}


def shape_rules(src: SourceTree) -> dict:
    """What the quantizers need of a GEMM operand's dimensions: MXFP8 blocks of 32 along both the
    last and the flattened leading dimension (``MXFP8Quantizer.is_quantizable``), FP8 GEMMs a last
    dimension divisible by 16 and leading dimensions by 8 (``assert_dim_for_fp8_exec``)."""
    block = constant(src.tree(f"{PT}.constants"), "MXFP8_BLOCK_SCALING_SIZE")
    q_cls, _ = src.top_level(f"{PT}.tensor.mxfp8_tensor", "MXFP8Quantizer")
    quantizable, _ = src.member(q_cls, f"{PT}.tensor.mxfp8_tensor", "is_quantizable")
    fp8_dims = _function(src, f"{PT}.utils", "assert_dim_for_fp8_exec")
    cond = if_nodes(fp8_dims, "%", raising=True)[0]
    mods = {
        ast.unparse(n.left): n.right.value
        for n in ast.walk(cond.test)
        if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Mod)
    }
    return {
        "MXFP8_BLOCK_SCALING_SIZE": block,
        "mxfp8_is_quantizable": flow(quantizable.body),
        "fp8_gemm_dims": ast.unparse(cond.test),
        "dim_multiple": {"mxfp8": block, "fp8": mods["tensor.shape[-1]"]},
        "leading_multiple": {"mxfp8": block, "fp8": mods["math.prod(tensor.shape[:-1])"]},
    }
