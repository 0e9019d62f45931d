"""GroupedMLP: every CPU backend against the loop reference, sharding, initialization, chunking, errors."""

import pytest
import torch

from folding.moe.config import MoEConfig
from folding.moe.experts.backends import grouped_linear, plan_chunks, torch_grouped_mm_supported
from folding.moe.experts.grouped import GroupedMLP
from folding.moe.experts.select import resolve_backend
from folding.moe.experts.te import pad_rows_per_expert, te_available, unpad_rows_per_expert
from folding.parallel.params import param_spec, shard_index

# many tiny GEMMs, for which OpenMP synchronization dominates
pytestmark = pytest.mark.usefixtures("one_thread")


TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.bfloat16: dict(rtol=2e-2, atol=2e-3)}
CPU_BACKENDS = ["torch", "auto"]


def _make(backend, dtype, h=16, f=24, e=4, **kw):
    """Experts on CPU with the backend decided first, as a model build does (``auto`` picked, a named one
    checked for this CPU: :func:`resolve_backend`); the experts receive the backend that runs."""
    return GroupedMLP(
        num_local_experts=e,
        hidden_size=h,
        ffn_hidden_size=f,
        backend=resolve_backend(backend, kw.get("fp8_recipe"), torch.device("cpu"), dtype),
        params_dtype=dtype,
        init_std=0.2,
        init_seed=3,
        **kw,
    )


def _run(mod, x, counts, probs, loss="weighted"):
    """Output and the gradients of x, probs, fc1, fc2 for a fresh copy of the inputs."""
    x = x.detach().clone().requires_grad_()
    p = probs.detach().clone().requires_grad_()
    mod.zero_grad(set_to_none=True)
    y = mod(x, counts, p)
    if loss == "sum":  # .sum() hands grouped_mm's backward a stride-0 gradient
        y.sum().backward()
    else:
        g = torch.Generator().manual_seed(11)
        y.backward(torch.randn(y.shape, generator=g).to(y.dtype))
    return [y, x.grad, p.grad, mod.fc1_weight.grad, mod.fc2_weight.grad]


def _counts(seed, e, n_max=9):
    g = torch.Generator().manual_seed(seed)
    c = torch.randint(0, n_max, (e,), generator=g)
    c[torch.randint(0, e, (2,), generator=g)] = 0  # some experts get no tokens
    return c


