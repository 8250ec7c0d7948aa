"""The cost model's step time against published large runs: Megatron-LM's GPTs on A100s.

For each published run, the model (:func:`jaxpar.cost.step_time`, lowering ``megatron``,
cluster preset ``a100_80gb``) predicts the step time; the predicted TFLOP/s per GPU is the FLOPs the
paper counts (Narayanan et al. 2021, eq. 3: :func:`jaxpar.cost.narayanan_flops`) over the
predicted time and the GPUs. Printed per run: published and predicted TFLOP/s per GPU, the error,
the predicted bytes per GPU of weights + gradients + optimizer state (mixed precision, the busiest
pipeline stage, stage-aware embedding and head) and in all (with activations), and the mean absolute
error per group of runs. Nothing here is a prediction: the numbers below are the published ones.

Sources of the data:

* **Table 1** of D. Narayanan et al., *Efficient Large-Scale Language Model Training on GPU Clusters
  Using Megatron-LM*, SC 2021 (arXiv:2104.04473): layers, hidden size, heads, tensor and pipeline
  sizes, GPUs, batch size and achieved TFLOP/s per GPU; sequence 2,048, vocabulary 51,200, fp16.
  Micro-batch size, the interleaved schedule's layers per virtual stage, full recomputation and the
  data-parallel implementation (``torch``: PyTorch DDP, which reduces gradients during the last
  micro-batch's backward; ``local``: Megatron's, after the pipeline flush) are those of the authors'
  script for that table, ``examples/sc21/run_table_1.sh`` of github.com/NVIDIA/Megatron-LM.
* **Table 2** of the same paper (its PTD-P rows, GPT-3 174.6B and a 529.6B model, micro-batch 1): the
  paper does not state the schedule or the DDP for these; they are taken as non-interleaved 1F1B and
  Megatron's DDP (no overlap), and full recomputation as everywhere in the paper.
* **Table 5** of V. Korthikanti et al., *Reducing Activation Recomputation in Large Transformer
  Models*, MLSys 2023 (arXiv:2205.05198): seconds per iteration with full recomputation, and with
  sequence parallelism and selective recomputation, of the four models of its Table 3 (no data
  parallelism; interleaved with 3 chunks for 175B and 530B). Its MFU column is also in the
  README of github.com/NVIDIA/Megatron-LM, and agrees with these times.

Usage::

    python benchmarks/published_runs.py                 # the table
    python benchmarks/published_runs.py --calibrate     # refit the preset's two device constants
"""
from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass, replace

from jaxpar import cost
from jaxpar.cost import evaluate
from jaxpar.cost import Overlap, narayanan_flops
from jaxpar.strategy import Strategy

SEQ, VOCAB = 2048, 51200
T1 = "Narayanan et al. 2021, Table 1"
T2 = "Narayanan et al. 2021, Table 2 (PTD-P)"


@dataclass(frozen=True)
class Run:
    """One published run: the model, its parallel layout and the TFLOP/s per GPU it reached."""

    name: str
    source: str
    layers: int
    hidden: int
    heads: int
    tensor: int
    pipe: int
    gpus: int
    batch: int
    micro_batch: int
    layers_per_virtual: int      # 0: not interleaved
    ddp: str                     # "torch" or "local"
    tflops: float = 0.0          # published TFLOP/s per GPU (eq. 3 of Narayanan et al.), or
    step_s: float = 0.0          # published seconds per iteration
    remat: str = "full"
    sequence_parallel: bool = False

    @property
    def virtual(self) -> int:
        return self.layers // self.pipe // self.layers_per_virtual if self.layers_per_virtual else 1

    @property
    def flops(self) -> float:
        """FLOPs per iteration as Narayanan et al. count them (eq. 3): the unit of TFLOP/s per GPU."""
        return narayanan_flops(self.batch, SEQ, self.layers, self.hidden, VOCAB)

    @property
    def published_s(self) -> float:
        """The published seconds per iteration (from the TFLOP/s per GPU where that is what was published)."""
        return self.step_s or self.flops / (self.tflops * 1e12 * self.gpus)


