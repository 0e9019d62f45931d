"""Embed folding's router and token dispatcher in another codebase, with plain torch.distributed groups.

Four ranks; every rank holds its own tokens (as attention ranks do). The expert view is ETP=2 × EP=2:
ETP groups ``[0,1] [2,3]`` (ranks sharing the same experts, F split between them), EP groups
``[0,2] [1,3]``. A toy expert ``(x·Wa ⊙ p)·Wb`` with its F dimension split over ETP stands in for the
host codebase's grouped GEMM; the script checks the layer against the same computation done densely
on one rank's own tokens with the full weights.

Run with ``torchrun --nproc-per-node 4 examples/embed_dispatcher.py`` (gloo or NCCL), or plainly with
``python examples/embed_dispatcher.py`` (spawns four local gloo processes).
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from folding.moe.config import MoEConfig  # noqa: E402
from folding.moe.dispatcher import build_dispatcher  # noqa: E402
from folding.moe.router import Router  # noqa: E402

H, F, E, TOPK, T = 32, 16, 4, 2, 10


def main():
    """Build groups, route, dispatch, run the toy experts, combine, check."""
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 4, "this example is written for 4 ranks"
    # Every rank creates every group, in the same order (torch.distributed's rule).
    etp_groups = [dist.new_group(r) for r in ([0, 1], [2, 3])]
    ep_groups = [dist.new_group(r) for r in ([0, 2], [1, 3])]
    singles = [dist.new_group([r]) for r in range(world)]
    etp_group, ep_group = etp_groups[rank // 2], ep_groups[rank % 2]
    dist.barrier()  # every rank has connected every group before any rank uses or closes one

    cfg = MoEConfig(num_experts=E, topk=TOPK, ffn_hidden_size=F)
    # No attention TP/CP here: each rank's tokens are a micro-batch of their own.
    router = Router(hidden_size=H, config=cfg, tp_cp_group=singles[rank], tp_dp_cp_group=dist.group.WORLD)
    dispatcher = build_dispatcher("alltoall", num_experts=E, topk=TOPK, ep_group=ep_group, etp_group=etp_group)

    g = torch.Generator().manual_seed(0)  # the same full toy weights on every rank
    Wa, Wb = torch.randn(E, H, F, generator=g) / 4, torch.randn(E, F, H, generator=g) / 4
    Fl, j = F // dispatcher.etp_size, dispatcher.etp_rank
    off = dispatcher.local_expert_offset

    x = torch.randn(T, H, generator=torch.Generator().manual_seed(100 + rank))
    probs_TE, routing_map_TE = router(x)
    tokens, record, probs = dispatcher.dispatch(x, routing_map_TE, probs_TE)
    outs, start = [], 0
    for l, n in enumerate(record.tokens_per_expert_host):  # the host codebase's experts go here
        rows = tokens[start : start + n]
        e = off + l
        outs.append(
            (rows @ Wa[e, :, j * Fl : (j + 1) * Fl] * probs[start : start + n, None]) @ Wb[e, j * Fl : (j + 1) * Fl]
        )
        start += n
    y = dispatcher.combine(torch.cat(outs), record)

    dense = sum(((x @ Wa[e]) * probs_TE[:, e : e + 1]) @ Wb[e] for e in range(E))
    torch.testing.assert_close(y, dense)
    print(f"rank {rank}: {T} tokens, rows per local expert {list(record.tokens_per_expert_host)}, output matches")
    dist.barrier()  # no rank closes its connections while a peer still uses them


def _spawned(rank, world, init_file):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        main()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    if "RANK" in os.environ:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        main()
        dist.destroy_process_group()
    else:
        import tempfile

        path = os.path.join(tempfile.mkdtemp(), "rendezvous")
        mp.spawn(_spawned, args=(4, path), nprocs=4)
