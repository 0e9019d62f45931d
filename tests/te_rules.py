"""TransformerEngine's rules as recorded in ``tests/data/te_api_2.20.2.json``, made executable on CPU.

The snapshot (``python -m tools.te_api_snapshot``) records TE's decisions as control flow with the
expressions as source text. :class:`Rules` runs that flow with a small restricted evaluator: names,
attributes, calls, comparisons, boolean and arithmetic operators, literals, f-strings. A name the
flow uses that is not provided here fails loudly, so a new TE release whose rule changed cannot be
interpreted silently. The one part written here rather than read is the scan of a pickle's opcodes
(the ``for`` loop of TE's ``_classify_extra_state_pickle_impl``), driven by the recorded opcode
names, keys and recipe policies.

Usage::

    rules = Rules(load_snapshot())
    rules.should_load_pickle(payload_bytes, "GroupedLinear")   # False (ignore), True, or RuntimeError
"""

from __future__ import annotations

import ast
import builtins
import enum
import io
import json
import math
import os
import pickle
import pickletools
import re
import warnings

import torch

SNAPSHOT = os.path.join(os.path.dirname(__file__), "data", "te_api_2.20.2.json")

_BUILTINS = {n: getattr(builtins, n) for n in ("isinstance", "tuple", "bool", "int", "type", "len", "set", "list")}
_BUILTINS.update(RuntimeError=RuntimeError, ValueError=ValueError, TypeError=TypeError, FutureWarning=FutureWarning)


def load_snapshot(path: str = SNAPSHOT) -> dict:
    """The committed snapshot of TE 2.20.2's API."""
    with open(path, encoding="utf-8") as f:
        return json.load(f)


class _Return(Exception):
    def __init__(self, value):
        self.value = value


def evaluate(text: str, ns: dict):
    """Evaluate one recorded expression over ``ns`` (plus a few builtins); nothing else is reachable."""
    return _eval(ast.parse(text, mode="eval").body, ns)


def _eval(n, ns):  # noqa: C901 - one branch per node type, deliberately flat
    if isinstance(n, ast.Constant):
        return n.value
    if isinstance(n, ast.Name):
        if n.id in ns:
            return ns[n.id]
        if n.id in _BUILTINS:
            return _BUILTINS[n.id]
        raise NameError(f"the recorded TE rule uses {n.id!r}, which tests/te_rules.py does not provide")
    if isinstance(n, ast.Attribute):
        return getattr(_eval(n.value, ns), n.attr)
    if isinstance(n, ast.Call):
        fn = _eval(n.func, ns)
        args = [_eval(a, ns) for a in n.args]
        return fn(*args, **{k.arg: _eval(k.value, ns) for k in n.keywords})
    if isinstance(n, ast.UnaryOp) and isinstance(n.op, (ast.Not, ast.USub)):
        value = _eval(n.operand, ns)
        return not value if isinstance(n.op, ast.Not) else -value
    if isinstance(n, ast.BoolOp):
        vals = (_eval(v, ns) for v in n.values)
        return all(vals) if isinstance(n.op, ast.And) else any(vals)
    if isinstance(n, ast.Compare):
        left = _eval(n.left, ns)
        for op, right_node in zip(n.ops, n.comparators):
            right = _eval(right_node, ns)
            ok = {
                ast.Is: lambda a, b: a is b,
                ast.IsNot: lambda a, b: a is not b,
                ast.Eq: lambda a, b: a == b,
                ast.NotEq: lambda a, b: a != b,
                ast.In: lambda a, b: a in b,
                ast.NotIn: lambda a, b: a not in b,
                ast.Lt: lambda a, b: a < b,
            }[type(op)](left, right)
            if not ok:
                return False
            left = right
        return True
    if isinstance(n, ast.BinOp):
        a, b = _eval(n.left, ns), _eval(n.right, ns)
        return {ast.Mod: lambda: a % b, ast.Mult: lambda: a * b, ast.Add: lambda: a + b}[type(n.op)]()
    if isinstance(n, ast.IfExp):
        return _eval(n.body, ns) if _eval(n.test, ns) else _eval(n.orelse, ns)
    if isinstance(n, ast.Subscript):
        return _eval(n.value, ns)[_eval(n.slice, ns)]
    if isinstance(n, ast.Slice):
        return slice(*(None if x is None else _eval(x, ns) for x in (n.lower, n.upper, n.step)))
    if isinstance(n, (ast.Tuple, ast.List, ast.Set)):
        return {ast.Tuple: tuple, ast.List: list, ast.Set: set}[type(n)](_eval(e, ns) for e in n.elts)
    if isinstance(n, ast.JoinedStr):
        return "".join(str(_eval(v.value, ns)) if isinstance(v, ast.FormattedValue) else v.value for v in n.values)
    raise TypeError(f"the recorded TE rule uses {type(n).__name__} ({ast.unparse(n)}), not interpreted here")


def run(flow: list, ns: dict, loop=None):
    """Run a recorded flow; return ``(True, value)`` at a ``return``, ``(False, None)`` at its end.
    ``loop(ns)`` stands for a recorded ``for`` statement (its body is not recorded)."""
    try:
        _run(flow, ns, loop)
    except _Return as r:
        return True, r.value
    return False, None


