"""Time of the cost model's primitives: GEMMs in waves of output tiles under an HBM roofline, ring
collectives, all-to-all across the NVLink domain and the network, and collectives overlapped per model
chunk.

Pure functions of sizes, a :class:`~folding.planning.hardware.GPUSpec` and a cluster (anything with ``gpu``
and ``nvlink_domain``, such as :class:`folding.planning.step_time.Cluster`); :mod:`folding.planning.step_time`
composes them into a step.

Usage::

    gemm_time(4096, 2 * 14336, 4096, get_gpu("h100"), eff=0.68)            # one forward GEMM, seconds
    fwd, dgrad, wgrad = gemm_train_times(1024, 4096, 6144, get_gpu("h100"), eff=0.68, groups=8)
    wave_utilization(1024, 5120, 132, groups=16)                           # a grouped GEMM of 16 experts
"""

from __future__ import annotations

import functools
import math

from .hardware import GPUSpec


@functools.lru_cache(maxsize=65536)
def wave_utilization(m: float, n: float, num_sms: int, groups: int = 1) -> float:
    """Fraction of SM time a GEMM with output ``[m, n]`` keeps busy, given whole waves of output tiles.

    The kernel takes the best of 128x128, 128x256 and 256x128 output tiles (what cuBLAS / CUTLASS pick
    among on Hopper): ``tiles / (ceil(tiles / SMs) * SMs)``. ``groups`` equal GEMMs run as one grouped
    GEMM (the experts' grouped GEMM): their tiles share the waves. Cached: the planner asks for the same
    few shapes hundreds of thousands of times.
    """
    best = 0.0
    for tm, tn in ((128, 128), (128, 256), (256, 128)):
        tiles = groups * math.ceil(m / tm) * math.ceil(n / tn)
        waves = math.ceil(tiles / num_sms)
        # A tile that is only partly inside the matrix still costs a whole tile.
        useful = groups * (m * n) / (tm * tn)
        best = max(best, useful / (waves * num_sms))
    return best


@functools.lru_cache(maxsize=65536)
def gemm_time(
    m: float,
    n: float,
    k: float,
    gpu: GPUSpec,
    eff: float,
    groups: int = 1,
    out_bytes: float = 2.0,
    dtype: str = "bf16",
) -> float:
    """Seconds of one GEMM ``[m, k] x [k, n]`` (or a grouped GEMM of ``groups`` of them): the longer of its
    tensor-core time at ``eff`` of the ``dtype`` peak (``bf16`` or ``fp8``), scaled by wave utilization, and
    its HBM time (roofline).

    HBM traffic: the operands once (2 bytes per element in bf16, 1 in fp8), and the ``[m, n]`` output at
    ``out_bytes`` per element (2: a bf16 result; 8: an fp32 accumulator read and written, as weight-gradient
    GEMMs do when they accumulate into fp32 main gradients, Megatron-Core's ``gradient_accumulation_fusion``).
    Cached (a pure function of its arguments, asked for the same shapes by every candidate plan).
    """
    if m <= 0 or n <= 0 or k <= 0:
        return 0.0
    return max(gemm_time_parts(m, n, k, gpu, eff, groups, out_bytes, dtype))


def gemm_time_parts(
    m: float,
    n: float,
    k: float,
    gpu: GPUSpec,
    eff: float,
    groups: int = 1,
    out_bytes: float = 2.0,
    dtype: str = "bf16",
):
    """``(tensor-core seconds, HBM seconds)`` of :func:`gemm_time` (positive sizes), before the roofline's max."""
    peak = gpu.peak_flops(dtype)
    operand = 1.0 if dtype == "fp8" else 2.0
    flops_t = 2.0 * groups * m * n * k / (eff * peak * wave_utilization(m, n, gpu.num_sms, groups))
    hbm_t = groups * (operand * (m * k + k * n) + out_bytes * m * n) / (gpu.hbm_bandwidth * gpu.hbm_efficiency)
    return flops_t, hbm_t


