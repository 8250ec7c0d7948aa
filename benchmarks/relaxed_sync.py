"""Relaxed synchronisation on the quickstart GPT, 8 simulated devices as replica=4 x data=2.

Runs ``jaxpar train configs/quickstart.yaml`` (same data, seed and global batch 32 in every run;
equal steps = equal tokens) with:

* synchronous data parallelism over replica x data (the baseline), DiLoCo H = 20 (outer Nesterov
  SGD lr 0.7, momentum 0.9) and local SGD H = 20 (plain averaging), from scratch and after 100
  synchronous steps (``start_step=100``: post-local SGD; DiLoCo itself starts from a pretrained model);
* bounded staleness s in {0, 1, 4, 16} (delays uniform in 0..s each step);
* backup workers b in {0, 1, 2} (lognormal straggler times, sigma 0.5): loss against the *modelled*
  wall-clock time, the sum over steps of the (K - b)-th fastest replica's time (mean step = 1).

Final loss = mean of the last 20 steps' logged losses; eval loss = the final model (DiLoCo: the
outer parameters) on 4 held-out batches. PNGs: ``docs/img/relaxed_{diloco,stale,backup}.png``.

Usage::

    python benchmarks/relaxed_sync.py [--steps 300] [--only diloco,stale,backup] [--json out.json]
"""
from __future__ import annotations

import _common  # noqa: F401  (sets up 8 CPU devices first)

import argparse
from pathlib import Path

from _common import environment, quickstart_run, write_json

ROOT = Path(__file__).resolve().parents[1]
GROUPS = {
    "diloco": {"sync DP": {}, "DiLoCo H=20": {"kind": "diloco", "every": 20},
               "local SGD H=20": {"kind": "local_sgd", "every": 20},
               "DiLoCo H=20 after 100 sync": {"kind": "diloco", "every": 20, "start_step": 100},
               "local SGD H=20 after 100 sync": {"kind": "local_sgd", "every": 20, "start_step": 100}},
    "stale": {f"s={s}": {"kind": "stale", "max_delay": s} for s in (0, 1, 4, 16)},
    "backup": {f"b={b}": {"kind": "backup", "backups": b} for b in (0, 1, 2)},
}


def _flow(d: dict) -> str:
    return "{" + ", ".join(f"{k}: {v}" for k, v in d.items()) + "}"


def run(name: str, sync: dict, steps: int) -> list[dict]:
    """The ``train`` records of one ``jaxpar train`` run on replica=4 x data=2 (the last one also
    holds the final ``eval_loss``)."""
    overrides = ["mesh.replica=4", "mesh.data=2", "mesh.fsdp=1", "mesh.tensor=1", f"train.steps={steps}"]
    train, evaluated = quickstart_run(overrides + ([f"parallel.sync={_flow(sync)}"] if sync else []), name)
    train[-1]["eval_loss"] = evaluated
    return train


def final(recs: list[dict], last: int = 20) -> float:
    return sum(r["loss"] for r in recs[-last:]) / last


def smooth(ys: list[float], w: int = 10) -> list[float]:
    return [sum(ys[max(0, i - w + 1):i + 1]) / (i + 1 - max(0, i - w + 1)) for i in range(len(ys))]


def plot(path: Path, curves: dict, xlabel: str, title: str, x_key: str = "step") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for name, recs in curves.items():
        xs = [r[x_key] for r in recs]
        ax.plot(xs, smooth([r["loss"] for r in recs]), label=name)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("train loss (10-step mean)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--only", default="diloco,stale,backup")
    p.add_argument("--runs", default="", help="';'-separated run names to keep in each group (default: all)")
    p.add_argument("--img", default=str(ROOT / "docs" / "img"))
    p.add_argument("--json")
    args = p.parse_args()
    env = environment()
    print(f"# relaxed sync, quickstart GPT, replica=4 x data=2, {args.steps} steps  ({env['devices']}, nproc {env['nproc']}, jaxpar @ {env['git']})")
    results = {}
    for group in args.only.split(","):
        keep = [r for r in args.runs.split(";") if r]
        curves = {name: run(name, sync, args.steps) for name, sync in GROUPS[group].items()
                  if not keep or name in keep}
        base = final(next(iter(curves.values())))
        base_eval = next(iter(curves.values()))[-1]["eval_loss"]
        for name, recs in curves.items():
            row = {"final_loss": final(recs), "ratio": final(recs) / base, "eval_loss": recs[-1]["eval_loss"],
                   "eval_ratio": recs[-1]["eval_loss"] / base_eval,
                   "replica_bytes_per_step": sum(r.get("replica_bytes", 0.0) for r in recs) / len(recs)}
            if group == "backup":
                t = 0.0
                for r in recs:
                    t += r["modelled_time"]
                    r["modelled_clock"] = t
                row["modelled_time"] = t
                row["modelled_time_sync"] = sum(r["modelled_time_sync"] for r in recs)
            results[name] = row
            extra = (f"  modelled time {row['modelled_time']:.1f} (all replicas: {row['modelled_time_sync']:.1f})"
                     if group == "backup" else "")
            print(f"{name:>24}: final loss {row['final_loss']:.4f}  x{row['ratio']:.3f}  eval {row['eval_loss']:.4f} "
                  f"x{row['eval_ratio']:.3f}  "
                  f"replica bytes/step {row['replica_bytes_per_step'] / 1024:.1f} KiB{extra}", flush=True)
        img = Path(args.img) / f"relaxed_{group}.png"
        if group == "backup":
            plot(img, curves, "modelled wall-clock (mean step = 1)", "Backup workers (K = 4, lognormal 0.5)",
                 "modelled_clock")
        else:
            plot(img, curves, "step (equal tokens)", {"diloco": "DiLoCo / local SGD vs synchronous DP",
                                                     "stale": "Bounded staleness (delay uniform in 0..s)"}[group])
        print(f"wrote {img}")
    if args.json:
        write_json(args.json, {"environment": env, "steps": args.steps, "results": results})


if __name__ == "__main__":
    main()