def _assert_close(got, ref, dtype):
    for a, b in zip(got, ref):
        assert a is not None and b is not None and a.shape == b.shape
        torch.testing.assert_close(a.float(), b.float(), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("h,f", [(16, 24), (6, 5)])  # (6, 5): strides that are not 16-byte multiples
@pytest.mark.parametrize("loss", ["weighted", "sum"])
def test_backend_matches_loop(dtype, backend, h, f, loss):
    ref_mod, mod = _make("loop", dtype, h, f), _make(backend, dtype, h, f)
    for seed in (0, 1):
        counts = _counts(seed, 4)
        n = int(counts.sum())
        g = torch.Generator().manual_seed(100 + seed)
        x = torch.randn(n, h, generator=g).to(dtype)
        probs = torch.rand(n, generator=g)
        _assert_close(_run(mod, x, counts, probs, loss), _run(ref_mod, x, counts, probs, loss), dtype)


@pytest.mark.parametrize("loss", ["weighted", "sum"])  # sum: a rank with no tokens under y.sum()
@pytest.mark.parametrize("experts", [1, 4])
@pytest.mark.parametrize("backend", ["loop", "torch", "auto"])
def test_no_tokens_at_all(backend, experts, loss):
    mod = _make(backend, torch.float32, e=experts)
    y, gx, gp, g1, g2 = _run(
        mod, torch.zeros(0, 16), torch.zeros(experts, dtype=torch.int64), torch.zeros(0), loss=loss
    )
    assert y.shape == (0, 16) and gx.shape == (0, 16)
    assert g1 is not None and g2 is not None and not g1.any() and not g2.any()


def test_counts_as_list_cpu_tensor_and_int32():
    mod = _make("torch", torch.float32)
    x, p = torch.randn(7, 16), torch.rand(7)
    a = mod(x, [2, 0, 5, 0], p)
    assert torch.equal(a, mod(x, torch.tensor([2, 0, 5, 0]), p))
    assert torch.equal(a, mod(x, torch.tensor([2, 0, 5, 0], dtype=torch.int32), p))


def test_auto_picks_grouped_mm_on_this_build():
    mod = _make("auto", torch.float32)
    expected = "torch" if torch_grouped_mm_supported("cpu", torch.float32) else "loop"
    assert mod.backend == expected
    assert _make("auto", torch.float32, fp8_recipe="mxfp8").backend == "emulated"


def test_etp_shards_sum_to_the_unsharded_layer_and_ep_offsets_select_experts():
    full = _make("loop", torch.float32, h=8, f=12, e=4)
    counts = torch.tensor([3, 0, 4, 2])
    x, p = torch.randn(9, 8), torch.rand(9)
    ref = full(x, counts, p)
    parts = [_make("loop", torch.float32, h=8, f=12, e=4, etp_size=3, etp_rank=r)(x, counts, p) for r in range(3)]
    torch.testing.assert_close(sum(parts), ref)
    # EP: a rank holding global experts 2 and 3 computes what the full layer computes for them
    ep = _make("loop", torch.float32, h=8, f=12, e=2, expert_offset=2, num_experts=4)
    torch.testing.assert_close(ep(x[3:], counts[2:], p[3:]), ref[3:])


def test_weights_are_slices_of_layout_free_full_tensors():
    f = 12
    full = _make("loop", torch.float32, h=8, f=f, e=4)
    for r in range(2):
        m = _make("loop", torch.float32, h=8, f=f, e=2, etp_size=2, etp_rank=r, expert_offset=2, num_experts=4)
        fl = f // 2
        gate = full.fc1_weight[2:, r * fl : (r + 1) * fl]
        up = full.fc1_weight[2:, f + r * fl : f + (r + 1) * fl]
        assert torch.equal(m.fc1_weight, torch.cat([gate, up], 1))
        assert torch.equal(m.fc2_weight, full.fc2_weight[2:, :, r * fl : (r + 1) * fl])
        for name in ("fc1_weight", "fc2_weight"):  # the record says which slice of the full tensor it is
            spec, local = param_spec(getattr(m, name)), getattr(m, name)
            whole = getattr(full, name).reshape(spec.full_shape)
            assert torch.equal(whole[shard_index(spec.full_shape, spec.shards)].reshape(local.shape), local)
        assert param_spec(m.fc1_weight).full_shape == (4, 2, f, 8) and param_spec(m.fc1_weight).chunk_dim == 0
    assert not torch.equal(full.fc1_weight[0], full.fc1_weight[1])  # experts differ
    t1, t2 = param_spec(full.fc1_weight), param_spec(full.fc2_weight)
    assert (t1.expert, t1.tp_sharded) == (True, True)
    assert (t2.expert, t2.tp_sharded) == (True, True)
    bf = _make("loop", torch.bfloat16, h=8, f=f, e=4)
    assert bf.fc1_weight.dtype == torch.bfloat16 and torch.equal(bf.fc1_weight, full.fc1_weight.bfloat16())


def test_plan_chunks_hand_worked():
    # width 10, limit 50 -> at most 5 rows per call.
    # counts [3, 0, 4, 12]: call 1 = e0:3 + e1:0 + e2:2; call 2 = e2:2 + e3:3; then e3 5, e3 4.
    assert plan_chunks([3, 0, 4, 12], 10, 50) == [[(0, 3), (1, 0), (2, 2)], [(2, 2), (3, 3)], [(3, 5)], [(3, 4)]]
    assert plan_chunks([3, 0, 4], 10, 10**9) == [[(0, 3), (1, 0), (2, 4)]]


@pytest.mark.parametrize("backend", ["loop", "torch"])
def test_chunked_grouped_linear_matches_one_call(backend):
    x = torch.randn(21, 8, requires_grad=True)
    w = torch.randn(3, 4, 8, requires_grad=True)
    counts = [5, 0, 16]
    ref = grouped_linear(x, w, counts, backend)
    gx, gw = torch.autograd.grad(ref.square().sum(), (x, w))
    small = grouped_linear(x, w, counts, backend, index_limit=(8 + 16) * 6)  # <= 6 rows a call
    hx, hw = torch.autograd.grad(small.square().sum(), (x, w))
    torch.testing.assert_close(small, ref)
    torch.testing.assert_close(hx, gx)
    torch.testing.assert_close(hw, gw)


def test_pad_rows_per_expert_hand_worked():
    x = torch.arange(5.0).unsqueeze(1)  # rows 0,1 -> expert 0; none -> expert 1; rows 2,3,4 -> expert 2
    xp, padded = pad_rows_per_expert(x, [2, 0, 3], 4)
    assert padded == [4, 0, 4]
    assert xp.squeeze(1).tolist() == [0, 1, 0, 0, 2, 3, 4, 0]
    assert torch.equal(unpad_rows_per_expert(xp, [2, 0, 3], padded), x)
    same, p2 = pad_rows_per_expert(x, [2, 0, 3], 1)  # already aligned: no copy
    assert same is x and p2 == [2, 0, 3]


def test_bad_settings_and_inputs_fail_clearly():
    with pytest.raises(ValueError, match="etp_size"):
        GroupedMLP(num_local_experts=2, hidden_size=8, ffn_hidden_size=10, etp_size=4, backend="loop")
    # the backend and recipe names and their pairing are checked once, at the config boundary (MoEConfig);
    # below it, the experts assert them
    moe = dict(num_experts=4, topk=2, ffn_hidden_size=8)
    with pytest.raises(ValueError, match="backend"):
        MoEConfig(**moe, expert_backend="cutlass")
    with pytest.raises(ValueError, match="fp8_recipe"):
        MoEConfig(**moe, expert_backend="emulated")
    with pytest.raises(ValueError, match="'emulated'"):
        MoEConfig(**moe, expert_backend="loop", fp8_recipe="mxfp8")
    with pytest.raises(ValueError, match="fp8_recipe"):
        MoEConfig(**moe, fp8_recipe="int8")
    for backend, recipe in (("emulated", None), ("loop", "mxfp8"), ("emulated", "int8")):
        with pytest.raises(AssertionError):
            GroupedMLP(num_local_experts=2, hidden_size=8, ffn_hidden_size=8, backend=backend, fp8_recipe=recipe)
    for backend in ("cutlass", "auto"):  # the experts take the backend that runs, resolved before
        with pytest.raises(ValueError, match="backend"):
            GroupedMLP(num_local_experts=2, hidden_size=8, ffn_hidden_size=8, backend=backend)
    mod = _make("loop", torch.float32)
    x, p = torch.randn(5, 16), torch.rand(5)
    with pytest.raises(ValueError, match="sum to the number of token rows"):
        mod(x, [2, 2, 0, 0], p)
    with pytest.raises(ValueError, match="num_local_experts=4"):
        mod(x, [5], p)
    with pytest.raises(ValueError, match="probs_N"):
        mod(x, [5, 0, 0, 0], torch.rand(4))
    with pytest.raises(ValueError, match="hidden_size=16"):
        mod(torch.randn(5, 8), [5, 0, 0, 0], p)
    ok, why = te_available()
    if not ok:
        with pytest.raises(RuntimeError, match="expert_backend='te'.*cannot run"):
            _make("te", torch.float32)(x, [5, 0, 0, 0], p)
    with pytest.raises(RuntimeError, match="fp8_recipe"):
        _make("torch", torch.float32, fp8_recipe="mxfp8")(x, [5, 0, 0, 0], p)


def test_grouped_mm_probe_ignores_the_callers_grad_mode():
    # the first caller may be an evaluation under no_grad / inference_mode: the cached answer must not depend on it
    from folding.moe.experts.backends import torch_grouped_mm_supported

    torch_grouped_mm_supported.cache_clear()
    with torch.inference_mode():
        under_inference = torch_grouped_mm_supported("cpu", torch.float32)
    torch_grouped_mm_supported.cache_clear()
    assert under_inference == torch_grouped_mm_supported("cpu", torch.float32)


def test_first_grouped_mm_probe_inside_a_recomputed_region():
    """The backend probe runs where ``auto`` is resolved, before the experts are built, never inside
    their forward: a forward under activation recompute probes nothing and recomputes cleanly."""
    from torch.utils.checkpoint import checkpoint

    from folding.moe.experts.backends import torch_grouped_mm_supported

    mlp = GroupedMLP(num_experts=2, num_local_experts=2, hidden_size=16, ffn_hidden_size=16, etp_size=1,
                     etp_rank=0, expert_offset=0, backend=resolve_backend("auto", None, torch.device("cpu"),
                     torch.float32), init_seed=0)  # fmt: skip
    torch_grouped_mm_supported.cache_clear()
    x = torch.randn(6, 16, requires_grad=True)
    y = checkpoint(lambda a: mlp(a, [2, 4], torch.ones(6)), x, use_reentrant=False)
    y.sum().backward()
    assert x.grad is not None and mlp.fc1_weight.grad is not None
    assert torch_grouped_mm_supported.cache_info().currsize == 0  # no probe in the forward
