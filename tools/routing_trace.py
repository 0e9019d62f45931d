"""Summarize a routing trace (``moe.trace_dir``): how unevenly each MoE layer loads the EP ranks.

    python -m tools.routing_trace TRACE_DIR                      # the trace's own EP size
    python -m tools.routing_trace TRACE_DIR/routing_trace.bin --ep 8 --steps 10:50 --plot load.png
    python -m tools.routing_trace TRACE_DIR --json               # every number, as one JSON object

Per MoE layer: the load of each EP rank against the mean over the EP ranks, per step, and its
``max/mean`` at the median, the 99th percentile and the maximum over the steps; the hottest experts;
each expert's total tokens and the dropped pairs over the steps of ``--steps A:B`` (inclusive; either
end may be left out). A trace recorded in one layout reads in any other: ``--ep N`` places expert e
on EP rank ``e // (E/N)``, as the engine does. ``--plot`` draws max/mean per layer over the steps and
a layer x expert heatmap of each expert's share of its layer's tokens (1/E everywhere is balance).
"""

import argparse
import json
import sys

import numpy as np

from folding.training.telemetry.trace_file import read_trace


def parse_steps(text):
    """``"A:B"`` -> ``(A, B)`` with ``None`` for a missing end (``ValueError`` otherwise)."""
    if text is None:
        return None, None
    parts = text.split(":")
    if len(parts) != 2:
        raise ValueError(f"--steps {text!r}: expected A:B (inclusive; e.g. 10:50, 10: or :50)")
    return tuple(int(p) if p.strip() else None for p in parts)


def ep_loads(tokens_SLE, ep):
    """``[S, L, EP]`` tokens per EP rank when expert e lives on EP rank ``e // (E/ep)``."""
    S, L, E = tokens_SLE.shape
    if ep < 1 or E % ep:
        raise ValueError(f"--ep {ep}: must divide the trace's {E} experts")
    return tokens_SLE.reshape(S, L, ep, E // ep).sum(-1)


def max_over_mean(load_SLP):
    """``[S, L]`` max/mean over the EP ranks (1.0 where a layer routed nothing)."""
    mean = load_SLP.mean(-1)
    out = np.ones(mean.shape)
    np.divide(load_SLP.max(-1), mean, out=out, where=mean > 0)
    return out


def summarize(trace, *, ep=None, steps=(None, None), top=3):
    """The summary of ``trace`` (a :class:`folding.training.telemetry.trace_file.Trace`) for EP size ``ep``
    (default: the trace's) over the inclusive step window ``steps``, as a JSON-ready dict."""
    h = trace.header
    ep = h["ep"] if ep is None else ep
    lo, hi = steps
    keep = np.ones(len(trace.steps), dtype=bool)
    if lo is not None:
        keep &= trace.steps >= lo
    if hi is not None:
        keep &= trace.steps <= hi
    if not keep.any():
        raise ValueError(f"--steps {lo}:{hi}: no record (the trace holds steps {h['first_step']}..{h['last_step']})")
    tokens_SLE = trace.counts_SLRE[keep].astype(np.int64).sum(2)
    dropped_SLE = trace.dropped_SLRE[keep].astype(np.int64).sum(2)
    load_SLP = ep_loads(tokens_SLE, ep)
    ratio_SL = max_over_mean(load_SLP)
    mean_SL1 = load_SLP.mean(-1, keepdims=True)
    rel_SLP = np.divide(load_SLP, mean_SL1, out=np.ones(load_SLP.shape), where=mean_SL1 > 0)
    totals_LE = tokens_SLE.sum(0)
    layers = []
    for l, number in enumerate(h["layer_numbers"]):
        total = int(totals_LE[l].sum())
        order = np.argsort(-totals_LE[l], kind="stable")[:top]
        layers.append(
            {
                "layer": number,
                "max_over_mean": {
                    "p50": float(np.percentile(ratio_SL[:, l], 50)),
                    "p99": float(np.percentile(ratio_SL[:, l], 99)),
                    "max": float(ratio_SL[:, l].max()),
                },
                "max_over_mean_per_step": ratio_SL[:, l].tolist(),
                "ep_load_over_mean_per_step": rel_SLP[:, l].tolist(),
                "ep_rank_tokens": load_SLP[:, l].sum(0).tolist(),
                "hottest": [
                    {
                        "expert": int(e),
                        "tokens": int(totals_LE[l, e]),
                        "share": totals_LE[l, e] / total if total else 0.0,
                    }
                    for e in order
                ],
                "expert_totals": totals_LE[l].tolist(),
                "dropped": int(dropped_SLE[:, l].sum()),
            }
        )
    return {
        "model": h["model"],
        "recorded_layout": h["layout"],
        "ep": ep,
        "num_experts": h["num_experts"],
        "steps": trace.steps[keep].tolist(),
        "layers": layers,
    }


def _ranks(n):
    return f"{n} rank" if n == 1 else f"{n} ranks"


def format_text(summary):
    """The summary as console lines."""
    s = summary
    steps = s["steps"]
    out = [
        f"{s['model']}: {len(steps)} steps ({steps[0]}..{steps[-1]}), {s['num_experts']} experts on EP{s['ep']} "
        f"(recorded with EP{s['recorded_layout'].get('ep')} on {_ranks(s['recorded_layout'].get('world_size'))})",
        f"{'layer':>5} {'max/mean p50':>12} {'p99':>6} {'max':>6} {'dropped':>8}  hottest experts (share)",
    ]
    for lay in s["layers"]:
        m = lay["max_over_mean"]
        hot = ", ".join(f"{x['expert']} ({x['share']:.1%})" for x in lay["hottest"])
        out.append(f"{lay['layer']:>5} {m['p50']:>12.3f} {m['p99']:>6.3f} {m['max']:>6.3f} {lay['dropped']:>8}  {hot}")
    return "\n".join(out)


def plot(summary, path):
    """Write ``path`` (PNG): max/mean per layer over the steps, and each expert's share of its layer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    s = summary
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for lay in s["layers"]:
        a.plot(s["steps"], lay["max_over_mean_per_step"], label=f"layer {lay['layer']}")
    a.set(xlabel="step", ylabel=f"max/mean tokens per EP rank (EP{s['ep']})", title="EP load imbalance")
    a.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    a.legend(fontsize="small")
    totals_LE = np.array([lay["expert_totals"] for lay in s["layers"]], dtype=float)
    share_LE = totals_LE / np.maximum(totals_LE.sum(1, keepdims=True), 1)
    im = b.imshow(share_LE, aspect="auto", cmap="viridis")
    b.set(
        xlabel="expert", ylabel="MoE layer", title=f"share of the layer's tokens (balanced: {1 / s['num_experts']:.3f})"
    )
    b.set_yticks(range(len(s["layers"])), [str(lay["layer"]) for lay in s["layers"]])
    fig.colorbar(im, ax=b)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None):
    """Command line: see the module docstring."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("path", help="a routing trace file, or the moe.trace_dir holding routing_trace.bin")
    p.add_argument("--ep", type=int, default=None, help="EP size to read the trace for (default: the trace's)")
    p.add_argument("--steps", default=None, help="inclusive step window A:B (A: or :B leave an end open)")
    p.add_argument("--top", type=int, default=3, help="hottest experts listed per layer")
    p.add_argument("--plot", default=None, help="write a PNG picture here")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = p.parse_args(argv)
    try:
        summary = summarize(read_trace(args.path), ep=args.ep, steps=parse_steps(args.steps), top=args.top)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(summary) if args.json else format_text(summary))
    if args.plot:
        plot(summary, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
