"""Convert between Hugging Face checkpoints (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V3) and the engine.

Subcommands::

    python -m tools.convert_hf import HF_DIR engine.pt        # 1-rank engine state dict (+ configs)
    python -m tools.convert_hf export engine.pt OUT_DIR       # back to config.json + model.safetensors
                                                              # (shards + index beyond --max-shard-bytes)
    python -m tools.convert_hf export --checkpoint DIR --out HF_DIR   # a training checkpoint -> HF
    python -m tools.convert_hf roundtrip HF_DIR OUT_DIR       # HF -> engine -> HF, bit-identical check
    torchrun --nproc-per-node 8 -m tools.convert_hf roundtrip HF_DIR OUT_DIR --tp 2 --ep 4 --etp 2

``roundtrip`` under torchrun loads the checkpoint directly into the given layout (each rank reads only
its slices), exports it by gathering to rank 0, and compares every tensor bit for bit. The MoE block
implementation is chosen with ``--moe-factory module:function`` (default: the engine's MoE layer).
``export --checkpoint`` takes a training checkpoint (``step_<N>``, or a checkpoint directory: its
latest complete one) saved in any layout, assembles the full tensors on one process (no process
group) and writes HF safetensors. Exit status 0 on success, 1 when a round trip differs, 2 on a bad
checkpoint or layout.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import json
import os
import sys

import torch

from folding.checkpoint.load import is_complete, latest_complete, load_full_model, read_meta
from folding.model.config import ModelConfig
from folding.model.hf.config import CheckpointError
from folding.model.hf.weights import _Reader, from_hf, to_hf
from folding.model.transformer import MoETransformer
from folding.parallel import ParallelLayout, build_parallel_state
from folding.parallel.groups import release_process_groups


def _factory(spec):
    if not spec:
        return None
    mod, fn = spec.split(":")
    return getattr(importlib.import_module(mod), fn)


def _parallel_state(args):
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1 and max(args.tp, args.cp, args.ep, args.etp or 1) == 1:
        return None
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    return build_parallel_state(
        ParallelLayout(world_size=dist.get_world_size(), tp=args.tp, cp=args.cp, ep=args.ep, etp=args.etp)
    )


def cmd_import(args) -> int:
    model = from_hf(args.src, moe_factory=_factory(args.moe_factory))
    torch.save(
        {
            "model_config": dataclasses.asdict(model.config),
            "hf_config": model.hf_config,
            "state_dict": model.state_dict(),
        },
        args.dst,
    )
    print(f"wrote {args.dst}: {sum(p.numel() for p in model.parameters())} parameters")
    return 0


@contextlib.contextmanager
def single_process_world():
    """A 1-process gloo world for the duration of the block when none exists (the engine's MoE
    layer needs an initialized ``torch.distributed``); an existing world is left as it is."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        release_process_groups()  # frees the groups' native threads before exit


def export_checkpoint(checkpoint: str, out_dir: str, dtype=None, max_shard_bytes: int = 5 * 2**30) -> str:
    """Write training checkpoint ``checkpoint`` (or the latest complete one under it) as a Hugging
    Face checkpoint in ``out_dir`` (safetensors shards beyond ``max_shard_bytes``); return the
    checkpoint path used. 1 process, CPU, fp32 unless ``dtype``."""
    path = checkpoint if is_complete(checkpoint) else latest_complete(checkpoint)
    if path is None:
        raise ValueError(f"--checkpoint {checkpoint}: neither a complete checkpoint nor a directory holding one")
    meta = read_meta(path)
    with single_process_world():
        model = MoETransformer(ModelConfig.from_dict(meta["model"]).for_inference(), initialize=False)
        load_full_model(path, model)
        to_hf(model, out_dir, dtype=dtype, max_shard_bytes=max_shard_bytes)
    if meta.get("hf_source_config"):
        cfg_path = os.path.join(out_dir, "config.json")
        with open(cfg_path, encoding="utf-8") as f:
            written = json.load(f)
        with open(cfg_path, "w", encoding="utf-8") as f:
            json.dump(with_source_fields(written, meta["hf_source_config"]), f, indent=2, sort_keys=True)
    return path