@functools.lru_cache(maxsize=65536)
def gemm_train_times(m: float, n: float, k: float, gpu: GPUSpec, eff: float, groups: int = 1, dtype: str = "bf16"):
    """``(forward, dgrad, wgrad)`` seconds of a linear layer whose forward GEMM is ``[m, k] x [k, n]``, its
    three GEMMs in ``dtype`` (``fp8``: an FP8 recipe's forward, dgrad and wgrad, each at ``eff`` of the FP8 peak).

    dgrad is ``[m, n] x [n, k]`` (output ``[m, k]``); wgrad is ``[k, m] x [m, n]`` (output ``[k, n]``, reduced
    over the ``m`` rows, accumulated into fp32 main gradients); each with its own wave utilization and
    roofline (:func:`gemm_time`). For an expert's grouped GEMM ``m`` is the rows per expert, so a
    fine-grained expert's wgrad has a short reduction and a large fp32 output: it can be HBM-bound. Cached.
    """
    return (
        gemm_time(m, n, k, gpu, eff, groups, dtype=dtype),
        gemm_time(m, k, n, gpu, eff, groups, dtype=dtype),
        gemm_time(k, n, m, gpu, eff, groups, out_bytes=8.0, dtype=dtype),
    )


def _crosses(span: int, cluster) -> bool:
    return span > cluster.nvlink_domain


def _ring_time(bytes_per_rank: float, span: int, cluster) -> float:
    """Time of one ring collective moving ``bytes_per_rank`` per GPU over a group spanning ``span`` ranks."""
    if bytes_per_rank <= 0:
        return 0.0
    x = _crosses(span, cluster)
    return bytes_per_rank / cluster.gpu.link_bandwidth(crosses_node=x, kind="ring") + cluster.gpu.latency(
        crosses_node=x
    )


def _a2a_time(bytes_per_rank: float, size: int, stride: int, cluster) -> float:
    """All-to-all over ``size`` ranks at ``stride``: off-node peers over the NIC, on-node peers over NVLink."""
    if bytes_per_rank <= 0 or size == 1:
        return 0.0
    gpu = cluster.gpu
    per_node = max(1, min(size, cluster.nvlink_domain // stride)) if stride <= cluster.nvlink_domain else 1
    off_node = (size - per_node) / (size - 1)
    t_nv = bytes_per_rank * (1 - off_node) / gpu.link_bandwidth(crosses_node=False, kind="a2a")
    t_ib = bytes_per_rank * off_node / gpu.link_bandwidth(crosses_node=True, kind="a2a")
    return max(t_nv, t_ib) + gpu.latency(crosses_node=off_node > 0)


def _exposed_behind_chunks(comm_s: float, *, pp: int, vpp: int, slot_s: float) -> float:
    """Exposed part of a per-chunk collective of ``comm_s`` in total (``comm_s / vpp`` per model chunk),
    each chunk's share overlapping the compute that follows it on the stage.

    For the gradient reduce-scatter, counted back from the stage's last backward: chunk ``j``'s gradients
    are ready once its last micro-batch's backward starts (bucket by bucket), ``j·pp + 1`` chunk-backward
    slots of ``slot_s`` before the end under interleaved 1F1B (the last chunk first); the chunks' transfers
    queue on the links. With ``vpp = 1`` this is ``max(0, comm_s - slot_s)``.
    """
    if comm_s <= 0:
        return 0.0
    end = -math.inf
    for j in range(vpp - 1, -1, -1):
        start = max(-(j * pp + 1) * slot_s, end)
        end = start + comm_s / vpp
    return max(0.0, end)


def _staged_a2a_time(row_bytes: float, nic_rows: float, nvlink_rows: float, cluster) -> float:
    """The hierarchical dispatcher's exchange: ``nic_rows`` rows of ``row_bytes`` over the NIC (stage A, one
    per distinct remote node), then ``nvlink_rows`` over NVLink (stage B, the forwarding hop), one after
    the other: stage B forwards what stage A received (two collectives, each with its latency)."""
    gpu = cluster.gpu
    t = 0.0
    if nic_rows > 0:
        t += nic_rows * row_bytes / gpu.link_bandwidth(crosses_node=True, kind="a2a") + gpu.latency(crosses_node=True)
    if nvlink_rows > 0:
        t += nvlink_rows * row_bytes / gpu.link_bandwidth(crosses_node=False, kind="a2a") + gpu.latency(
            crosses_node=False
        )
    return t


def hidden_behind(comm_s: float, compute_s: float, contention: float) -> float:
    """Time a collective of ``comm_s`` adds when it runs concurrently with ``compute_s`` of GEMMs: what
    outlasts the GEMMs, plus ``contention`` of the overlapped part (its kernels take SMs and HBM bandwidth)."""
    return max(0.0, comm_s - compute_s) + contention * min(comm_s, compute_s)
