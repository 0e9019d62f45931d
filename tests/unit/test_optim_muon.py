"""Muon: Newton–Schulz against an fp64 reference written from the paper's equations, the orthogonality
band of its output, the momentum/Nesterov/scale/weight-decay update against a hand fp64 reference,
which parameters Muon takes, the matrix layout of sharded records, ZeRO-1 ownership, config errors."""

import math

import pytest
import torch

from folding.optim import OptimConfig, OptimConfigError
from folding.optim.muon import NS_COEFFICIENTS, apply_update, momentum_direction, newton_schulz5, update_scale
from folding.optim.muon_owner import MatrixLayout, assign_owners, local_piece
from folding.optim.param_groups import classify, uses_muon
from folding.parallel.params import mark_param, set_init_spec

SHAPES = [(64, 32), (32, 64), (48, 48), (128, 16), (3, 16, 40)]


def reference_ns(g: torch.Tensor, steps: int) -> torch.Tensor:
    """fp64, one matrix at a time: X0 = G/(||G||_F + 1e-7) (transposed when tall),
    X_{k+1} = a X_k + b (X_k X_kᵀ) X_k + c (X_k X_kᵀ)² X_k."""
    a, b, c = 3.4445, -4.7750, 2.0315
    out = []
    for m in g.double().reshape(-1, *g.shape[-2:]):
        tall = m.shape[0] > m.shape[1]
        x = m.T if tall else m
        x = x / (math.sqrt(float((x * x).sum())) + 1e-7)
        for _ in range(steps):
            a_mat = x @ x.T
            x = a * x + b * a_mat @ x + c * a_mat @ a_mat @ x
        out.append(x.T if tall else x)
    return torch.stack(out).reshape(g.shape)


@pytest.mark.parametrize("shape", SHAPES)
def test_newton_schulz_matches_fp64_reference(shape):
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    got = newton_schulz5(g, steps=5)
    assert got.dtype == torch.float32 and got.shape == g.shape
    # fp32 products of entries <= 0.5 over 5 iterations: measured max error 9e-7; the quintic's
    # slope (up to 3.4 per step) amplifies rounding, 5e-6 leaves margin and still catches a wrong
    # coefficient, a missing transpose or normalization (all O(1e-1) or more)
    torch.testing.assert_close(got.double(), reference_ns(g, 5), rtol=0, atol=5e-6)
    assert NS_COEFFICIENTS == (3.4445, -4.7750, 2.0315)


