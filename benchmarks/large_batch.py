"""Large batches on the quickstart GPT (8 simulated devices, DP2 x FSDP2 x TP2), at equal tokens.

Three experiments, each ``jaxpar train configs/quickstart.yaml`` runs with the same data and seed:

* **scaling**: global batch 32, 128 and 512 for the same 9,600 sequences (300, 75 and 19 steps),
  once with the linear scaling rule and a gradual warm-up (``lr_scaling: {rule: linear,
  base_batch: 32}``, warm-up over the first 10% of steps) and once without (the batch-32
  learning rate, no warm-up);
* **ramp**: learning-rate decay (batch 32, cosine decay, 300 steps) against a batch ramp at a
  constant learning rate (Smith et al. 2017: 32 -> 64 -> 128 at steps 0 / 100 / 150, 175 steps,
  the same 9,600 sequences);
* **noise**: the gradient noise scale B_simple measured every 5 steps during the batch-32 run;
* **adaptive**: the ramp's sizes chosen by the measured noise scale instead (``batch_ramp:
  {adaptive: true, every: 25, factor: 1 or 8, start: 25}``, 175 steps at a constant learning
  rate; its tokens depend on the decisions, so compare on the loss-vs-tokens plot).

Final loss = the mean train loss of the last 10% of steps; eval = 4 held-out batches at the end.
PNGs: ``docs/img/large_batch_{scaling,ramp,noise}.png``.

Usage::

    python benchmarks/large_batch.py [--only scaling,ramp,noise] [--json out.json]
"""
from __future__ import annotations

import _common  # noqa: F401  (sets up 8 CPU devices first)

import argparse
from pathlib import Path

from _common import environment, quickstart_run, write_json

ROOT = Path(__file__).resolve().parents[1]
SEQS, SEQ_LEN = 9600, 64


def _scaling_runs() -> dict:
    runs = {}
    for b in (32, 128, 512):
        steps = SEQS // b
        runs[f"B={b} linear + warm-up"] = [f"data.batch_size={b}", f"train.steps={steps}",
                                            "optimizer.lr_scaling={rule: linear, base_batch: 32}",
                                            f"optimizer.warmup_steps={max(1, steps // 10)}"]
        runs[f"B={b} unscaled"] = [f"data.batch_size={b}", f"train.steps={steps}", "optimizer.warmup_steps=0"]
    return runs


GROUPS = {
    "scaling": _scaling_runs,
    "ramp": lambda: {"B=32, cosine lr decay": ["train.steps=300"],
                     "ramp 32-64-128, constant lr": ["train.steps=175", "optimizer.lr_schedule=constant",
                                                     "data.batch_ramp={sizes: [32, 64, 128], steps: [0, 100, 150]}"]},
    "noise": lambda: {"B=32, noise scale every 5": ["train.steps=300", "logging.noise_scale={every: 5}"]},
    "adaptive": lambda: {f"adaptive 32-64-128 (factor {f}), constant lr": [
        "train.steps=175", "optimizer.lr_schedule=constant", "logging.noise_scale={every: 5}",
        f"data.batch_ramp={{sizes: [32, 64, 128], adaptive: true, every: 25, factor: {f}, start: 25}}"]
        for f in (1, 8)},
}


def run(name: str, overrides: list[str]) -> tuple[list[dict], float]:
    """The train records (each with ``tokens`` so far) and the final eval loss of one run."""
    train, evaluated = quickstart_run(overrides, name)
    tokens = 0
    for r in train:
        tokens += r["batch_size"] * SEQ_LEN
        r["tokens"] = tokens
    return train, evaluated


def final(recs: list[dict]) -> float:
    tail = recs[-max(1, len(recs) // 10):]
    return sum(r["loss"] for r in tail) / len(tail)


def plot(path: Path, curves: dict, key: str, ylabel: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for name, recs in curves.items():
        pts = [(r["tokens"], r[key]) for r in recs if key in r]
        ax.plot([t / 1e6 for t, _ in pts], [v for _, v in pts], label=name, marker="." if len(pts) < 40 else None)
    ax.set_xlabel("tokens (millions)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    if key == "loss":
        ax.set_ylim(top=min(6.0, ax.get_ylim()[1]))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default="scaling,ramp,noise,adaptive")
    p.add_argument("--img", default=str(ROOT / "docs" / "img"))
    p.add_argument("--json")
    args = p.parse_args()
    env = environment()
    print(f"# large batch, quickstart GPT, {SEQS} sequences x {SEQ_LEN} tokens  ({env['devices']}, nproc "
          f"{env['nproc']}, jaxpar @ {env['git']})")
    results, ramp_curves = {}, {}
    for group in args.only.split(","):
        curves = dict(ramp_curves) if group == "adaptive" else {}     # drawn beside the fixed ramp
        for name, overrides in GROUPS[group]().items():
            recs, ev = run(name, overrides)
            curves[name] = recs
            row = {"steps": len(recs), "final_loss": final(recs), "eval_loss": ev, "tokens": recs[-1]["tokens"]}
            if group == "adaptive":
                row["batch_sizes"] = {int(r["step"]): int(r["batch_size"]) for i, r in enumerate(recs)
                                      if i == 0 or r["batch_size"] != recs[i - 1]["batch_size"]}
            if group in ("noise", "adaptive"):
                ns = [r["noise_scale"] for r in recs if "noise_scale" in r]
                row["noise_scale"] = {"first": ns[0], "last": ns[-1], "max": max(ns)}
            results[name] = row
            print(f"{name:>32}: {row['steps']:>4} steps, {row['tokens'] / 1e6:.3f} M tokens, final loss "
                  f"{row['final_loss']:.4f}, eval {ev:.4f}" + (f", noise scale {row['noise_scale']}"
                                                              if "noise_scale" in row else "")
                  + (f", batch from step {row['batch_sizes']}" if "batch_sizes" in row else ""), flush=True)
        if group == "ramp":
            ramp_curves = dict(curves)
        img = Path(args.img) / f"large_batch_{group}.png"
        if group == "noise":
            plot(img, curves, "noise_scale", "B_simple (sequences)", "Gradient noise scale, batch 32")
        else:
            plot(img, curves, "loss", "train loss", {"scaling": "Batch 32 to 512 at equal tokens",
                                                      "ramp": "Batch ramp vs learning-rate decay",
                                                      "adaptive": "Batch grown by the noise scale"}[group])
        print(f"wrote {img}")
    if args.json:
        write_json(args.json, {"environment": env, "results": results})


if __name__ == "__main__":
    main()
