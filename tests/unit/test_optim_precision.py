"""Precision-aware AdamW: each state dtype's update against an fp64 reference of the same algorithm,
bf16 stochastic rounding unbiased (statistically), fp8 block storage, the config keys and the bytes
the memory model counts."""

import itertools
import math

import pytest
import torch

from folding.optim.adamw import adamw_fused, adamw_shard
from folding.optim.config import OptimConfig, OptimConfigError
from folding.optim.precision import FP8_BLOCK, StateShard, round_bf16_stochastic
from folding.planning.optim_precision import STATE_BYTES, OptimizerPrecision

HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
N = 3 * FP8_BLOCK + 17  # a partial last fp8 block
BF16_U = 2.0**-8  # unit roundoff of bf16 (round to nearest)
FP8_U = 2.0**-4  # unit roundoff of e4m3


def _values(seed, positive=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, generator=g, dtype=torch.float64) * torch.logspace(-3, 1, N, dtype=torch.float64)
    return x.abs() if positive else x


def _bf16_ulp(x):
    """The gap between the bf16 neighbours around |x| (fp64)."""
    e = torch.floor(torch.log2(x.abs().clamp_min(1e-30)))
    return torch.pow(2.0, e - 7)


def _stored(dtype, x, **kw):
    s = StateShard(N, dtype, "cpu", **kw)
    s.write(x.float())
    return s


def _within(got, want, dtype, amax_blocks=None, sqrt_domain=False, scale=None):
    """|got - want| within the rounding of ``dtype`` (fp64 tensors), plus the fp32 arithmetic's
    noise, relative to ``scale`` (the magnitude of the terms summed; default ``|want|``)."""
    err = (got - want).abs()
    noise = 1e-6 * (want.abs() if scale is None else scale)
    if dtype == "fp32":
        bound = 1e-12
    elif dtype == "bf16":
        bound = (BF16_U + 1e-6) * want.abs() + 1e-30
    else:  # e4m3 relative rounding plus half the smallest subnormal step of the block's scale
        sub = (amax_blocks / 448.0).repeat_interleave(FP8_BLOCK)[:N] * 2.0**-10
        if sqrt_domain:  # stored sqrt(v): |sqrt(v)' - sqrt(v)| <= u sqrt(v) + sub, squared back
            r = want.sqrt()
            bound = (r + FP8_U * r + sub) ** 2 - r**2 + 1e-6 * want
        else:
            bound = (FP8_U + 1e-6) * want.abs() + sub
    bound = bound + noise
    assert (err <= bound).all(), (dtype, (err - bound).max().item())


def _block_amax(x):
    pad = torch.nn.functional.pad(x.abs(), (0, -N % FP8_BLOCK))
    return pad.view(-1, FP8_BLOCK).amax(1)


@pytest.mark.parametrize("m_dtype,v_dtype", list(itertools.product(("fp32", "bf16", "fp8"), repeat=2)))
@pytest.mark.parametrize("w_dtype", ["fp32", "bf16"])
def test_update_matches_fp64_reference_within_dtype_rounding(m_dtype, v_dtype, w_dtype):
    """Three steps; each compared with one fp64 step of the same algorithm from the stored states."""
    m = _stored(m_dtype, _values(1) * 1e-2)
    v = _stored(v_dtype, _values(2, positive=True) * 1e-4, sqrt_domain=True)
    w = _stored(w_dtype, _values(3), stochastic=True)
    gen = torch.Generator().manual_seed(5)
    for step in range(1, 4):
        g = _values(10 + step).float()
        m0, v0, w0, g64 = m.read().double(), v.read().double(), w.read().double(), g.double()
        b1, b2, lr, wd = HYPER["beta1"], HYPER["beta2"], HYPER["lr"], HYPER["weight_decay"]
        m1 = b1 * m0 + (1 - b1) * g64
        v1 = b2 * v0 + (1 - b2) * g64 * g64
        bc1, bc2 = 1 - b1**step, 1 - b2**step
        w1 = w0 * (1 - lr * wd) - lr / bc1 * m1 / (v1.sqrt() / math.sqrt(bc2) + HYPER["eps"])
        adamw_shard(w, g, m, v, step=step, generator=gen, **HYPER)
        _within(m.read().double(), m1, m_dtype, _block_amax(m1), scale=b1 * m0.abs() + (1 - b1) * g64.abs())
        _within(v.read().double(), v1, v_dtype, _block_amax(v1.sqrt()), sqrt_domain=True)
        if w_dtype == "fp32":  # m1, v1 enter the update unrounded: fp32 arithmetic only
            assert ((w.read().double() - w1).abs() <= 1e-6 * w1.abs() + 1e-7).all()
        else:  # stochastic rounding picks one of the two bf16 neighbours of the fp32 result
            assert ((w.read().double() - w1).abs() <= _bf16_ulp(w1) * (1 + 1e-3)).all()
        assert w.data.dtype == {"fp32": torch.float32, "bf16": torch.bfloat16}[w_dtype]