def test_newton_schulz_output_is_orthogonal_within_the_quintic_band():
    # the band of the scalar iteration f(σ) = aσ + bσ³ + cσ⁵ applied 5 times, over every normalized
    # singular value σ in [2e-3, 1] (smaller ones have not grown yet): measured [0.68, 1.203]
    a, b, c = NS_COEFFICIENTS
    s = torch.linspace(2e-3, 1.0, 200001, dtype=torch.float64)
    for _ in range(5):
        s = a * s + b * s**3 + c * s**5
    lo, hi = float(s.min()), float(s.max())
    assert 0.6 < lo < 0.75 and 1.15 < hi < 1.25, (lo, hi)
    gen = torch.Generator().manual_seed(2)
    u, _ = torch.linalg.qr(torch.randn(40, 40, generator=gen))
    v, _ = torch.linalg.qr(torch.randn(24, 24, generator=gen))
    spread = u[:, :24] @ torch.diag(torch.logspace(-2, 0, 24)) @ v.T  # condition number 100
    # rectangular Gaussian matrices (a square one has singular values near 0, outside the premise)
    for g in [torch.randn(*s, generator=gen) for s in SHAPES if s[-1] != s[-2]] + [spread]:
        shape = tuple(g.shape)
        norm = torch.linalg.matrix_norm(g, keepdim=True)
        assert float((torch.linalg.svdvals(g / norm)).min()) >= 2e-3  # inside the band's premise
        sv = torch.linalg.svdvals(newton_schulz5(g, 5).double())
        # every singular value in the band, to fp32 rounding: U f(Σ) Vᵀ with f(σ) in [lo, hi]
        assert float(sv.min()) >= lo - 1e-4 and float(sv.max()) <= hi + 1e-4, (shape, sv.min(), sv.max())
    assert torch.equal(newton_schulz5(torch.zeros(4, 6)), torch.zeros(4, 6))


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("rows,cols", [(12, 20), (20, 12)])  # wide and tall: the larger side is 20 in both
def test_update_matches_hand_fp64_reference(nesterov, rows, cols):
    mu, lr, wd, scale, steps = 0.9, 0.05, 0.1, 0.2, 3
    gen = torch.Generator().manual_seed(3)
    w0 = torch.randn(2, rows, cols, generator=gen)
    grads = [torch.randn(2, rows, cols, generator=gen) for _ in range(steps)]
    w, m = w0.clone(), torch.zeros(2, rows, cols)
    for g in grads:
        u = momentum_direction(g, m, momentum=mu, nesterov=nesterov)
        apply_update(w, newton_schulz5(u, 5) * update_scale(rows, cols, scale), lr=lr, weight_decay=wd)
    # by hand, fp64; Moonlight's factor 0.2·sqrt(max(rows, cols)) = 0.2·sqrt(20) for both shapes
    wr, mr = w0.double(), torch.zeros(2, rows, cols, dtype=torch.float64)
    for g in grads:
        g = g.double()
        mr = mu * mr + g
        ur = g + mu * mr if nesterov else mr
        wr = wr - lr * wd * wr - lr * scale * math.sqrt(20) * reference_ns(ur, 5)
    torch.testing.assert_close(m.double(), mr, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(w.double(), wr, rtol=0, atol=2e-6)
    assert update_scale(rows, cols, 0.2) == pytest.approx(0.2 * math.sqrt(20))


def test_update_scale_takes_the_larger_side():
    # sqrt(max(rows, cols)), not sqrt(cols) nor sqrt(rows): a tall and a wide matrix of the same sides agree
    assert update_scale(20, 12, 0.2) == pytest.approx(0.2 * math.sqrt(20))
    assert update_scale(12, 20, 0.2) == pytest.approx(0.2 * math.sqrt(20))
    assert update_scale(20, 12, 0.2) != pytest.approx(0.2 * math.sqrt(12))
    assert update_scale(7, 7, 1.0) == pytest.approx(math.sqrt(7))


def _p(shape, full, shards=(), name="w", **tags):
    p = mark_param(torch.nn.Parameter(torch.zeros(*shape)), **tags)
    return set_init_spec(p, full_shape=full, shards=shards)


def test_classification():
    hidden = [
        ("layers.0.attention.q_proj.weight", _p((16, 32), (32, 32), ((0, 1, 2),), tp_sharded=True)),
        ("layers.0.attention.kv_a_proj_with_mqa.weight", _p((40, 32), (40, 32), sequence_parallel=True)),
        ("layers.0.mlp.down_proj.weight", _p((32, 64), (32, 128), ((1, 0, 2),), tp_sharded=True)),
        ("layers.1.mlp.shared_expert.fc1_weight", _p((32, 32), (2, 16, 32), ((1, 0, 1),), tp_sharded=True)),
        ("layers.1.mlp.experts.fc1_weight", _p((4, 32, 32), (8, 2, 16, 32), ((0, 1, 2),), expert=True)),
        ("layers.1.mlp.experts.fc2_weight", _p((4, 32, 16), (8, 32, 16), ((0, 1, 2),), expert=True)),
        ("mtp.0.eh_proj.weight", _p((32, 64), (32, 64))),
    ]
    adamw = [
        ("embedding.weight", _p((512, 32), (512, 32), tp_sharded=True)),
        ("mtp.0.embedding.weight", _p((512, 32), (512, 32))),
        ("output_weight", _p((512, 32), (512, 32), tp_sharded=True)),
        ("layers.1.mlp.router.weight", _p((8, 32), (8, 32), sequence_parallel=True)),
        ("layers.1.mlp.shared_expert.gate_weight", _p((1, 32), (1, 32), sequence_parallel=True)),
        ("layers.0.input_norm.weight", _p((32,), (32,))),
        ("layers.0.attention.q_proj.bias", _p((32,), (32,))),
        ("layers.0.q_norm.weight", _p((1, 4), (1, 4))),
    ]
    for name, p in hidden:
        assert uses_muon(name, p), name
        assert classify(name, p, muon=True).muon and classify(name, p, muon=True).describe().endswith("muon")
    for name, p in adamw:
        assert not uses_muon(name, p), name
    assert not classify("x", _p((4, 4), (4, 4))).muon  # AdamW unless asked


def test_matrix_layout_of_sharded_records():
    fc1 = _p((4, 16, 32), (8, 2, 16, 32), ((0, 1, 2), (2, 1, 2)), expert=True, tp_sharded=True)
    lay = MatrixLayout.of(fc1, "fc1")  # 4 local experts x (gate, up), rows split over ETP2
    assert (lay.count, lay.rows, lay.cols, lay.shard_dim, lay.tp_index, lay.tp_count) == (8, 16, 32, 0, 1, 2)
    assert lay.local_shape == (8, 8, 32)
    fc2 = MatrixLayout.of(_p((4, 32, 8), (8, 32, 16), ((0, 0, 2), (2, 0, 2))), "fc2")
    assert (fc2.count, fc2.rows, fc2.cols, fc2.shard_dim) == (4, 32, 16, 1) and fc2.local_shape == (4, 32, 8)
    whole = MatrixLayout.of(_p((32, 32), (32, 32), ((0, 0, 1),)), "q")
    assert whole.shard_dim is None and whole.count == 1
    full = torch.arange(4 * 32 * 16.0).view(4, 32, 16)
    assert torch.equal(local_piece(full, fc2), full[:, :, :8])
    with pytest.raises(ValueError, match="both matrix dimensions"):
        MatrixLayout.of(_p((16, 16), (32, 32), ((0, 0, 2), (1, 0, 2))), "bad")


def test_owners_are_balanced_and_deterministic():
    assert assign_owners([8, 4, 4, 2], ranks=2) == [0, 1, 1, 0]
    sizes = [512] * 16 + [1024] * 3 + [96]
    owners = assign_owners(sizes, ranks=4)
    load = [sum(s for s, o in zip(sizes, owners) if o == r) for r in range(4)]
    assert max(load) - min(load) <= 512 and owners == assign_owners(sizes, ranks=4)
    assert assign_owners([5, 5], ranks=1) == [0, 0]


def test_config_errors_name_the_field():
    assert OptimConfig().name == "adamw"
    for key, bad in (
        ("name", "sgd"),
        ("muon_momentum", 1.0),
        ("muon_momentum", -0.1),
        ("muon_nesterov", "yes"),
        ("muon_ns_steps", 0),
        ("muon_ns_steps", 2.5),
        ("muon_update_scale", 0.0),
        ("muon_update_scale", float("inf")),
    ):
        with pytest.raises(OptimConfigError, match=f"optim.{key}"):
            OptimConfig(**{key: bad})
    OptimConfig(name="muon", muon_momentum=0.0, muon_nesterov=False, muon_ns_steps=1, muon_update_scale=1)


def test_stack_chunks_bound_the_newton_schulz_stack():
    from folding.optim.muon import NS_STACK_ELEMENTS, stack_chunks
    from folding.planning.optim_precision import NS_STACK_ELEMENTS as PLANNED

    assert PLANNED == NS_STACK_ELEMENTS  # the memory model counts the engine's chunks
    assert stack_chunks(5, 10, budget=25) == [(0, 2), (2, 4), (4, 5)]
    assert stack_chunks(3, 100, budget=25) == [(0, 1), (1, 2), (2, 3)]  # at least one matrix
    assert stack_chunks(0, 10) == []
    # DeepSeek-V3's expert fc1 gate/up matrices [2048, 7168]: two per stack, not all 64 local ones
    assert stack_chunks(64, 2048 * 7168) == [(i, i + 2) for i in range(0, 64, 2)]
