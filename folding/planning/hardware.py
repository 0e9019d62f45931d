"""GPU kinds the planner knows: peak FLOP/s, memory and link bandwidths, with their sources.

Every number here is a vendor datasheet value (peak, dense, no sparsity) or an assumption stated next to
it. Achievable fractions of those peaks (link efficiency, HBM efficiency) are hardware-level assumptions
of the cost model, not fitted to any training result: they live in :class:`GPUSpec` so that a user with
measured NCCL / GEMM numbers for their own cluster can replace them.

Sources
-------
- H100 SXM5 80GB: NVIDIA H100 Tensor Core GPU datasheet — BF16 dense 989.4 TFLOP/s, FP8 dense
  1978.9 TFLOP/s, HBM3 80 GB at 3.35 TB/s, NVLink 4 at 900 GB/s bidirectional (450 GB/s per direction).
- H200 SXM 141GB: NVIDIA H200 datasheet — same compute as H100, HBM3e 141 GB at 4.8 TB/s, NVLink 900 GB/s.
- B200 (HGX/DGX B200): NVIDIA DGX B200 datasheet — 72 PFLOP/s FP8 *sparse* for 8 GPUs, i.e. 4.5 PFLOP/s
  dense FP8 and 2.25 PFLOP/s dense BF16 per GPU; 180 GB HBM3e at 8 TB/s (1,440 GB for 8 GPUs; other
  NVIDIA pages quote the B200 at 192 GB); NVLink 5 at 1.8 TB/s bidirectional (900 GB/s per direction).
- Memory capacity (``memory_gb``): the datasheet figure above (80, 141, 180) counted as 10^9 bytes. The
  devices report more: ``nvidia-smi`` shows 81559 MiB on an H100 SXM 80GB, 143771 MiB on an H200 and
  183359 MiB on a B200 (79.6, 140.4 and 179.1 GiB, against the 74.5, 131.3 and 167.6 GiB counted here),
  and ``torch.cuda.get_device_properties(0).total_memory`` within about 1% of that. So the table keeps a
  margin of about 6% on top of the allocator overhead below (the planner's calibration was made with it),
  and a dry run on such a device checks against the table's figure, as the planner does.
- Inter-node: one 400 Gb/s InfiniBand NDR (ConnectX-7) NIC per GPU, the DGX/HGX reference design:
  50 GB/s per direction per GPU.

Assumptions (not calibrated)
----------------------------
- ``ring_efficiency`` 0.80: ring all-gather / reduce-scatter / all-reduce reach about 80% of the link
  bandwidth at the message sizes of training (tens of MB), the usual NCCL-tests bus bandwidth.
- ``a2a_efficiency`` 0.60: all-to-all reaches less (many small peer-to-peer transfers, no pipelining).
- ``hbm_efficiency`` 0.80 of the HBM peak for memory-bound element-wise kernels (permute, SwiGLU, ...).
- ``latency_s`` per collective launch: 20 µs inside the NVLink domain, 40 µs across nodes.
- ``num_sms``: 132 on H100 / H200 SXM, 148 on B200 (datasheets); GEMMs run their output tiles in waves.
- ``overlap_contention`` 0.3: a communication hidden behind GEMMs still costs 30% of its time (its
  kernels take SMs and HBM bandwidth from the GEMM).
- ``host_sync_s`` 30 µs per MoE layer forward: the dropless dispatcher's device-to-host copy of split sizes
  drains the GPU queue (copy + a few kernel launches before the GPU is busy again).
- ``fp8_efficiency`` 0.464 of the FP8 peak for FP8 GEMMs, quantization casts included (``FP8_EFFICIENCY``): not a
  hardware fact but calibrated on the one published FP8 row the planner can reproduce (the MoE Parallel
  Folding paper: Mixtral-8x22B, 128 H100, TP2 PP8 EP8 ETP1, FP8 with delayed scaling on every linear layer,
  631.7 TFLOP/s per GPU against 487.7 in BF16). One constant for every recipe: blockwise and MXFP8 scaling
  cost more casts than delayed scaling, which this row does not show.
- ``usable_memory_gib``: what PyTorch's allocator can reserve: ``memory_gb`` less
  ``OUTSIDE_ALLOCATOR_GIB`` = 2.5 GiB held outside it (CUDA context ≈ 0.5-1 GiB, NCCL communicator
  buffers for the job's dozen process groups ≈ 1 GiB, cuBLAS / TransformerEngine workspaces ≈ 0.5 GiB).
- ``fragmentation`` 0.05: the caching allocator reserves more than the live tensors it hands out (block
  rounding, split blocks that cannot be reused across sizes); 5% assumes
  ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``, which MoE training with varying expert
  batch sizes should use (without it expect 10-20%). A layout fits when
  ``1.05 × estimate ≤ usable_memory_gib``.

Usage::

    gpu = get_gpu("h100")
    gpu.peak_flops("bf16")      # 989.4e12
    gpu.link_bandwidth(crosses_node=True, kind="a2a")   # bytes/s achieved per GPU
    device_gpu("NVIDIA H200", 150_000_000_000)           # the h200 entry (what a dry run on one checks against)
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional

GIB = 1024**3

OUTSIDE_ALLOCATOR_GIB = 2.5
"""GiB of device memory held outside PyTorch's allocator (CUDA context, NCCL buffers, library workspaces)."""