def _run(flow, ns, loop):
    for item in flow:
        if "if" in item:
            _run(item["then"] if evaluate(item["if"], ns) else item.get("else", []), ns, loop)
        elif "return" in item:
            raise _Return(evaluate(item["return"], ns))
        elif "raise" in item:
            raise evaluate(item["raise"], ns)
        elif "let" in item:
            if not item["let"].isidentifier():
                raise TypeError(f"recorded assignment to {item['let']!r} is not interpreted here")
            ns[item["let"]] = evaluate(item["value"], ns)
        elif "call" in item:
            evaluate(item["call"], ns)
        elif "try" in item:
            try:
                _run(item["try"], ns, loop)
            except _Return:
                raise
            except Exception:  # noqa: BLE001 - TE's own flow catches everything here
                _run(item["except"], ns, loop)
        elif "for" in item and loop is not None:
            loop(ns)
        else:
            raise TypeError(f"recorded statement {item} is not interpreted here")


class Rules:
    """TE's recorded decisions, runnable: extra-state save/load, ``GroupedLinear``'s checks."""

    def __init__(self, snap: dict):
        """Build the namespace the recorded flows need from ``snap`` (``load_snapshot()``)."""
        self.snap = snap
        es = snap["extra_state"]
        text = json.dumps(es)
        self.Action = enum.Enum(
            "_PickledExtraStateAction", sorted(set(re.findall(r"_PickledExtraStateAction\.(\w+)", text)))
        )
        names = set(es["recipe_policies"].values()) | set(re.findall(r"CheckpointExtraStatePolicy\.(\w+)", text))
        self.Policy = enum.Enum("CheckpointExtraStatePolicy", sorted(names))
        self.policies = {tuple(k.rsplit(".", 1)): self.Policy[v] for k, v in es["recipe_policies"].items()}
        self.ns = dict(es["constants"])
        self.ns["MXFP8_BLOCK_SCALING_SIZE"] = snap["shape_rules"]["MXFP8_BLOCK_SCALING_SIZE"]
        self.ns.update(
            _PickledExtraStateAction=self.Action,
            CheckpointExtraStatePolicy=self.Policy,
            _RECIPE_POLICIES=self.policies,
            os=os,
            torch=torch,
            io=io,
            pickle=pickle,
            pickletools=pickletools,
            warnings=warnings,
            math=math,
        )
        for name, spec in es["functions"].items():
            self.ns[name] = self._function(spec)

    def _function(self, spec):
        def call(*args):
            ns = dict(self.ns, **dict(zip(spec["params"], args)))
            return run(spec["flow"], ns, loop=self._scan_pickle)[1]

        return call

    def _scan_pickle(self, ns):
        """The opcode scan of TE's classifier: strings, the recipe key, delayed-state keys, globals."""
        es = self.snap["extra_state"]
        keys, recipe_key = set(es["constants"]["_FLOAT8_DELAYED_SCALING_STATE_KEYS"]), es["constants"]["_RECIPE_KEY"]
        for opcode, arg, _ in pickletools.genops(ns["data"]):
            if opcode.name in es["string_opcodes"]:
                text = arg.decode("utf-8", "replace") if isinstance(arg, bytes) else arg
                if isinstance(text, str):
                    ns["strings"].append(text)
                    ns["has_recipe_key"] = ns["has_recipe_key"] or text == recipe_key
                    ns["has_delayed_state_keys"] = ns["has_delayed_state_keys"] or text in keys
                continue
            if opcode.name not in es["global_opcodes"]:
                continue
            ns["has_global"] = True
            if opcode.name == "GLOBAL":
                ref = tuple(arg.split()) if isinstance(arg, str) and len(arg.split()) == 2 else None
            else:
                ref = tuple(ns["strings"][-2:]) if len(ns["strings"]) >= 2 else None
            if ref in self.policies:
                ns["policies"].add(self.policies[ref])

    # ---------------------------------------------------------------- extra state
    def should_load_pickle(self, data: bytes, context: str) -> bool:
        """TE's ``should_load_extra_state_pickle``: False (ignore), True (opt-in set), or RuntimeError."""
        return self.ns["should_load_extra_state_pickle"](data, context)

    def is_stateless(self, recipe) -> bool:
        """TE's ``is_stateless_recipe`` (by the recipe class's module and name)."""
        return self.ns["is_stateless_recipe"](recipe)

    def get_extra_state_early(self, module):
        """``(True, empty tensor)`` where TE's ``get_extra_state`` returns before building a payload."""
        return run(self.snap["extra_state"]["get_extra_state"]["prefix"], dict(self.ns, self=module))

    def set_extra_state_gate(self, module, state):
        """TE's ``set_extra_state`` up to the payload: ``(True, None)`` when it ignores ``state``,
        ``(False, payload)`` when it goes on to load it; raises where TE raises."""
        ns = dict(self.ns, self=module, state=state)
        done, _ = run(self.snap["extra_state"]["set_extra_state"]["dispatch"], ns)
        return (True, None) if done else (False, ns["state"])

    # ---------------------------------------------------------------- GroupedLinear
    def use_grouped_tensor(self, value):
        """What ``GroupedLinear.__init__`` makes of ``use_grouped_tensor`` (None: the deprecated env var)."""
        ns = dict(self.ns, use_grouped_tensor=value)
        run(self.snap["grouped_linear"]["use_grouped_tensor"]["init"], ns)
        return ns["use_grouped_tensor"]

    def forward_checks(self, module, m_splits):
        """``GroupedLinear.forward``'s checks of ``m_splits``; returns them as TE converts them."""
        ns = dict(self.ns, self=module, m_splits=m_splits)
        run(self.snap["grouped_linear"]["forward_checks"], ns)
        return ns["m_splits"]

    def native_path_check(self, m_splits) -> None:
        """The check of TE's native grouped-tensor path (taken with ``use_grouped_tensor=True``)."""
        run(self.snap["grouped_linear"]["use_grouped_tensor"]["native_path_m_splits"], dict(self.ns, m_splits=m_splits))

    def cuda_check(self, where: str, **names) -> None:
        """TE's CUDA requirement at ``construct`` (``torch.cuda.is_available()``) or ``forward`` (``inp``)."""
        run(self.snap["grouped_linear"]["cuda_checks"][where], dict(self.ns, **names))

    def delayed_buffers(self, recipe, num_gemms: int, fwd: bool) -> dict:
        """The ``scale`` / ``amax_history`` tensors TE allocates for ``delayed`` (on CPU here)."""
        dm = self.snap["delayed_meta"]
        n = evaluate(dm["quantizer_count"], {"self": _Meta({"num_gemms": num_gemms}), "fwd": fwd})
        out = {}
        for name, spec in dm["buffer_init"].items():
            shape = [evaluate(s, {"num_quantizers": n, "recipe": recipe}) for s in spec["shape"]]
            out[name] = evaluate(spec["fill"], {"torch": torch})(
                *shape, dtype=evaluate(spec["dtype"], {"torch": torch})
            )
        return out

    # ---------------------------------------------------------------- FP8 shapes
    def row_alignment(self, recipe) -> int:
        """TE's ``get_align_size_for_quantization(recipe)``: the rows each split must be a multiple of."""
        return run(self.snap["alignment"]["get_align_size_for_quantization"], dict(self.ns, recipe=recipe))[1]

    def fp8_shape_checks(self, recipe, m_splits: list, out_features: int, in_features: int, backward: bool) -> None:
        """Refuse (``ValueError``) a grouped GEMM under ``recipe`` whose shapes TE's FP8 kernels cannot take.

        Per split ``i`` of ``m`` rows: ``m`` a multiple of :meth:`row_alignment`; every operand of the
        forward GEMM (input ``[m, in]``, weight ``[out, in]``) and, when ``backward``, of the backward
        GEMMs (output gradient ``[m, out]``, weight ``[in, out]``, input ``[in, m]``, output gradient
        ``[out, m]``) passes the recorded ``fp8_gemm_dims`` rule; under MXFP8 every operand also passes
        the recorded ``mxfp8_is_quantizable`` (blocks of 32 along both dimensions). Expressions and
        constants are the snapshot's."""
        rules, align = self.snap["shape_rules"], self.row_alignment(recipe)
        for i, m in enumerate(m_splits):
            if m % align:
                raise ValueError(
                    f"split {i} has {m} rows, not a multiple of {align}: TE's get_align_size_for_quantization "
                    f"for {type(recipe).__name__}; pad each split's rows to it"
                )
            operands = {"input": (m, in_features), "weight": (out_features, in_features)}
            if backward:
                operands["output gradient"] = (m, out_features)
                operands["weight (dgrad)"] = (in_features, out_features)
                operands["input (wgrad)"] = (in_features, m)
                operands["output gradient (wgrad)"] = (out_features, m)
            for role, shape in operands.items():
                tensor = torch.empty(shape, device="meta")
                if evaluate(rules["fp8_gemm_dims"], dict(self.ns, tensor=tensor)):
                    raise ValueError(
                        f"TE's FP8 GEMM refuses the {role} operand of split {i}, shape {list(shape)}: "
                        f"its dimension rule `{rules['fp8_gemm_dims']}` holds"
                    )
                if recipe.mxfp8() and not run(rules["mxfp8_is_quantizable"], dict(self.ns, inp=tensor))[1]:
                    raise ValueError(
                        f"TE's MXFP8 quantizer refuses the {role} operand of split {i}, shape {list(shape)}: "
                        f"not quantizable (both dimensions must be multiples of {rules['MXFP8_BLOCK_SCALING_SIZE']})"
                    )

    def meta_key(self, fwd: bool) -> str:
        """``scaling_fwd`` / ``scaling_bwd``: where TE keeps a direction's recipe state in ``fp8_meta``."""
        return evaluate(self.snap["delayed_meta"]["key"], {"fwd": fwd})


class _Meta:
    def __init__(self, fp8_meta):
        self.fp8_meta = fp8_meta
