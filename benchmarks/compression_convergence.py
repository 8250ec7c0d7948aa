"""Does a compressed exchange still train? The quickstart GPT for 300 steps on 8 data-parallel
replicas, once uncompressed and once per codec, with ``jaxpar train`` (same data, same seed).

The table gives the final loss (mean of the last 20 logged steps) and its ratio to the
uncompressed run; the curves go to ``docs/img/compression_losses.png``. Sign *without* error
feedback is run too, to show what error feedback is for.

Usage::

    python benchmarks/compression_convergence.py [--steps 300] [--png docs/img/compression_losses.png]
    # SGD as in docs/benchmarks.md §6 (no weight decay: SGD adds it to the gradient, before momentum)
    python benchmarks/compression_convergence.py optimizer.name=sgd optimizer.momentum=0.9 optimizer.lr=0.1 \
        optimizer.weight_decay=0
    # 1-bit Adam against its two baselines (AdamW, the quickstart's optimizer)
    python benchmarks/compression_convergence.py --only \
        "uncompressed,exact exchange + local clip,1-bit Adam (sign + EF from step 60) + local clip"
"""
from __future__ import annotations

import _common  # noqa: F401  (sets up 8 CPU devices first)

import argparse
import json
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOPK_ADAM = "top-k 1% partitioned + preconditioned on Adam's moment (from step 60) + local clip"
RUNS = {
    "uncompressed": {},
    "qsgd int8": {"kind": "qsgd"},
    "sign + EF": {"kind": "sign"},
    "sign, no EF": {"kind": "sign", "error_feedback": False},
    "sign + EF + codec momentum": {"kind": "sign", "momentum": 0.9, "_overrides": ["optimizer.momentum=0"]},
    "top-k 1% + EF": {"kind": "topk", "ratio": 0.01},
    # DGC's recipe: each replica clipped before the codec (not the exchanged mean), sparsity warm-up
    "top-k 1% + EF + local clip + warm-up": {"kind": "topk", "ratio": 0.01, "warmup": [0.25, 0.1, 0.04],
                                            "warmup_steps": 25, "local_clip": 1.0,
                                            "_overrides": ["optimizer.clip_norm=null"]},
    "powersgd r4": {"kind": "powersgd", "rank": 4},
    # 1-bit Adam (AdamW only): 60 exact steps, then Adam's first moment as packed signs, variance frozen
    "1-bit Adam (sign + EF from step 60) + local clip": {
        "kind": "sign", "optimizer_momentum": 0.9, "start_step": 60, "local_clip": 1.0,
        "_overrides": ["optimizer.clip_norm=null"]},
    # top-k in the same scheme: the moment's largest entries (0.08x the fp32 bytes from step 60)
    "top-k 1% on Adam's moment (from step 60) + local clip": {
        "kind": "topk", "ratio": 0.01, "optimizer_momentum": 0.9, "start_step": 60, "local_clip": 1.0,
        "_overrides": ["optimizer.clip_norm=null"]},
    # ... partitioned (every replica's values at all N k picked entries; 0.12x) and ranked by Adam's step |m| / sqrt(v)
    TOPK_ADAM: {
        "kind": "topk", "ratio": 0.01, "optimizer_momentum": 0.9, "start_step": 60, "local_clip": 1.0,
        "partitioned": True, "precondition": 0.95, "_overrides": ["optimizer.clip_norm=null"]},
    # its baseline with the same clipping rule: the exact exchange (compression never starts), each replica clipped
    "exact exchange + local clip": {"kind": "sign", "start_step": 10**9, "local_clip": 1.0,
                                    "_overrides": ["optimizer.clip_norm=null"]},
}
ADAM_ONLY = ("1-bit Adam (sign + EF from step 60) + local clip",
             "top-k 1% on Adam's moment (from step 60) + local clip", TOPK_ADAM)


def _flow(d: dict) -> str:
    return "{" + ", ".join(f"{k}: {str(v).lower() if isinstance(v, bool) else v}" for k, v in d.items()) + "}"


def train_curves(steps: int = 300, runs=RUNS, extra=()) -> dict[str, list[tuple[int, float]]]:
    """``{run: [(step, loss), ...]}`` of ``jaxpar train configs/quickstart.yaml`` on data=8."""
    from jaxpar.cli import main

    curves = {}
    for name, codec in runs.items():
        with tempfile.TemporaryDirectory() as out:
            args = ["train", str(ROOT / "configs" / "quickstart.yaml"), "mesh.data=8", "mesh.fsdp=1",
                    "mesh.tensor=1", f"train.steps={steps}", "train.log_every=5", "checkpoint.every=0",
                    "train.eval_batches=0", "logging.samples=0", "logging.tensorboard=false",
                    "train.progress=lines", f"train.out_dir={out}", *extra]
            codec = dict(codec)
            args += codec.pop("_overrides", [])      # this run's own overrides (after the shared ones)
            if codec:
                args.append(f"parallel.compression={_flow(codec)}")
            if main(args) != 0:
                raise RuntimeError(f"jaxpar train failed for {name}")
            recs = [json.loads(x) for x in (Path(out) / "metrics.jsonl").read_text().splitlines()]
            curves[name] = [(r["step"], r["loss"]) for r in recs if r["kind"] == "train"]
    return curves


def final_loss(curve, last: int = 4) -> float:
    """Mean of the last ``last`` logged losses (each the mean of its 5-step window: 20 steps)."""
    return sum(l for _, l in curve[-last:]) / last


def plot(curves, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    for name, curve in curves.items():
        ax.plot([s for s, _ in curve], [l for _, l in curve], label=name, lw=1.4,
                ls="--" if "no EF" in name else "-")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (5-step mean)")
    ax.set_ylim(top=min(6.0, ax.get_ylim()[1]))
    ax.set_title("quickstart GPT, 8 data-parallel replicas: compressed gradient exchange")
    ax.legend(fontsize=8, loc="upper right")
    fig.savefig(path, dpi=100, bbox_inches="tight")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--png", default=str(ROOT / "docs" / "img" / "compression_losses.png"))
    ap.add_argument("--json", default="")
    ap.add_argument("--only", default="", help="comma-separated run names")
    ap.add_argument("overrides", nargs="*", help="extra key=value overrides for every run, e.g. optimizer.name=sgd")
    args = ap.parse_args()
    sgd = any(o.startswith("optimizer.name=") and o not in ("optimizer.name=adamw", "optimizer.name=adam")
              for o in args.overrides)
    runs = {k: v for k, v in RUNS.items() if (not args.only or k in args.only.split(",")) and
            not (sgd and k in ADAM_ONLY)}
    curves = train_curves(args.steps, runs, args.overrides)
    base = final_loss(curves["uncompressed"]) if "uncompressed" in curves else None   # --only may leave it out
    print("| run | final loss | vs uncompressed |\n|---|---:|---:|")
    for name, curve in curves.items():
        print(f"| {name} | {final_loss(curve):.3f} | {f'{final_loss(curve) / base:.3f}' if base else '-'} |")
    plot(curves, Path(args.png))
    if args.json:
        Path(args.json).write_text(json.dumps(curves))


if __name__ == "__main__":
    main()