def test_fused_and_elementwise_paths_agree_in_fp32():
    a = [_stored("fp32", x) for x in (_values(3), _values(1) * 1e-2, _values(2, True) * 1e-4)]
    b = [_stored("fp32", x) for x in (_values(3), _values(1) * 1e-2, _values(2, True) * 1e-4)]
    for step in range(1, 4):
        g = _values(20 + step).float()
        adamw_fused(*[a[0], g, a[1], a[2]], step_t=torch.tensor(float(step)), **HYPER)
        adamw_shard(b[0], g, b[1], b[2], step=step, **HYPER)
    for x, y in zip(a, b):
        torch.testing.assert_close(x.data, y.data, rtol=1e-6, atol=1e-7)


def test_bf16_stochastic_rounding_is_unbiased():
    """For values at several positions between two bf16 neighbours, the mean of 40000 draws equals
    the value within 5 standard errors (z-test), while round-to-nearest is off by up to half a gap."""
    gen = torch.Generator().manual_seed(0)
    base = torch.tensor([1.0, -3.0, 1e-3, 7e4]).to(torch.bfloat16).float()  # bf16 neighbours
    draws = 40_000
    for frac in (0.03, 0.25, 0.5, 0.77):
        x = base + frac * _bf16_ulp(base.double()).float() * base.sign()
        xs = x.repeat(draws, 1)
        r = round_bf16_stochastic(xs, gen).double()
        gap = _bf16_ulp(base.double())
        p = ((x.double() - base.double()) / (gap * base.sign())).clamp(0, 1)  # the exact fraction in fp32
        se = gap * (p * (1 - p) / draws).sqrt()
        z = (r.mean(0) - x.double()).abs() / se
        assert (z < 5).all(), (frac, z)
        lo = base.double()
        hi = lo + gap * base.sign()
        assert ((r == lo) | (r == hi)).all()  # only the two neighbours
        nearest = x.to(torch.bfloat16).double()
        assert ((nearest - x.double()).abs() > 0.02 * gap).all()  # round-to-nearest is biased here


def test_stochastic_rounding_keeps_small_updates_round_to_nearest_loses():
    """1000 updates of 1e-4 to a bf16 weight of 1.0 (a quarter of half its gap): round to nearest
    never moves, stochastic rounding reaches 1.1 on average."""
    gen = torch.Generator().manual_seed(1)
    rne = torch.ones(4000, dtype=torch.bfloat16)
    sr = torch.ones(4000, dtype=torch.bfloat16)
    for _ in range(1000):
        rne = (rne.float() + 1e-4).to(torch.bfloat16)
        sr = round_bf16_stochastic(sr.float() + 1e-4, gen)
    assert (rne == 1.0).all()
    assert abs(sr.float().mean().item() - 1.1) < 0.01