SOURCE_WINS = ("initializer_range", "output_router_logits")
"""``config.json`` keys the export writes from a setting the run may change freely although the weights came
from the source: the source's value is the true one (``model.init_std``; ``output_router_logits``, whether
transformers returns router logits, which the engine derives from ``moe.aux_loss_coeff``)."""


def with_source_fields(written: dict, source: dict) -> dict:
    """The exported ``config.json`` of a run that started from Hugging Face weights: every field of the
    source's ``config.json`` the engine does not write kept unchanged, the :data:`SOURCE_WINS` fields
    the source's, every other field as the engine wrote it (the model it trained; the start checked
    that those the engine models equal the source's)."""
    out = {**source, **written}
    out.update({k: source[k] for k in SOURCE_WINS if k in source})
    return out


def cmd_export(args) -> int:
    if args.checkpoint:
        if not args.out:
            raise ValueError("export --checkpoint DIR needs --out HF_DIR")
        path = export_checkpoint(args.checkpoint, args.out, max_shard_bytes=args.max_shard_bytes)
        print(f"wrote {args.out} from {path}")
        return 0
    if not (args.src and args.dst):
        raise ValueError("export needs either --checkpoint DIR --out HF_DIR or ENGINE_PT OUT_DIR")

    blob = torch.load(args.src, map_location="cpu", weights_only=True)
    cfg = ModelConfig.from_dict(blob["model_config"])
    model = MoETransformer(cfg, moe_factory=_factory(args.moe_factory), initialize=False)
    model.load_state_dict(blob["state_dict"])
    model.hf_config = blob.get("hf_config")
    to_hf(model, args.dst, max_shard_bytes=args.max_shard_bytes)
    print(f"wrote {args.dst}")
    return 0


def cmd_roundtrip(args) -> int:
    ps = _parallel_state(args)
    model = from_hf(args.src, parallel_state=ps, moe_factory=_factory(args.moe_factory))
    to_hf(model, args.dst, max_shard_bytes=args.max_shard_bytes)
    if ps is not None:
        import torch.distributed as dist

        dist.barrier()
        if dist.get_rank() != 0:
            return 0
    src, out = _Reader(args.src), _Reader(args.dst)  # either may be sharded
    bad = 0
    for name in src.weight_map:
        if name not in out.weight_map or not torch.equal(
            src._file(name).get_tensor(name), out._file(name).get_tensor(name)
        ):
            print(f"differs: {name}")
            bad += 1
    print(
        f"{len(src.weight_map) - bad}/{len(src.weight_map)} tensors bit-identical"
        + (f" (layout {ps.layout.describe()})" if ps is not None else "")
    )
    return 1 if bad else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    for name, help_ in (
        ("import", "HF directory -> engine .pt"),
        ("export", "engine .pt or training checkpoint -> HF directory"),
        ("roundtrip", "HF -> engine (in a layout) -> HF, compared bit for bit"),
    ):
        s = sub.add_parser(name, help=help_)
        s.add_argument("src", nargs="?" if name == "export" else None)
        s.add_argument("dst", nargs="?" if name == "export" else None)
        if name == "export":
            s.add_argument("--checkpoint", default=None, help="training checkpoint (step_<N>) or directory of them")
            s.add_argument("--out", default=None, help="output Hugging Face directory")
        s.add_argument("--moe-factory", default=None, help="module:function building MoE blocks")
        if name in ("export", "roundtrip"):
            s.add_argument(
                "--max-shard-bytes",
                type=int,
                default=5 * 2**30,
                help="write safetensors shards of at most this many bytes, with an index (default 5 GiB)",
            )
        if name == "roundtrip":
            for axis in ("tp", "cp", "ep"):
                s.add_argument(f"--{axis}", type=int, default=1)
            s.add_argument("--etp", type=int, default=None, help="expert TP (default: --tp)")
    args = p.parse_args(argv)

    try:
        return {"import": cmd_import, "export": cmd_export, "roundtrip": cmd_roundtrip}[args.cmd](args)
    except (CheckpointError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
