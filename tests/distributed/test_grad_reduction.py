"""Folded gradient reduction and grad norm on 8 gloo ranks against the 1-rank run.

A small hand-made model with every parameter kind of a folded MoE transformer (vocab-parallel
embedding, optionally tied to the output layer; sequence-parallel norms, router and bias; column-
and row-parallel dense linears; experts sharded over EP and ETP with a [gate; up] fc1) runs one
global batch of 16 micro-batches with a loss mask that leaves uneven token counts per rank. Every
layout's reduced gradients (non-distributed optimizer: the whole main grad is valid) and global grad
norm must equal the 1-rank ones computed in this process with plain autograd.

The model and its slicing helpers are reused by ``test_optimizer_step.py``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from folding.parallel import ParallelLayout, build_parallel_state
from folding.parallel import collectives as C
from folding.parallel.params import mark_param
from tests import reference_collectives as R

# Legend: T tokens of a rank, H hidden, E experts, V vocab, K top-k, S sequence.
V, H, FF, E, FE, K, S, MICRO = 16, 8, 8, 8, 4, 2, 8, 16

TAGS = {
    "emb": dict(tp_sharded=True),
    "norm1": dict(sequence_parallel=True),
    "w1": dict(tp_sharded=True),
    "b1": dict(tp_sharded=True),
    "w2": dict(tp_sharded=True),
    "b2": dict(sequence_parallel=True),
    "norm2": dict(sequence_parallel=True),
    "router": dict(sequence_parallel=True),
    "expert_w1": dict(expert=True, tp_sharded=True),
    "expert_w2": dict(expert=True, tp_sharded=True),
    "final_norm": dict(sequence_parallel=True),
    "head": dict(tp_sharded=True),
}
TP_DIM = {"emb": 0, "w1": 0, "b1": 0, "w2": 1, "expert_w1": 2, "expert_w2": 1, "head": 0}  # dim sharded over (E)TP
NO_DECAY = {"norm1", "b1", "b2", "norm2", "final_norm"}


def global_params(seed: int = 0, tied: bool = False):
    """The full (1-rank) parameters, identical in every layout."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g) * 0.5  # noqa: E731
    p = {
        "emb": r(V, H),
        "norm1": 1 + 0.1 * r(H),
        "w1": r(FF, H),
        "b1": 0.1 * r(FF),
        "w2": r(H, FF),
        "b2": 0.1 * r(H),
        "norm2": 1 + 0.1 * r(H),
        "router": r(E, H),
        "expert_w1": r(E, H, 2 * FE),
        "expert_w2": r(E, FE, H),
        "final_norm": 1 + 0.1 * r(H),
    }
    if not tied:
        p["head"] = r(V, H)
    return p


def global_batch(seed: int = 1):
    """ids, targets, loss mask: [MICRO, S] each; the mask zeroes padding / end-of-document tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (MICRO, S), generator=g)
    tgt = torch.randint(0, V, (MICRO, S), generator=g)
    mask = (torch.rand(MICRO, S, generator=g) > 0.35).float()
    mask[3] = 0.0  # one fully padded micro-batch
    mask[5, S // 2 :] = 0.0  # a document ending mid-sequence
    return ids, tgt, mask


class Coords:
    """Sizes/ranks/groups of one rank; all groups ``None`` and sizes 1 for the 1-rank reference."""

    def __init__(self, ps=None):
        self.ps = ps
        if ps is None:
            self.tp = self.cp = self.dp = self.ep = self.etp = 1
            self.tp_rank = self.cp_rank = self.dp_rank = self.ep_rank = self.etp_rank = 0
            self.tp_group = self.ep_group = self.etp_group = None
        else:
            L = ps.layout
            self.tp, self.cp, self.dp, self.ep, self.etp = L.tp, L.cp, L.dp, L.ep, L.etp
            self.tp_rank, self.cp_rank, self.dp_rank = ps.coords.tp.rank, ps.coords.cp.rank, ps.coords.dp.rank
            self.ep_rank, self.etp_rank = ps.coords.ep.rank, ps.coords.etp.rank
            self.tp_group, self.ep_group, self.etp_group = ps.groups.tp, ps.groups.ep, ps.groups.etp

    def coll(self, fn, x, group, *a, **k):
        return x if self.ps is None else fn(x, group, *a, **k)


def shard(name: str, full: torch.Tensor, c: Coords) -> torch.Tensor:
    """This rank's slice of a global parameter."""
    t = TAGS[name]
    if t.get("expert"):
        el = E // c.ep
        full = full[c.ep_rank * el : (c.ep_rank + 1) * el]
        if name == "expert_w1":  # shard gate and up halves separately
            gate, up = full.chunk(2, dim=2)
            return torch.cat([gate.chunk(c.etp, 2)[c.etp_rank], up.chunk(c.etp, 2)[c.etp_rank]], 2)
        return full.chunk(c.etp, dim=TP_DIM[name])[c.etp_rank]
    if t.get("tp_sharded"):
        return full.chunk(c.tp, dim=TP_DIM[name])[c.tp_rank]
    return full