DEVICE_MATCH = 0.10
"""A CUDA device is taken for a kind of the table when its name contains the kind's and its reported memory
is within this fraction of ``memory_gb`` (devices report about 6% more than the datasheet's GB count)."""

#: Fraction of peak FP8 FLOP/s reached by FP8 GEMMs (casts included). Calibrated once, on one row only:
#: Mixtral-8x22B on 128 H100 (seq 4096, global batch 256) with FP8 (delayed scaling, every linear layer),
#: folded layout TP2 PP8 EP8 ETP1, which the MoE Parallel Folding paper measured at 631.7 TFLOP/s per GPU
#: (63.8% of the BF16 peak), with the BF16 GEMMs at the calibrated ``compute_efficiency``.
#: Reproduce with ``folding.planning.planner.calibrate_fp8_efficiency`` (a test does).
FP8_EFFICIENCY = 0.464


@dataclasses.dataclass(frozen=True, kw_only=True)
class GPUSpec:
    """One GPU kind: peaks from the datasheet plus the achievable fractions the cost model uses."""

    name: str
    """Short name used on the command line (``h100``, ``h200``, ``b200``)."""
    bf16_flops: float
    """Peak dense BF16 tensor-core FLOP/s (the MFU denominator)."""
    fp8_flops: float
    """Peak dense FP8 tensor-core FLOP/s."""
    usable_memory_gib: float
    """Memory PyTorch's allocator can reserve (HBM minus what the CUDA context, NCCL and library
    workspaces hold)."""
    memory_gb: float = 0.0
    """HBM capacity as the datasheet states it, in GB of 10^9 bytes (80 for the H100 SXM); informational:
    the fit test reads ``usable_memory_gib``."""
    hbm_bandwidth: float
    """Peak HBM bandwidth in bytes/s."""
    nvlink_bandwidth: float
    """NVLink bandwidth per GPU per direction, bytes/s."""
    internode_bandwidth: float
    """Inter-node network bandwidth per GPU per direction, bytes/s (one NIC per GPU)."""
    fragmentation: float = 0.05
    """Allocator overhead: reserved bytes exceed live tensor bytes by this fraction."""
    host_link_bandwidth: float = 50e9
    """Bytes per second one GPU moves to or from pinned host memory (activation offloading): PCIe Gen5 x16
    (64 GB/s each way) at the ~80% a large ``cudaMemcpyAsync`` reaches; the H100, H200 and B200 of the
    table all attach over it."""
    num_sms: int = 132
    """Streaming multiprocessors (GEMM output tiles run in waves of this many)."""
    overlap_contention: float = 0.3
    """Share of a communication's time still paid when it is overlapped with GEMMs (its kernels take SMs
    and HBM bandwidth from the GEMM they hide behind)."""
    host_sync_s: float = 30e-6
    """Cost of one host synchronization (device-to-host copy of the dropless dispatcher's split sizes):
    the GPU drains its queue and waits for the next launches."""
    ring_efficiency: float = 0.80
    """Fraction of link bandwidth reached by ring all-gather / reduce-scatter / all-reduce."""
    a2a_efficiency: float = 0.60
    """Fraction of link bandwidth reached by all-to-all."""
    hbm_efficiency: float = 0.80
    """Fraction of HBM bandwidth reached by memory-bound element-wise kernels."""
    fp8_efficiency: float = FP8_EFFICIENCY
    """Fraction of the FP8 peak that FP8 GEMMs reach, their quantization casts included (the planner's
    ``--fp8-recipe``); the counterpart of the calibrated BF16 ``compute_efficiency``, calibrated the same way
    on one published FP8 row (see the module docstring)."""
    intra_latency_s: float = 20e-6
    """Launch + synchronization latency of one collective inside the NVLink domain."""
    inter_latency_s: float = 40e-6
    """Launch + synchronization latency of one collective that crosses nodes."""

    def peak_flops(self, dtype: str = "bf16") -> float:
        """Peak dense FLOP/s for ``dtype`` (``bf16`` or ``fp8``)."""
        if dtype == "bf16":
            return self.bf16_flops
        if dtype == "fp8":
            return self.fp8_flops
        raise ValueError(f"dtype={dtype!r}: choose 'bf16' or 'fp8'")

    def link_bandwidth(self, *, crosses_node: bool, kind: str) -> float:
        """Achieved bytes/s per GPU for a collective of ``kind`` (``ring`` or ``a2a``) on the link it uses."""
        raw = self.internode_bandwidth if crosses_node else self.nvlink_bandwidth
        if kind == "ring":
            return raw * self.ring_efficiency
        if kind == "a2a":
            return raw * self.a2a_efficiency
        raise ValueError(f"kind={kind!r}: choose 'ring' or 'a2a'")

    def fits(self, nbytes: float, usable_gib: Optional[float] = None) -> bool:
        """Whether live tensors of ``nbytes`` (a memory estimate) fit, allocator overhead included:
        ``(1 + fragmentation) × nbytes ≤ usable``, ``usable`` being ``usable_gib`` GiB when given (a memory
        budget, the planner's ``--memory-gib``), else :attr:`usable_memory_gib`."""
        usable = self.usable_memory_gib if usable_gib is None else usable_gib
        return nbytes * (1 + self.fragmentation) <= usable * GIB

    def latency(self, *, crosses_node: bool) -> float:
        """Fixed cost of one collective call."""
        return self.inter_latency_s if crosses_node else self.intra_latency_s