def test_fp8_storage_blocks_and_bytes():
    x = _values(4) * 1e-3
    x[FP8_BLOCK : 2 * FP8_BLOCK] *= 1e6  # blocks scale independently
    s = _stored("fp8", x)
    assert s.data.dtype == torch.float8_e4m3fn and s.scale.numel() == -(-N // FP8_BLOCK)
    _within(s.read().double(), x.float().double(), "fp8", _block_amax(x))
    assert s.nbytes() == s.data.numel() + 4 * s.scale.numel()
    sq = _stored("fp8", x.abs(), sqrt_domain=True)
    _within(sq.read().double(), x.abs().float().double(), "fp8", _block_amax(x.abs().sqrt()), sqrt_domain=True)
    for d in ("fp32", "bf16", "fp8"):  # the planner's table is the optimizer's
        assert StateShard.bytes_per_element(d) == STATE_BYTES[d]


def test_checkpoint_form_of_each_dtype():
    x = _values(6)
    for d, want in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp8", torch.float32)):
        s = _stored(d, x)
        assert s.saved().dtype == s.saved_dtype() == want
        torch.testing.assert_close(s.saved().float(), s.read(), rtol=0, atol=0)  # exact
        t = StateShard(N, d, "cpu")
        t.write(s.saved().float())
        assert torch.equal(t.read(), s.read())  # a reload in the same dtype is exact


def test_config_keys_are_validated_with_their_names():
    for key, bad in (("exp_avg_dtype", "fp16"), ("exp_avg_sq_dtype", "int8"), ("main_params_dtype", "fp8")):
        with pytest.raises(OptimConfigError, match=f"optim.{key}"):
            OptimConfig(**{key: bad})
    with pytest.raises(OptimConfigError, match="optim.main_grads_dtype"):
        OptimConfig(main_grads_dtype="fp8")
    assert OptimConfig().fused() and not OptimConfig(exp_avg_dtype="bf16").fused()


def test_bf16_master_needs_bf16_parameters():
    from folding.job.config import ConfigError, JobConfig
    from folding.job.validate import validate_job
    from folding.model.presets import get_preset

    job = JobConfig(model=get_preset("mixtral_tiny"), optim=OptimConfig(main_params_dtype="bf16"))
    with pytest.raises(ConfigError, match=r"optim.main_params_dtype.*train.precision=bf16"):
        validate_job(job, world_size=1)
    job.train.precision = "bf16"
    validate_job(job, world_size=1)


def test_bytes_per_parameter():
    f = OptimizerPrecision()
    assert f.state_bytes(2) == 12 and f.state_bytes(4) == 8 and f.update_traffic_bytes(2) == 30
    b = OptimizerPrecision(exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16")
    assert b.state_bytes(2) == 8
    assert OptimizerPrecision(exp_avg_dtype="fp8", exp_avg_sq_dtype="fp8").state_bytes(2) == 4 + 2 * (1 + 4 / 128)
    assert OptimizerPrecision(main_params_dtype="bf16").state_bytes(2) == 8
    assert OptimizerPrecision(main_grads_dtype="bf16").grad_bytes() == 2
    with pytest.raises(ValueError, match="optim.exp_avg_dtype"):
        OptimizerPrecision(exp_avg_dtype="fp16")


def test_memory_model_counts_the_dtypes():
    from folding.model.presets import get_preset
    from folding.parallel import ParallelLayout
    from folding.planning.memory import memory_per_rank, param_counts

    cfg = get_preset("mixtral_tiny")
    lay = ParallelLayout(world_size=4, ep=2, etp=1)
    c = param_counts(cfg, lay, stage=0)
    base = memory_per_rank(cfg, lay, param_bytes=2, distributed=True, stage=0)
    prec = OptimizerPrecision(exp_avg_dtype="bf16", exp_avg_sq_dtype="fp8", main_grads_dtype="bf16")
    e = memory_per_rank(cfg, lay, param_bytes=2, distributed=True, stage=0, optim_precision=prec)
    moments = 2 + 1 + 4 / 128
    assert e.optimizer_dense == int((moments * c.dense + 4 * (c.dense - c.fp32)) / (lay.dp * lay.cp))
    assert e.optimizer_expert == int((moments + 4) * c.expert / lay.edp)
    assert e.grads_dense == 2 * c.dense and e.grads_expert == 2 * c.expert
    assert base.optimizer_dense == int((8 * c.dense + 4 * (c.dense - c.fp32)) / (lay.dp * lay.cp))
    bf16_master = memory_per_rank(
        cfg, lay, param_bytes=2, stage=0, optim_precision=OptimizerPrecision(main_params_dtype="bf16")
    )
    assert bf16_master.optimizer_dense == 8 * c.dense and bf16_master.optimizer_expert == 8 * c.expert


def test_dry_run_shows_optimizer_bytes_per_parameter():
    from folding.job.config import JobConfig, TrainConfig
    from folding.launch.dry_run import dry_run_report
    from folding.model.presets import get_preset

    job = JobConfig(
        model=get_preset("mixtral_tiny"),
        train=TrainConfig(precision="bf16"),
        optim=OptimConfig(exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16"),
    )
    line = next(x for x in dry_run_report(job, world_size=1).splitlines() if x.strip().startswith("optimizer"))
    assert "exp avg bf16, exp avg sq bf16" in line and "8.00 bytes of state per parameter" in line, line
    assert "fp32 12.00, bf16 8.00, fp8 6.06" in line, line
