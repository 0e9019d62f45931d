"""Pre-flight check of a new machine or cluster: run it first, before any training job.

Usage::

    torchrun --nproc-per-node 8 -m tools.gpu_check      # any world size, multi-node as usual
    python -m tools.gpu_check                           # one process

Prints one table (on rank 0) with a row per check and the result of every rank: the device of
each rank; pipeline point-to-point both ways through the engine's own grouped exchange (what the
pipeline schedules use); an uneven ``all_to_all_single`` (what the dropless dispatcher uses); each
expert backend × FP8 recipe supported on this device, with TransformerEngine's reason when not; a
forward + backward of the tiny preset on every supported backend against the same micro-batch in
fp32 on the ``loop`` backend; and the host↔device transfers of one MoE layer forward + backward.
Checks that need CUDA are listed as SKIPPED with the reason on a machine without it. Exits 1 if
a check that ran failed, 0 otherwise. Takes well under a minute.
"""

from __future__ import annotations

import os
import sys
import time
import traceback

import torch
import torch.distributed as dist

from folding.launch.run import init_world
from folding.model.presets import get_preset
from folding.model.transformer import MoETransformer
from folding.moe.config import MoEConfig
from folding.moe.experts.select import backend_support
from folding.moe.layer import build_moe_layer
from folding.moe.settings import LayerSettings
from folding.parallel import ParallelLayout, build_parallel_state
from folding.parallel.groups import release_process_groups
from folding.pipeline.p2p import P2P
from folding.quant.emulate import RECIPES
from folding.testing.transfer_audit import TransferAudit

PASS, FAIL, SKIP, NO = "ok", "FAIL", "SKIPPED", "no"


def _device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def check_device(ps, dev):
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU (gloo)"
    return PASS, f"rank {ps.rank}: {dev} {name}"


def check_p2p(ps, dev):
    """Send this rank's id to the next and the previous rank in one grouped exchange, both ways."""
    world = dist.get_world_size()
    if world < 2:
        return SKIP, "needs 2 or more ranks"
    p2p = P2P(pp_group=ps.groups.pp, pp_ranks=ps.coords.pp.ranks, pp_rank=ps.coords.pp.rank)
    me = torch.full((4,), float(ps.rank), device=dev)
    got = p2p.exchange(sends=[(1, me), (-1, me + 0.5)], recvs=[(-1, (4,), me.dtype, dev), (1, (4,), me.dtype, dev)])
    want_prev, want_next = float(p2p.peer(-1)), float(p2p.peer(1)) + 0.5
    ok = bool((got[0] == want_prev).all()) and bool((got[1] == want_next).all())
    return (PASS if ok else FAIL), f"next/prev of {world} ranks" + ("" if ok else f": got {got[0][0]}, {got[1][0]}")


def check_all_to_all(ps, dev):
    """Rank r sends (r + d + 1) rows to rank d, each row holding r: uneven in both directions."""
    world, r = dist.get_world_size(), ps.rank
    send_splits = [r + d + 1 for d in range(world)]
    recv_splits = [s + r + 1 for s in range(world)]
    x = torch.full((sum(send_splits), 2), float(r), device=dev)
    out = torch.empty((sum(recv_splits), 2), device=dev)
    dist.all_to_all_single(out, x, recv_splits, send_splits)
    want = torch.cat([torch.full((n, 2), float(s), device=dev) for s, n in enumerate(recv_splits)])
    ok = torch.equal(out, want)
    return (PASS if ok else FAIL), f"splits {send_splits} -> {recv_splits}"


def backend_rows(dev):
    """``(backend, recipe, supported, reason)`` for every combination."""
    rows = []
    for backend in ("te", "torch", "loop", "emulated"):
        for recipe in (None,) + tuple(RECIPES):
            dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
            ok, why = backend_support(backend, recipe, dev, dtype)
            rows.append((backend, recipe, ok, why))
    return rows


def _tiny_step(ps, dev, backend, recipe, dtype):
    cfg = get_preset("mixtral_tiny").replace(num_layers=2)
    cfg = cfg.replace(moe={"expert_backend": backend, "fp8_recipe": recipe})
    model = MoETransformer(cfg, parallel_state=ps, settings=LayerSettings(device=dev, params_dtype=dtype, init_seed=3))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (2, 32), generator=g).to(dev)
    loss = model(ids, labels=ids).float().mean()
    loss.backward()
    norm = torch.sqrt(sum((p.grad.float() ** 2).sum() for p in model.parameters() if p.grad is not None))
    return loss.item(), norm.item()