class TinyFolded(torch.nn.Module):
    """One dense-MLP + MoE block with a vocab-parallel embedding and output layer."""

    def __init__(self, full, c: Coords, tied: bool, dtype=torch.float32):
        super().__init__()
        self.c, self.tied = c, tied
        for name, t in full.items():
            tags = dict(TAGS[name])
            if tied and name == "emb":
                tags["embedding_tied"] = True
            p = torch.nn.Parameter(shard(name, t, c).clone().to(dtype))
            setattr(self, name, mark_param(p, **tags))

    @staticmethod
    def _rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w

    def forward(self, ids_S, tgt_S, mask_S):
        """Masked loss SUM of this rank's chunk of one micro-batch (same value on every TP rank)."""
        c = self.c
        sc = S // c.cp
        ids_c = ids_S[c.cp_rank * sc : (c.cp_rank + 1) * sc]
        tgt_c, mask_c = (t[c.cp_rank * sc : (c.cp_rank + 1) * sc] for t in (tgt_S, mask_S))
        vl = V // c.tp
        local = ids_c - c.tp_rank * vl
        inside = (local >= 0) & (local < vl)
        x_TH = self.emb[local.clamp(0, vl - 1)] * inside[:, None]
        h_TH = c.coll(C.reduce_scatter_to_sequence_region, x_TH, c.tp_group)
        a_TH = c.coll(C.gather_from_sequence_region, self._rms(h_TH, self.norm1), c.tp_group)
        u = torch.tanh(a_TH @ self.w1.t() + self.b1)
        y_TH = c.coll(C.reduce_scatter_to_sequence_region, u @ self.w2.t(), c.tp_group)
        h_TH = h_TH + y_TH + self.b2
        h_TH = h_TH + self._moe(self._rms(h_TH, self.norm2))
        f_TH = c.coll(C.gather_from_sequence_region, self._rms(h_TH, self.final_norm), c.tp_group)
        head = self.emb if self.tied else self.head
        logits_TV = c.coll(R.gather_from_region, f_TH @ head.t(), c.tp_group)
        ce = F.cross_entropy(logits_TV.float(), tgt_c, reduction="none")
        return (ce * mask_c).sum()

    def _moe(self, a_TH):
        c = self.c
        logits_TE = a_TH @ self.router.t()
        top_val_TK, top_idx_TK = logits_TE.topk(K, dim=-1)
        probs_TE = torch.zeros_like(logits_TE).scatter(1, top_idx_TK, torch.softmax(top_val_TK, -1))
        if c.ps is None:
            all_TH, all_TE = a_TH, probs_TE
        else:  # the ETP x EP domain: gather over ETP, then EP
            all_TH, sizes = R.domain_gather_v(a_TH, c.etp_group, c.ep_group)
            all_TE, _ = R.domain_gather_v(probs_TE, c.etp_group, c.ep_group)
        el = E // c.ep
        out_TH = torch.zeros_like(all_TH)
        for j in range(el):
            gate_HF, up_HF = self.expert_w1[j].chunk(2, dim=-1)
            act = F.silu(all_TH @ gate_HF) * (all_TH @ up_HF) * all_TE[:, c.ep_rank * el + j, None]
            out_TH = out_TH + act @ self.expert_w2[j]
        return out_TH if c.ps is None else R.domain_reduce_scatter_v(out_TH, c.etp_group, c.ep_group, sizes)


