"""Contiguous parameter and main-gradient buffers, cut into buckets, one buffer per class.

A :class:`GradBuffer` holds every parameter of one :class:`~folding.optim.param_groups.ParamClass`
on this rank: their data live in one flat ``param_data`` tensor (parameters become views of it) and
their gradients accumulate in one flat ``main_grad`` tensor (fp32, or bf16 with
``optim.main_grads_dtype=bf16``) (``param.main_grad`` is the view).
The buffer is cut into :class:`Bucket` s at parameter boundaries, each about ``bucket_size`` elements
and padded to a multiple of the data-parallel size ``D`` so that it splits into ``D`` equal shards:
rank ``r`` of the data-parallel group owns elements ``[start + r*n/D, start + (r+1)*n/D)`` of every
bucket (its optimizer shard under ZeRO-1, its share of the grad norm in both modes).

Reduction of one bucket (``sum`` everywhere; docs/optimizer.md, "The loss contract"):

1. ``pre_groups`` — all-reduce over TP (ETP for experts) for sequence-parallel parameters, then over
   the embedding group for tied embeddings;
2. the data-parallel group — DP×CP for dense, EDP for experts — all-reduce, or with the distributed
   optimizer reduce-scatter (only this rank's shard is then valid).

Usage::

    buf = GradBuffer(cls, named_params, groups=BufferGroups.for_class(cls, ps), shard=True,
                     bucket_size=40_000_000)
    buf.buckets[0].shard_range()
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..moe.replicas.fetch import gets_grad_after_backward
from .param_groups import ParamClass


@dataclasses.dataclass
class BufferGroups:
    """The process groups one buffer's gradients reduce over, and this rank's norm ownership."""

    pre_groups: List[dist.ProcessGroup]
    """Groups all-reduced (sum) before the data-parallel reduction (TP / ETP, embedding)."""
    dp_group: Optional[dist.ProcessGroup]
    """Data-parallel group: DP×CP for dense, EDP for experts."""
    dp_size: int
    """Size of ``dp_group``."""
    dp_rank: int
    """This rank's index in ``dp_group``."""
    counts_in_norm: bool
    """Whether this rank's copy counts in the global grad norm (TP rank 0 for TP-replicated
    parameters, the first stage for tied embeddings); data-parallel replicas are split by shard."""
    tp_group: Optional[dist.ProcessGroup] = None
    """The view's tensor-parallel group (TP dense, ETP expert): Muon gathers a sharded matrix over it."""
    tp_size: int = 1
    """Size of ``tp_group``."""

    @staticmethod
    def for_class(cls: ParamClass, ps) -> "BufferGroups":
        """Groups of ``cls`` from a :class:`~folding.parallel.state.ParallelState` ``ps``."""
        pre = []
        if cls.sequence_parallel:
            g, n = (ps.groups.etp, ps.coords.etp.size) if cls.expert else (ps.groups.tp, ps.coords.tp.size)
            if n > 1:
                pre.append(g)
        if cls.embedding_tied and ps.groups.embedding is not None and ps.coords.embedding.size > 1:
            pre.append(ps.groups.embedding)
        if cls.expert:
            dp, size, rank = ps.groups.edp, ps.coords.edp.size, ps.coords.edp.rank
            tp_rank = ps.coords.etp.rank
        else:
            dp, size, rank = ps.groups.dp_cp, ps.coords.dp_cp.size, ps.coords.dp_cp.rank
            tp_rank = ps.coords.tp.rank
        counts = (cls.tp_sharded or tp_rank == 0) and (not cls.embedding_tied or ps.is_first_stage)
        tp_group, tp_size = (ps.groups.etp, ps.coords.etp.size) if cls.expert else (ps.groups.tp, ps.coords.tp.size)
        return BufferGroups(
            pre_groups=pre,
            dp_group=dp,
            dp_size=size,
            dp_rank=rank,
            counts_in_norm=counts,
            tp_group=tp_group,
            tp_size=tp_size,
        )