_GPUS: Dict[str, GPUSpec] = {
    "h100": GPUSpec(
        name="h100",
        bf16_flops=989.4e12,
        fp8_flops=1978.9e12,
        memory_gb=80,
        usable_memory_gib=80e9 / GIB - OUTSIDE_ALLOCATOR_GIB,
        hbm_bandwidth=3.35e12,
        nvlink_bandwidth=450e9,
        internode_bandwidth=50e9,
    ),
    "h200": GPUSpec(
        name="h200",
        bf16_flops=989.4e12,
        fp8_flops=1978.9e12,
        memory_gb=141,
        usable_memory_gib=141e9 / GIB - OUTSIDE_ALLOCATOR_GIB,
        hbm_bandwidth=4.8e12,
        nvlink_bandwidth=450e9,
        internode_bandwidth=50e9,
    ),
    "b200": GPUSpec(
        name="b200",
        bf16_flops=2250e12,
        fp8_flops=4500e12,
        memory_gb=180,
        usable_memory_gib=180e9 / GIB - OUTSIDE_ALLOCATOR_GIB,
        hbm_bandwidth=8.0e12,
        nvlink_bandwidth=900e9,
        internode_bandwidth=50e9,
        num_sms=148,
    ),
}


def list_gpus() -> List[str]:
    """Names of the known GPU kinds."""
    return sorted(_GPUS)


def get_gpu(name: str) -> GPUSpec:
    """The :class:`GPUSpec` called ``name``; an unknown name lists the choices."""
    key = name.lower()
    if key not in _GPUS:
        raise ValueError(f"--gpu {name!r} is unknown; choose one of {', '.join(list_gpus())}")
    return _GPUS[key]


def device_gpu(name: str, total_bytes: int) -> GPUSpec:
    """The GPU kind of a CUDA device called ``name`` (``torch.cuda.get_device_properties(0).name``) with
    ``total_bytes`` of memory (its ``total_memory``): the table's kind whose short name the device name
    contains and whose ``memory_gb`` its memory matches within :data:`DEVICE_MATCH` (``NVIDIA H100 80GB
    HBM3`` -> ``h100``; an ``NVIDIA H100 NVL`` with 94 GB is not an ``h100``); any other device gets a kind
    of its own, named after it, whose usable memory is its reported memory less
    :data:`OUTSIDE_ALLOCATOR_GIB` (its other fields are the h100's)."""
    for key, spec in _GPUS.items():
        if key in name.lower() and abs(total_bytes / (spec.memory_gb * 1e9) - 1) <= DEVICE_MATCH:
            return spec
    return dataclasses.replace(
        _GPUS["h100"],
        name=name,
        memory_gb=total_bytes / 1e9,
        usable_memory_gib=total_bytes / GIB - OUTSIDE_ALLOCATOR_GIB,
    )