def local_micro_batches(c: Coords):
    """Indices of the micro-batches this rank's DP coordinate processes (contiguous blocks)."""
    per = MICRO // c.dp
    return range(c.dp_rank * per, (c.dp_rank + 1) * per)


def reference_grads(tied: bool, seed: int = 0):
    """1-rank gradients of the global-batch loss and their L2 norm."""
    full = global_params(seed, tied)
    model = TinyFolded(full, Coords(None), tied)
    ids, tgt, mask = global_batch()
    n = mask.sum()
    for m in range(MICRO):
        (model(ids[m], tgt[m], mask[m]) / n).backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads.values())).item()
    return grads, norm


def _grads_on_rank(cases):
    from folding.optim import FoldedOptimizer, OptimConfig

    out = []
    for layout_kwargs, tied, overlap, bucket in cases:
        ps = build_parallel_state(ParallelLayout(world_size=dist.get_world_size(), **layout_kwargs))
        try:
            c = Coords(ps)
            model = TinyFolded(global_params(0, tied), c, tied)
            opt = FoldedOptimizer(
                model,
                OptimConfig(lr=1e-3, decay_style="constant", bucket_size=bucket, overlap_grad_reduce=overlap),
                parallel_state=ps,
            )
            ids, tgt, mask = global_batch()
            n = mask.sum()
            mbs = list(local_micro_batches(c))
            opt.zero_grad()
            for i, m in enumerate(mbs):
                ctx = opt.no_sync() if i < len(mbs) - 1 else _null()
                with ctx:
                    (model(ids[m], tgt[m], mask[m]) / n).backward()
            launched_in_backward = sum(b.launched for _, b in opt.reducer.order)
            opt.reduce_gradients()
            grads = {k: p.main_grad.clone() for k, p in model.named_parameters()}
            out.append(
                {
                    "grads": grads,
                    "launched_in_backward": launched_in_backward,
                    "norm": opt.grad_norm(),
                    "tp_rank": c.tp_rank,
                    "ep_rank": c.ep_rank,
                    "etp_rank": c.etp_rank,
                    "tp": c.tp,
                    "ep": c.ep,
                    "etp": c.etp,
                    "n_buckets": sum(len(b.buckets) for b in opt.buffers),
                }
            )
        finally:
            ps.destroy()
    return out


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


class _FakeCoords(Coords):
    def __init__(self, r):
        self.ps = None
        self.tp, self.ep, self.etp = r["tp"], r["ep"], r["etp"]
        self.tp_rank, self.ep_rank, self.etp_rank = r["tp_rank"], r["ep_rank"], r["etp_rank"]


GRAD_CASES = [
    # (layout with ETP written, tied embeddings, overlap from hooks, bucket size in elements)
    (dict(tp=1, cp=1, ep=1, etp=1), False, True, 64),  # DP8 EDP8
    (dict(tp=2, cp=1, ep=2, etp=2), True, True, 50),  # TP2+SP, ETP2, EDP2 != DP*CP=4
    (dict(tp=2, cp=2, ep=8, etp=1), False, True, 10**6),  # EP8 folded over TP x CP x DP, EDP1
    (dict(tp=1, cp=2, ep=4, etp=2), True, False, 32),  # CP2, ETP2, EDP1 != DP*CP=8
    (dict(tp=4, cp=1, ep=2, etp=1), False, True, 16),  # TP4, EDP4 != DP*CP=2
]


