"""Embed folding's router and token dispatcher in another codebase, with plain torch.distributed groups.

Four ranks; every rank holds its own tokens (as attention ranks do). The expert view is ETP=2 × EP=2:
ETP groups ``[0,1] [2,3]`` (ranks sharing the same experts, F split between them), EP groups
``[0,2] [1,3]``. A toy expert ``(x·Wa ⊙ p)·Wb`` with its F dimension split over ETP stands in for the
host codebase's grouped GEMM; the script checks the layer against the same computation done densely
on one rank's own tokens with the full weights.

Run with ``torchrun --nproc-per-node 4 examples/embed_dispatcher.py`` (NCCL on a node with 4 GPUs: each
rank uses the GPU of its ``LOCAL_RANK``; gloo on CPU otherwise), or plainly with
``python examples/embed_dispatcher.py`` (spawns four local gloo processes).
"""

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from folding.moe.config import MoEConfig
from folding.moe.dispatch.build import build_dispatcher
from folding.moe.routing.router import Router
from folding.parallel.groups import ProcessGroups, release_process_groups

H, F, E, TOPK, T = 32, 16, 4, 2, 10


def main(device=torch.device("cpu")):
    """Build groups, route, dispatch, run the toy experts, combine, check; every tensor on ``device``."""
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
    groups = ProcessGroups(tp_cp=singles[rank], tp_dp_cp=dist.group.WORLD)
    router = Router(hidden_size=H, config=cfg, groups=groups, device=device)
    dispatcher = build_dispatcher("alltoall", num_experts=E, topk=TOPK, ep_group=ep_group, etp_group=etp_group)

    g = torch.Generator().manual_seed(0)  # the same full toy weights on every rank
    Wa, Wb = (torch.randn(E, *shape, generator=g).to(device) / 4 for shape in ((H, F), (F, H)))
    Fl, j = F // dispatcher.etp_size, dispatcher.etp_rank
    off = dispatcher.local_expert_offset

    x = torch.randn(T, H, generator=torch.Generator().manual_seed(100 + rank)).to(device)
    routed = router(x)  # a RouterOutput: probabilities, map, statistics
    probs_TE, routing_map_TE = routed.probs_TE, routed.routing_map_TE
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
    rows = list(record.tokens_per_expert_host)
    print(f"rank {rank}: {T} tokens, rows per local expert {rows}, output matches", flush=True)
    dist.barrier()  # no rank closes its connections while a peer still uses them


def _spawned(rank, world, init_file):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        main()
    finally:
        release_process_groups()  # frees the groups' native threads before exit


if __name__ == "__main__":
    if "RANK" in os.environ:  # torchrun
        if torch.cuda.is_available():  # one GPU per rank, chosen by the rank on its node
            device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
            torch.cuda.set_device(device)
            dist.init_process_group("nccl", device_id=device)
        else:
            device = torch.device("cpu")
            dist.init_process_group("gloo")
        main(device)
        release_process_groups()  # frees the groups' native threads before exit
    else:
        import tempfile

        path = os.path.join(tempfile.mkdtemp(), "rendezvous")
        mp.spawn(_spawned, args=(4, path), nprocs=4)