def check_training(ps, dev, rows):
    """Per supported (backend, recipe): loss and grad norm of one micro-batch against fp32 loop."""
    out = []
    ref = _tiny_step(ps, dev, "loop", None, torch.float32)
    for backend, recipe, ok, why in rows:
        label = f"fwd+bwd {backend}/{recipe or 'none'} vs fp32"
        if not ok:
            continue
        dtype = torch.bfloat16 if (dev.type == "cuda" or recipe is not None) else torch.float32
        loss, norm = _tiny_step(ps, dev, backend, recipe, dtype)
        dl, dn = abs(loss - ref[0]) / abs(ref[0]), abs(norm - ref[1]) / abs(ref[1])
        tol = 5e-2 if recipe is not None else (2e-2 if dtype == torch.bfloat16 else 1e-4)
        good = dl <= tol and dn <= 5 * tol
        out.append(
            (
                label,
                PASS if good else FAIL,
                f"loss {loss:.4f} vs {ref[0]:.4f} fp32 ({dl:.1e}), "
                f"grad norm {norm:.4f} vs {ref[1]:.4f} ({dn:.1e}), {dtype}",
            )
        )
    return out


def check_transfers(ps, dev):
    """H2D / D2H of one MoE layer forward + backward (torch backend, dropless all-to-all)."""
    if not backend_support("torch", None, dev, torch.float32)[0]:
        return SKIP, "no torch grouped_mm on this device"
    cfg = MoEConfig(num_experts=8, topk=2, ffn_hidden_size=32, expert_backend="torch")
    layer = build_moe_layer(
        config=cfg,
        hidden_size=64,
        groups=ps.groups,
        settings=LayerSettings(device=dev),
    )
    x = torch.randn(16, 2, 64, device=dev, requires_grad=True)
    layer(x).sum().backward()
    with TransferAudit() as audit:
        layer(x).sum().backward()
    ok = audit.h2d == 0 and audit.d2h <= 1
    return (PASS if ok else FAIL), f"D2H {audit.d2h} (budget 1), H2D {audit.h2d} (budget 0)"


def run_checks():
    dev = _device()
    world = dist.get_world_size()
    results = []

    def record(name, fn, *args):
        t = time.perf_counter()
        try:
            status, detail = fn(*args)
        except Exception as exc:  # noqa: BLE001 - a failing check is a row, not a crash
            status, detail = FAIL, f"{type(exc).__name__}: {exc}".splitlines()[0]
            traceback.print_exc()
        results.append((name, status, f"{detail} [{time.perf_counter() - t:.1f}s]"))

    with build_parallel_state(ParallelLayout(world_size=world, pp=world)) as pp_ps:
        record("device", check_device, pp_ps, dev)
        record("pipeline p2p, both ways", check_p2p, pp_ps, dev)
    with build_parallel_state(ParallelLayout(world_size=world, ep=world)) as ps:
        record("uneven all_to_all_single", check_all_to_all, ps, dev)
        rows = backend_rows(dev)
        for backend, recipe, ok, why in rows:
            results.append((f"backend {backend}/{recipe or 'none'}", PASS if ok else NO, why or "supported"))
        try:
            results.extend(check_training(ps, dev, rows))
        except Exception as exc:  # noqa: BLE001
            traceback.print_exc()
            results.append(("training steps", FAIL, f"{type(exc).__name__}: {exc}".splitlines()[0]))
        record("MoE layer host transfers", check_transfers, ps, dev)
    if dev.type != "cuda":
        results.append(("NCCL (p2p, all-to-all)", SKIP, "no CUDA device: ran on gloo"))
    return results


def main() -> int:
    init_world(timeout_s=120)
    try:
        mine = run_checks()
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        failed = any(status == FAIL for rows in everyone for _, status, _ in rows)
        if dist.get_rank() == 0:
            width = max(len(name) for name, _, _ in everyone[0])
            print(
                f"folding gpu_check: {dist.get_world_size()} rank(s), torch {torch.__version__}, "
                f"backend {dist.get_backend()}"
            )
            for i, (name, _, _) in enumerate(everyone[0]):
                statuses = [rows[i][1] for rows in everyone]
                worst = FAIL if FAIL in statuses else statuses[0]
                print(f"{name:<{width}}  {worst:<7}  {everyone[0][i][2]}")
                for r, rows in enumerate(everyone[1:], start=1):
                    if rows[i][1] != statuses[0]:
                        print(f"{'':<{width}}  {rows[i][1]:<7}  rank {r}: {rows[i][2]}")
            print("FAILED" if failed else "all checks that ran passed")
        return 1 if failed else 0
    finally:
        release_process_groups()  # frees the groups' native threads before exit


if __name__ == "__main__":
    sys.exit(main())