def test_reduced_grads_and_norm_match_one_rank(ranks):
    results = ranks(8).run(_grads_on_rank, GRAD_CASES)
    refs = {tied: reference_grads(tied) for tied in (False, True)}
    for case_i, (layout_kwargs, tied, overlap, _) in enumerate(GRAD_CASES):
        ref_grads, ref_norm = refs[tied]
        for rank, per_rank in enumerate(results):
            r = per_rank[case_i]
            # with overlap, buckets start during backward (all but tied ones, which wait for the end)
            assert (r["launched_in_backward"] > 0) == overlap, (layout_kwargs, r["launched_in_backward"])
            assert abs(r["norm"] - ref_norm) <= 1e-5 * ref_norm, (layout_kwargs, rank, r["norm"], ref_norm)
            fc = _FakeCoords(r)
            for name, g in r["grads"].items():
                want = shard(name, ref_grads[name], fc)
                assert g.shape == want.shape, (name, g.shape, want.shape)
                err = (g - want).abs().max().item()
                assert err <= 1e-5 * want.abs().max().item() + 1e-7, (layout_kwargs, rank, name, err)
    # some case must really have used several buckets
    assert max(r[1]["n_buckets"] for r in results) > 3


def _tied_pipeline(distributed):
    """PP2 on 4 ranks: stage 0 holds the embedding, stage 1 the tied output layer (same logical
    weight). Each rank's gradient is a known rank-dependent tensor; after reduction both stages must
    hold the sum over the embedding group and DP, and the norm must count the tied weight once."""
    from folding.optim import FoldedOptimizer, OptimConfig

    ps = build_parallel_state(ParallelLayout(world_size=dist.get_world_size(), pp=2, ep=2, etp=1))
    try:
        m = torch.nn.Module()
        m.tied = mark_param(torch.nn.Parameter(torch.zeros(4, 3)), tp_sharded=True, embedding_tied=True)
        m.norm = mark_param(torch.nn.Parameter(torch.zeros(3)), sequence_parallel=True)
        m.expert = mark_param(torch.nn.Parameter(torch.zeros(1, 2, 2)), expert=True, tp_sharded=True)
        opt = FoldedOptimizer(
            m, OptimConfig(decay_style="constant", distributed=distributed, bucket_size=5), parallel_state=ps
        )
        r = dist.get_rank()
        loss = sum(((p * _grad_of(name, r)).sum() for name, p in m.named_parameters()), torch.zeros(()))
        loss.backward()
        opt.reduce_gradients()
        grads = {k: p.main_grad.clone() for k, p in m.named_parameters()}
        norm = opt.grad_norm()
        try:  # a second backward without no_sync() would be lost: it must raise
            (m.norm * 2).sum().backward()
            late_error = ""
        except RuntimeError as e:
            late_error = str(e)
        return {
            "grads": grads,
            "norm": norm,
            "late_error": late_error,
            "dp_cp": ps.coords.dp_cp.ranks,
            "edp": ps.coords.edp.ranks,
            "emb": ps.coords.embedding.ranks,
            "stage": ps.coords.pp.rank,
            "ep_rank": ps.coords.ep.rank,
            "distributed": distributed,
        }
    finally:
        ps.destroy()


def _grad_of(name, rank):
    g = torch.Generator().manual_seed(1000 + rank)
    shape = {"tied": (4, 3), "norm": (3,), "expert": (1, 2, 2)}[name]
    return torch.randn(*shape, generator=g)


def test_tied_embedding_across_stages(ranks):
    import math

    for distributed in (False, True):
        out = ranks(4).run(_tied_pipeline, distributed)
        # expected reduced gradients, and the norm from each unique parameter once
        sq = 0.0
        by_stage_ep = {}
        for r in out:
            for name, g in r["grads"].items():
                if name == "tied":
                    members = sorted({d for e in r["emb"] for d in out[e]["dp_cp"]})
                elif name == "norm":
                    members = r["dp_cp"]
                else:
                    members = r["edp"]
                want = sum(_grad_of(name, m) for m in members)
                if not distributed:
                    assert torch.allclose(g, want, atol=1e-6), (name, r)
                key = (name, tuple(members), r["ep_rank"] if name == "expert" else r["stage"])
                by_stage_ep[key] = want
        for key, want in by_stage_ep.items():
            if key[0] != "tied" or key[2] == 0:
                sq += (want.double() ** 2).sum().item()
        for r in out:
            assert "no_sync" in r["late_error"]
            assert abs(r["norm"] - math.sqrt(sq)) <= 1e-6 * math.sqrt(sq), (distributed, r["norm"], math.sqrt(sq))