#: Table 1 (all ten rows), with run_table_1.sh's micro-batch, interleaving and DDP.
TABLE1 = (
    Run("1.7B", T1, 24, 2304, 24, 1, 1, 32, 512, 16, 0, "torch", 137),
    Run("3.6B", T1, 30, 3072, 32, 2, 1, 64, 512, 16, 0, "torch", 138),
    Run("7.5B", T1, 36, 4096, 32, 4, 1, 128, 512, 16, 0, "torch", 142),
    Run("18.4B", T1, 40, 6144, 48, 8, 1, 256, 1024, 8, 0, "torch", 135),
    Run("39.1B", T1, 48, 8192, 64, 8, 2, 512, 1536, 4, 0, "local", 138),
    Run("76.1B", T1, 60, 10240, 80, 8, 4, 1024, 1792, 2, 5, "local", 140),
    Run("145.6B", T1, 80, 12288, 96, 8, 8, 1536, 2304, 2, 5, "local", 148),
    Run("310.1B", T1, 96, 16384, 128, 8, 16, 1920, 2160, 1, 3, "local", 155),
    Run("529.6B", T1, 105, 20480, 128, 8, 35, 2520, 2520, 1, 1, "local", 163),
    Run("1008B", T1, 128, 25600, 160, 8, 64, 3072, 3072, 1, 0, "local", 163),
)
#: Table 2's PTD-P rows (schedule and DDP not stated in the paper: see the module doc).
TABLE2 = (
    Run("174.6B/384", T2, 96, 12288, 96, 8, 12, 384, 1536, 1, 0, "local", 153),
    Run("174.6B/768", T2, 96, 12288, 96, 8, 12, 768, 1536, 1, 0, "local", 149),
    Run("174.6B/1536", T2, 96, 12288, 96, 8, 12, 1536, 1536, 1, 0, "local", 141),
    Run("529.6B/560", T2, 105, 20480, 128, 8, 35, 560, 2240, 1, 0, "local", 171),
    Run("529.6B/1120", T2, 105, 20480, 128, 8, 35, 1120, 2240, 1, 0, "local", 167),
    Run("529.6B/2240", T2, 105, 20480, 128, 8, 35, 2240, 2240, 1, 0, "local", 159),
)
K5 = "Korthikanti et al. 2022, Table 5"
#: Table 5 of Korthikanti et al. with its Table 3's layouts: full recomputation, then SP + selective.
KORTHIKANTI = tuple(
    Run(f"{name}/{tag}", K5, l, h, a, 8, p, gpus, batch, micro, lpv, "local",
        step_s=sec, remat=remat, sequence_parallel=sp)
    for name, l, h, a, p, gpus, batch, micro, lpv, full_s, sel_s in (
        ("22B", 48, 6144, 64, 1, 8, 4, 4, 0, 1.42, 1.10), ("175B", 96, 12288, 96, 8, 64, 64, 1, 4, 18.13, 13.75),
        ("530B", 105, 20480, 128, 35, 280, 280, 1, 1, 49.05, 37.83),
        ("1T", 128, 25600, 160, 64, 512, 512, 1, 0, 94.42, 71.49))
    for tag, sec, remat, sp in (("full", full_s, "full", False), ("sp-sel", sel_s, "save-matmuls", True)))
#: The runs the preset's two device constants were fitted on (``--calibrate``); every other run is held out.
CALIBRATION = ("1.7B", "1008B")


@dataclass(frozen=True)
class Prediction:
    run: Run
    tflops: float
    step_s: float
    state_bytes: float
    memory_bytes: float

    @property
    def error(self) -> float:
        """Predicted over published throughput, minus 1 (positive: the model is too fast)."""
        return self.run.published_s / self.step_s - 1