@dataclasses.dataclass
class Bucket:
    """A contiguous, padded range ``[start, end)`` of a buffer: the unit of reduction."""

    index: int
    """Position in the buffer."""
    start: int
    """First element (inclusive)."""
    end: int
    """Last element (exclusive); ``end - start`` is a multiple of the data-parallel size."""
    params: List[torch.nn.Parameter]
    """Parameters whose data lie in this range."""
    order_key: int
    """Launch order across all buckets of all buffers (smaller launches first)."""
    deferred: bool = False
    """Reduced only at the end of backward (tied embeddings: their group spans pipeline stages; the
    experts of MoE layers with replicas, whose replicas' gradients arrive after the schedule)."""
    ready: set = dataclasses.field(default_factory=set)
    """ids of parameters whose last-micro-batch gradient has arrived."""
    launched: bool = False
    """Its reduction has started."""
    pending: Optional[Tuple] = None
    """In-flight (work handle, output, op index) of its first reduction op."""

    def numel(self) -> int:
        """Padded number of elements."""
        return self.end - self.start


class GradBuffer:
    """Flat parameter storage and main gradients for one parameter class (see module docstring)."""

    def __init__(
        self,
        cls: ParamClass,
        named_params: Sequence[Tuple[str, torch.nn.Parameter, int]],
        *,
        groups: BufferGroups,
        shard: bool,
        bucket_size: int,
        grad_dtype: torch.dtype = torch.float32,
    ):
        """``named_params``: (name, parameter, registration index), in any order; parameters are laid
        out in reverse registration order (roughly the order backward produces their gradients);
        ``grad_dtype``: dtype of ``main_grad`` (``optim.main_grads_dtype``: fp32 or bf16)."""
        self.cls = cls
        self.groups = groups
        self.shard = shard
        entries = sorted(named_params, key=lambda e: -e[2])
        d = groups.dp_size
        self.names: List[str] = []
        self.params: List[torch.nn.Parameter] = []
        self.offsets: List[int] = []
        self.buckets: List[Bucket] = []
        pos, bstart, bparams, bkey = 0, 0, [], None
        for name, p, idx in entries:
            self.names.append(name)
            self.params.append(p)
            self.offsets.append(pos)
            pos += p.numel()
            bparams.append(p)
            bkey = idx if bkey is None else bkey
            if pos - bstart >= bucket_size:
                pos = bstart + -(-(pos - bstart) // d) * d
                self.buckets.append(Bucket(len(self.buckets), bstart, pos, bparams, -bkey))
                bstart, bparams, bkey = pos, [], None
        if bparams:
            pos = bstart + -(-(pos - bstart) // d) * d
            self.buckets.append(Bucket(len(self.buckets), bstart, pos, bparams, -bkey))
        self.numel = pos
        dtype = self.params[0].dtype
        device = self.params[0].device
        elsewhere = sorted({str(q.device) for q in self.params} - {str(device)})
        if elsewhere:  # one flat buffer per group: a parameter left behind would be copied every step
            raise ValueError(
                f"gradient buffer: parameters on {device} and on {elsewhere}; build the model "
                f"on one device (every builder takes device=)"
            )
        self.param_data = torch.zeros(self.numel, dtype=dtype, device=device)
        self.main_grad = torch.zeros(self.numel, dtype=grad_dtype, device=device)
        self.bucket_of = {}
        for b in self.buckets:
            b.deferred = cls.embedding_tied or any(gets_grad_after_backward(p) for p in b.params)
            for p in b.params:
                self.bucket_of[id(p)] = b
        for p, off in zip(self.params, self.offsets):
            n = p.numel()
            self.param_data[off : off + n].copy_(p.detach().reshape(-1))
            p.data = self.param_data[off : off + n].view(p.shape)
            p.main_grad = self.main_grad[off : off + n].view(p.shape)

    def shard_range(self, bucket: Bucket) -> Tuple[int, int]:
        """This rank's ``[lo, hi)`` of ``bucket`` in buffer coordinates (its optimizer/norm share)."""
        n = bucket.numel() // self.groups.dp_size
        lo = bucket.start + self.groups.dp_rank * n
        return lo, lo + n

    def update_range(self, bucket: Bucket) -> Tuple[int, int]:
        """The range this rank's optimizer updates: its shard under ZeRO-1, else the whole bucket."""
        return self.shard_range(bucket) if self.shard else (bucket.start, bucket.end)

    def param_bytes(self) -> int:
        """Bytes of the parameter storage (padding included)."""
        return self.param_data.numel() * self.param_data.element_size()

    def grad_bytes(self) -> int:
        """Bytes of the main-gradient storage (padding included)."""
        return self.main_grad.numel() * self.main_grad.element_size()
