"""The one optimizer object a trainer uses: folded gradient reduction, clipping, AdamW or Muon, ZeRO-1.

:class:`FoldedOptimizer` owns the gradient buffers of a model (one per
:class:`~folding.optim.param_groups.ParamClass`), their reduction (:mod:`folding.optim.reducer`), the
global grad norm (:mod:`folding.optim.clip`), AdamW on flat bucket shards (:mod:`folding.optim.adamw`:
PyTorch's fused kernel, one pass per bucket, when every state is fp32; an elementwise fp32 pass that
stores each state back in its dtype otherwise), and the LR schedule (:mod:`folding.optim.schedules`).

- Gradients are *summed* over DP×CP (dense) and EDP (experts), plus TP for sequence-parallel and
  the embedding group for tied parameters: each rank's loss must be its masked loss sum divided by
  the *global* number of unmasked tokens (docs/optimizer.md, "The loss contract").
- Parameters of any dtype; gradients accumulate in ``optim.main_grads_dtype`` (fp32 by default); for
  bf16 parameters the optimizer keeps fp32 master weights, or with ``optim.main_params_dtype=bf16``
  updates the parameter itself with stochastic rounding (fp32 parameters are their own master).
  The moments are stored in ``optim.exp_avg_dtype`` / ``optim.exp_avg_sq_dtype``
  (:mod:`folding.optim.precision`: fp32, bf16, or fp8 with a scale per 128 elements).
- ``optim.name=muon``: the hidden weight matrices (:func:`~folding.optim.param_groups.uses_muon`) get
  their own buffers and a :class:`~folding.optim.muon_state.MuonState` (momentum, Newton–Schulz on the
  full matrix, ZeRO-1 ownership); this class only dispatches each buffer to AdamW or Muon and applies
  the weight update to the range it owns, with the same LR schedule, clipping and master weights.
- ``distributed=True`` (ZeRO-1): gradients reduce-scatter, each rank keeps AdamW moments and master
  weights for its 1/D shard of every bucket (D = DP×CP dense, EDP expert), updates it, and
  all-gathers the parameters. AdamW is elementwise, so the update equals the non-distributed one up
  to the summation order of the reduction.

Build it after the model is on its device and in its final dtype (parameters become views of the
optimizer's flat buffers).

Usage::

    opt = FoldedOptimizer(model, cfg, parallel_state=ps, train_steps=1000)
    opt.zero_grad()
    for i, mb in enumerate(micro_batches):
        with opt.no_sync() if i < len(micro_batches) - 1 else contextlib.nullcontext():
            (loss_sum(mb) / global_token_count).backward()
    grad_norm, skipped = opt.clip_and_step()
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Dict, List, Optional, Tuple

import torch

from .adamw import adamw_fused, adamw_shard, fusable
from .clip import clip_coefficient, global_grad_norm
from .config import OptimConfig
from .grad_buffer import BufferGroups, GradBuffer
from .muon import apply_update
from .muon_state import MuonState
from .param_groups import classify, uses_muon
from .precision import TORCH_DTYPES, StateShard
from .reducer import GradReducer, all_gather_flat
from .schedules import lr_at

MOMENTS = ("exp_avg", "exp_avg_sq")
"""The AdamW moment keys of the state and of :meth:`FoldedOptimizer.param_state`."""
MUON_KEYS = ("momentum",)
"""The Muon state keys of :meth:`FoldedOptimizer.param_state` (fp32, parameter-shaped)."""


class FoldedOptimizer:
    """AdamW (or Muon) with folded gradient reduction, global-norm clipping, LR schedule and optional ZeRO-1."""

    def __init__(
        self, model: torch.nn.Module, config: OptimConfig, *, parallel_state, train_steps: Optional[int] = None
    ):
        """``parallel_state``: the :class:`~folding.parallel.state.ParallelState` whose groups reduce
        the gradients; ``train_steps``: the LR horizon when ``config.decay_steps`` is ``None``."""
        config.validate(train_steps=train_steps)
        if config.decay_style != "constant":
            config.horizon(train_steps)  # fails early when no horizon is known
        self.config = config
        self.ps = parallel_state
        self.train_steps = train_steps
        self.step_count = 0
        self.updates = 0
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("FoldedOptimizer: the model has no trainable parameters")
        by_class = defaultdict(list)
        for idx, (name, p) in enumerate(named):
            muon = config.name == "muon" and uses_muon(name, p)
            by_class[classify(name, p, muon=muon)].append((name, p, idx))
        self.buffers: List[GradBuffer] = []
        for cls in sorted(by_class):
            groups = BufferGroups.for_class(cls, parallel_state)
            self.buffers.append(
                GradBuffer(
                    cls,
                    by_class[cls],
                    groups=groups,
                    shard=config.distributed,
                    bucket_size=config.bucket_size,
                    grad_dtype=TORCH_DTYPES[config.main_grads_dtype],
                )
            )
        self.reducer = GradReducer(self.buffers, overlap=config.overlap_grad_reduce)
        self.state = [self._init_state(buf) for buf in self.buffers]

    # ------------------------------------------------------------------------------ state
    def has_master_copy(self, buf: GradBuffer) -> bool:
        """Whether ``buf``'s parameters have a separate fp32 master copy (16-bit parameters with
        ``optim.main_params_dtype=fp32``); otherwise the parameter storage is what AdamW updates."""
        return buf.param_data.dtype != torch.float32 and self.config.main_params_dtype == "fp32"

    def _init_state(self, buf: GradBuffer) -> Dict[str, List[StateShard]]:
        c = self.config
        dev = buf.main_grad.device
        st = {"master": []}
        if buf.cls.muon:
            st["muon"] = MuonState(buf, c)
        else:
            st.update(exp_avg=[], exp_avg_sq=[])
        for b in buf.buckets:
            lo, hi = buf.update_range(b)
            if not buf.cls.muon:
                st["exp_avg"].append(StateShard(hi - lo, c.exp_avg_dtype, dev))
                st["exp_avg_sq"].append(StateShard(hi - lo, c.exp_avg_sq_dtype, dev, sqrt_domain=True))
            if self.has_master_copy(buf):
                master = StateShard(hi - lo, "fp32", dev)
                master.write(buf.param_data[lo:hi].float())
            elif buf.param_data.dtype == torch.bfloat16:  # main_params_dtype=bf16: the parameter itself
                master = StateShard(hi - lo, "bf16", dev, stochastic=True, storage=buf.param_data[lo:hi])
            elif buf.param_data.dtype == torch.float32:  # the parameter is its own master
                master = StateShard(hi - lo, "fp32", dev, storage=buf.param_data[lo:hi])
            else:
                raise ValueError(
                    f"parameters in {buf.param_data.dtype} need optim.main_params_dtype=fp32 (an fp32 "
                    f"master copy); bf16 master weights are for bf16 parameters"
                )
            st["master"].append(master)
        return st

    @staticmethod
    def moment_keys(buf: GradBuffer) -> Tuple[str, ...]:
        """The state keys (besides ``master``) of ``buf``'s parameters: :data:`MOMENTS` for AdamW,
        :data:`MUON_KEYS` for Muon buffers."""
        return MUON_KEYS if buf.cls.muon else MOMENTS

    def _rounding_generator(self, device, buffer_index: int, bucket_index: int) -> torch.Generator:
        """The generator of one bucket shard's stochastic rounding this step: seeded from the update
        count, the bucket and the data-parallel rank, so a resumed run draws the same bits."""
        buf = self.buffers[buffer_index]
        gen = torch.Generator(device=device)
        key = (self.updates * 1_000_003 + buffer_index * 10_007 + bucket_index) * 4099 + buf.groups.dp_rank
        gen.manual_seed(key % (2**63 - 1))
        return gen

    # ------------------------------------------------------------------------------ gradients
    def zero_grad(self) -> None:
        """Zero every main gradient and forget the previous step's reduction."""
        self.reducer.reset()
        for buf in self.buffers:
            buf.main_grad.zero_()
            for p in buf.params:
                p.grad = None

    def no_sync(self):
        """Context for every micro-batch but the last: backward accumulates without reducing."""
        return self.reducer.no_sync()

    def reduce_gradients(self) -> None:
        """Finish the reduction of every bucket (idempotent; ``clip_and_step`` calls it)."""
        if not self.reducer.done:
            self.reducer.finish()

    def grad_norm(self) -> float:
        """Global L2 norm of the reduced gradient (every parameter counted once; collective)."""
        self.reduce_gradients()
        return global_grad_norm(self.buffers)

    # ------------------------------------------------------------------------------ step
    @property
    def lr(self) -> float:
        """The learning rate the next step uses (``lr_at(step_count)``)."""
        return lr_at(self.step_count, self.config, train_steps=self.train_steps)

    def clip_and_step(self) -> Tuple[float, bool]:
        """Reduce, clip to ``optim.clip_grad`` and apply one AdamW (Muon, per buffer) step.

        Returns ``(grad_norm, skipped)``: the pre-clip global norm, and True when it is NaN/Inf (then
        no parameter or state changes and neither ``step_count`` nor ``updates`` advances; a trainer that
        skips the step advances ``step_count`` alone, so that the LR schedule moves on while AdamW's bias
        correction, which counts ``updates``, sees only the updates applied). Collective on all ranks.
        """
        norm = self.grad_norm()
        if not math.isfinite(norm):
            return norm, True
        coef = clip_coefficient(norm, self.config.clip_grad)
        lr = self.lr
        self.step_count += 1
        self.updates += 1
        c = self.config
        works = []
        steps_t: Dict[torch.device, torch.Tensor] = {}  # the update count, one per device
        for j, (buf, st) in enumerate(zip(self.buffers, self.state)):
            wd = c.weight_decay if buf.cls.decay else 0.0
            for i, b in enumerate(buf.buckets):
                lo, hi = buf.update_range(b)
                g = buf.main_grad[lo:hi]
                if coef != 1.0:
                    g.mul_(coef)
                if buf.cls.muon:  # Muon: collective over DP (ZeRO-1) and TP; the update of [lo, hi)
                    w = st["master"][i]
                    gen = self._rounding_generator(w.data.device, j, i) if w.stochastic else None
                    w32 = w.read()
                    apply_update(w32, st["muon"].step_bucket(b), lr=lr, weight_decay=wd)
                    w.write(w32, gen)
                    self._publish(buf, b, w.data, works)
                    continue
                m, v, w = st["exp_avg"][i], st["exp_avg_sq"][i], st["master"][i]
                hyper = dict(lr=lr, beta1=c.beta1, beta2=c.beta2, eps=c.eps, weight_decay=wd)
                if fusable(w, g, m, v):
                    # one pass, no temporaries: PyTorch's fused AdamW kernel on the flat shard
                    dev = w.data.device
                    if dev not in steps_t:
                        steps_t[dev] = torch.tensor(float(self.updates), device=dev)
                    adamw_fused(w, g, m, v, step_t=steps_t[dev], **hyper)
                else:
                    gen = self._rounding_generator(w.data.device, j, i) if w.stochastic else None
                    adamw_shard(w, g, m, v, step=self.updates, generator=gen, **hyper)
                self._publish(buf, b, w.data, works)
        for w in works:
            w.wait()
        return norm, False

    @staticmethod
    def _publish(buf: GradBuffer, b, w: torch.Tensor, works: List) -> None:
        """Copy the updated weights ``w`` of ``update_range(b)`` into the parameters; under ZeRO-1
        start the all-gather (forward only) of every shard of the bucket over the DP group."""
        lo, hi = buf.update_range(b)
        if w.data_ptr() != buf.param_data[lo:hi].data_ptr():
            buf.param_data[lo:hi].copy_(w)
        if buf.shard and buf.groups.dp_size > 1:
            # in place: this rank's shard is its own slot of the bucket (no staging copy)
            works.append(all_gather_flat(buf.param_data[b.start : b.end], buf.param_data[lo:hi], buf.groups.dp_group))

    # ------------------------------------------------------------------------------ checkpoints
    def param_state(self) -> Dict[str, Dict[str, torch.Tensor]]:
        """Every parameter's AdamW state in the parameter's own shape: ``name -> {"exp_avg",
        "exp_avg_sq"[, "master"]}``, copies in the states' storage dtype (fp32 or bf16; fp8 states
        dequantized to fp32, exactly); ``master`` only where a separate fp32 master copy exists
        (16-bit parameters with ``optim.main_params_dtype=fp32``).

        Under ZeRO-1 (``distributed=True``) each bucket's state is reassembled first: an all-gather
        of the equal per-rank shards over the buffer's DP group (DP×CP dense, EDP expert); forward
        only, no backward. Collective on every rank of those groups; without ZeRO-1 no communication.
        """
        out: Dict[str, Dict[str, torch.Tensor]] = {}
        for buf, st in zip(self.buffers, self.state):
            keys = list(self.moment_keys(buf)) + (["master"] if self.has_master_copy(buf) else [])
            for b in buf.buckets:
                lo, hi = buf.update_range(b)
                whole = {}
                for key in keys:
                    if key == "momentum":  # Muon: assembled from the owners (collective under ZeRO-1)
                        whole[key] = st["muon"].bucket_momentum(b)
                        continue
                    shard = st[key][b.index]
                    if (lo, hi) == (b.start, b.end):
                        whole[key] = shard.saved()
                    else:
                        t = torch.empty(b.end - b.start, dtype=shard.saved_dtype(), device=buf.main_grad.device)
                        all_gather_flat(t, shard.saved(), buf.groups.dp_group).wait()
                        whole[key] = t
                for k, p in enumerate(buf.params):
                    if buf.bucket_of[id(p)] is not b:
                        continue
                    a = buf.offsets[k] - b.start
                    out[buf.names[k]] = {key: whole[key][a : a + p.numel()].reshape(p.shape).clone() for key in keys}
        return out

    def state_dtypes(self) -> Dict[str, torch.dtype]:
        """The torch dtype :meth:`param_state` gives each key (what a checkpoint load should read into)."""
        out = {"momentum": torch.float32, "master": torch.float32}
        for shard in self.state:
            if "exp_avg" in shard:
                out.update({key: shard[key][0].saved_dtype() for key in MOMENTS})
        return out

    @torch.no_grad()
    def load_param_state(
        self, states: Dict[str, Dict[str, torch.Tensor]], *, step: int, updates: Optional[int] = None
    ) -> None:
        """Restore state exported by :meth:`param_state` (possibly saved under another layout,
        ``distributed`` setting or state dtypes, once resliced to this rank's parameter shapes): each
        rank keeps the part of every parameter it updates (its ZeRO-1 shard, or all of it), converted
        to this optimizer's state dtypes (exact when they match). ``master`` entries, when present and
        this optimizer keeps an fp32 master copy, overwrite it and the parameters' owned range; when
        absent, masters are taken from the current parameter values; with bf16 master weights the
        parameter is the master and ``master`` entries are ignored. ``step`` becomes ``step_count``
        (the LR schedule position) and ``updates`` (default: ``step``) the AdamW updates applied (the
        bias-correction step). No communication."""
        for buf in self.buffers:
            for name, p in zip(buf.names, buf.params):
                if name not in states:
                    raise KeyError(f"optimizer state has no entry for parameter {name!r}")
                missing = [key for key in self.moment_keys(buf) if key not in states[name]]
                if missing:
                    raise KeyError(
                        f"optimizer state of {name!r} lacks {missing}: it was saved by another optimizer "
                        f"(optim.name); resume with the optim.name that saved it"
                    )
                for key, t in states[name].items():
                    if t.numel() != p.numel():
                        raise ValueError(
                            f"optimizer state {key} of {name!r} has {t.numel()} elements, the parameter {p.numel()}"
                        )
        for buf, st in zip(self.buffers, self.state):
            copy = self.has_master_copy(buf)
            for k, name in enumerate(buf.names) if buf.cls.muon else ():  # the owned matrices' momentum
                st["muon"].load_momentum(k, states[name]["momentum"])
            for b in buf.buckets:
                lo, hi = buf.update_range(b)
                moments = () if buf.cls.muon else MOMENTS
                keys = list(moments) + (["master"] if copy else [])
                vals = {key: st[key][b.index].read().clone() for key in keys}
                for k, (name, p) in enumerate(zip(buf.names, buf.params)):
                    if buf.bucket_of[id(p)] is not b:
                        continue
                    off, n = buf.offsets[k], p.numel()
                    a, z = max(lo, off), min(hi, off + n)
                    if z <= a:
                        continue
                    saved = states[name]
                    for key in moments:
                        vals[key][a - lo : z - lo].copy_(saved[key].reshape(-1)[a - off : z - off])
                    if copy:
                        src = (
                            saved["master"].reshape(-1)[a - off : z - off] if "master" in saved else buf.param_data[a:z]
                        )
                        vals["master"][a - lo : z - lo].copy_(src)
                for key in keys:
                    st[key][b.index].write(vals[key])
                if copy:
                    buf.param_data[lo:hi].copy_(vals["master"])
        self.step_count = int(step)
        self.updates = int(step if updates is None else updates)

    # ------------------------------------------------------------------------------ memory
    def memory_bytes(self) -> Dict[str, int]:
        """Bytes this rank holds: ``params`` (model parameters), ``grads`` (main grads) and
        ``optimizer`` (moments, fp8 scales included, plus separate master weights), each split into
        dense and expert."""
        out = {
            k: 0
            for k in (
                "params_dense",
                "params_expert",
                "grads_dense",
                "grads_expert",
                "optimizer_dense",
                "optimizer_expert",
            )
        }
        for buf, st in zip(self.buffers, self.state):
            kind = "expert" if buf.cls.expert else "dense"
            out[f"params_{kind}"] += buf.param_bytes()
            out[f"grads_{kind}"] += buf.grad_bytes()
            if buf.cls.muon:
                out[f"optimizer_{kind}"] += st["muon"].nbytes()
            for key in () if buf.cls.muon else MOMENTS:
                out[f"optimizer_{kind}"] += sum(t.nbytes() for t in st[key])
            if self.has_master_copy(buf):
                out[f"optimizer_{kind}"] += sum(t.nbytes() for t in st["master"])
        return out