def plan_of(run: Run) -> cost.Plan:
    """The run's parallel layout as a :class:`jaxpar.cost.Plan`."""
    data = run.gpus // (run.tensor * run.pipe)
    schedule = "interleaved" if run.virtual > 1 else "1f1b"
    strategy = Strategy(schedule=schedule, virtual_stages=run.virtual, sequence_parallel=run.sequence_parallel,
                        microbatches=run.batch // (data * run.micro_batch))
    return cost.Plan(pipe=run.pipe, data=data, tensor=run.tensor, remat=run.remat, strategy=strategy)


def predict(run: Run, cluster: cost.Cluster | None = None) -> Prediction:
    """The model's step time, TFLOP/s per GPU and memory per GPU for ``run``.

    Args:
      run: the published run.
      cluster: the hardware (default: the ``a100_80gb`` preset), resized to the run's GPUs.

    Returns:
      A :class:`Prediction` (lowering ``megatron``, fp16, mixed-precision Adam state, fp16 gradients, the
      attention's scores and softmax in memory as Megatron-LM's fused softmax kernel keeps them;
      the gradient reduction behind the last backward where the run used PyTorch DDP).
    """
    base = replace(cluster or cost.load_cluster("a100_80gb"), fused_attention=False)   # Megatron-LM's scores in memory
    model = cost.gpt(layers=run.layers, hidden=run.hidden, heads=run.heads, seq=SEQ, vocab=VOCAB, batch=run.batch)
    e = evaluate(model, plan_of(run), base.with_devices(run.gpus), dtype="float16", precision="mixed",
                 overlap=Overlap(grads_in_backward=run.ddp == "torch"), lowering="megatron", grad_bytes=2)
    mem = e.memory
    return Prediction(run, run.flops / (e.time.total * run.gpus) / 1e12, e.time.total,
                      mem.params + mem.grads + mem.opt, mem.total)


def mean_abs_error(preds) -> float:
    """Mean of ``|predicted / published - 1|``."""
    preds = list(preds)
    return sum(abs(p.error) for p in preds) / len(preds)


def calibrate(runs=TABLE1, names=CALIBRATION, cluster: cost.Cluster | None = None) -> tuple[float, float, float]:
    """Fit the two device constants to published runs.

    Args:
      runs: the runs to pick from.
      names: the names of the runs to fit.
      cluster: the hardware (default: the ``a100_80gb`` preset); its other constants are kept.

    Returns:
      ``(efficiency, memory_efficiency, error)``: the point of the grid 0.5, 0.505, ..., 1.0 (both
      constants) with the least mean absolute error over the chosen runs, and that error.
    """
    base = cluster or cost.load_cluster("a100_80gb")
    chosen = [r for r in runs if r.name in names]
    best = (math.inf, 0.0, 0.0)
    for i in range(100, 201):
        for j in range(100, 201):
            c = replace(base, efficiency=i / 200, memory_efficiency=j / 200)
            err = mean_abs_error(predict(r, c) for r in chosen)
            best = min(best, (err, i / 200, j / 200))
    return best[1], best[2], best[0]


def table(preds) -> str:
    """Printable rows: published and predicted TFLOP/s per GPU (or seconds per iteration, where that is
    what was published), the error, and the predicted memory per GPU."""
    lines = [f"{'run':<24} {'source':<38} {'GPUs':>5} {'t':>2} {'p':>3} {'v':>2} {'published':>10} "
             f"{'predicted':>10} {'error':>7} {'state GiB':>9} {'total GiB':>9}"]
    for p in preds:
        r = p.run
        role = " (calib.)" if r.source == T1 and r.name in CALIBRATION else ""
        pub, pred = (f"{r.step_s:.2f} s", f"{p.step_s:.2f} s") if r.step_s else (f"{r.tflops:.0f}", f"{p.tflops:.1f}")
        lines.append(f"{r.name + role:<24} {r.source:<38} {r.gpus:>5} {r.tensor:>2} {r.pipe:>3} {r.virtual:>2} "
                     f"{pub:>10} {pred:>10} {p.error:>+7.1%} {p.state_bytes / 2**30:>9.1f} "
                     f"{p.memory_bytes / 2**30:>9.1f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calibrate", action="store_true", help="refit efficiency and memory_efficiency on "
                    f"{', '.join(CALIBRATION)} of Table 1 and print them (the preset is not written)")
    args = ap.parse_args(argv)
    if args.calibrate:
        eff, mem, err = calibrate()
        print(f"efficiency {eff:.3f}, memory_efficiency {mem:.3f}: mean |error| {err:.2%} on {', '.join(CALIBRATION)}")
        return 0
    t1, t2, k5 = ([predict(r) for r in runs] for runs in (TABLE1, TABLE2, KORTHIKANTI))
    print(table(t1 + t2 + k5))
    held = [p for p in t1 if p.run.name not in CALIBRATION]
    print(f"\nmean |error|: {T1}, all {len(t1)} rows {mean_abs_error(t1):.1%} (its {len(held)} held-out rows "
          f"{mean_abs_error(held):.1%}); held out: {T2}, {len(t2)} rows {mean_abs_error(t2):.1%}; {K5}, "
          f"{len(k5)} rows {mean_abs_error(k5):.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
