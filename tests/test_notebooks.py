"""Notebooks run top to bottom on simulated devices (in a fresh kernel)."""
import json
import os
import pathlib
import re

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = pathlib.Path(__file__).resolve().parents[1]


EXPECTED = {
    "01_meshes_and_strategies.ipynb": ["reduce-scatter", "all-gather", "no rule fits logical name 'mlp'",
                                       "ring CP8, balanced", "collective-permutes over [('context',)]: 15",
                                       "same loss to 1e-5: True", "all-to-alls over [('expert',)]: 14",
                                       "same loss and MoE metrics to 1e-5: True"],
    "02_pipelines.ipynb": ["collective-permute | pipe", "1f1b          16   0.158     38               4",
                           "ticks per step: [14, 8, 8]", "stashing, update_every=1: versions per stage (4, 3, 2, 1)",
                           "older versions kept in the state: 1 | step 4"],
    "03_compression.ipynb": ["qsgd", "all-to-all", "max relative gap", "powersgd r4    final loss",
                             "saved compression_losses.png", "1-bit Adam     final loss",
                             "bytes vs fp32: steps 0-9 1.000, steps 10-29 0.03"],
    "04_relaxed_sync.ipynb": ["all-reduce | replica", "DiLoCo H=1", "modelled time", "saved relaxed_losses.png"],
    "05_planning.ipynb": ["N_d = 64: 120.0 GB / 31.4 GB / 16.6 GB / 1.9 GB", "rank | plan",
                          "all-reduce 1,073,741,824 B on 8 x h100: best rabenseifner", "cpu_sim link: alpha",
                          "h100:2x8", "tpu-v5e:4x4"],
    "06_large_batch.ipynb": ["batch  1024: linear 0.400   sqrt 0.200", "trust ratio + decay: 9 matrices; skipped: 8",
                             "B_simple (rows) at steps", "saved noise_scale.png", "decisions [step, batch]: [[0, 16], "],
    "07_gpu_workflow.ipynb": ["devices  8 x gpu (NVIDIA H100 80GB HBM3)", "traced attentions fused (",
                              "gathers  weights", "ms per step on h100", "fits     with",
                              "(the largest, 'blocks/w1', has 768)",
                              "all 18 GEMMs of the 6 covered weights compiled in FP8", "fsdp | f8e4m3fn |",
                              "strategy dp2-fsdp2-tp2-fp8",
                              "muon: 6 parameters ['blocks/w1', 'blocks/w2', 'blocks/wk', 'blocks/wo', 'blocks/wq', "
                              "'blocks/wv']", "adam: 11 parameters", "count per device (HLO)",
                              "collective counts per device equal the compiled HLO's: True"],
}


#: 30-60 s each on 2 busy cores: in the exhaustive tier (CI runs a third a run; make test-all all)
SLOW = {"01_meshes_and_strategies.ipynb", "02_pipelines.ipynb", "03_compression.ipynb", "04_relaxed_sync.ipynb",
        "05_planning.ipynb", "06_large_batch.ipynb", "07_gpu_workflow.ipynb"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.exhaustive) if n in SLOW else n for n in EXPECTED])
def test_notebook_executes(name, tmp_path):
    nb = nbformat.read(ROOT / "notebooks" / name, as_version=4)
    env_before = os.environ.get("XLA_FLAGS")
    client = NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    for text in EXPECTED[name]:
        assert text in outputs, text
    if name == "02_pipelines.ipynb":   # the pipelined losses equal the single-device ones
        diff = float(outputs.split("max relative difference:")[1].split()[0])
        assert diff < 1e-5
        losses = [float(x) for x in outputs.split("losses of the 4 steps: [")[1].split("]")[0].split()]
        assert losses == sorted(losses, reverse=True), losses      # weight stashing trains on a repeated batch
    if name == "06_large_batch.ipynb":    # LAMB under ZeRO-3 on 8 devices = one device
        one, eight = map(float, re.search(r"one device (\S+), ZeRO-3 on 8 devices (\S+)", outputs).groups())
        assert abs(one - eight) <= 1e-4 * abs(one), (one, eight)
        assert float(outputs.split("relative to the largest: ")[1].split()[0]) < 3e-2   # Adam-like: <= lr x steps
        grown = json.loads(outputs.split("decisions [step, batch]: ")[1].splitlines()[0])
        assert len(grown) > 1 and all(b in (16, 32, 64) for _, b in grown)   # it grew, among the allowed sizes
    if name == "03_compression.ipynb":   # 1-bit Adam: Adam's first moment is the exchanged one
        assert float(outputs.split("exchanged one: max relative difference")[1].split()[0]) < 1e-5
    if name == "05_planning.ipynb":       # compiled for H100s and a TPU slice: the arguments are the predicted ones
        for target in ("h100:2x8", "tpu-v5e:4x4"):
            line = next(x for x in outputs.splitlines() if x.startswith(target))
            assert "compiled in" in line and "peak" in line, line
            got, predicted = re.search(r"arguments (\S+) GiB \(predicted (\S+)\)", line).groups()
            assert got == predicted, line          # libtpu's tiled layout included (lowering xla-tpu)
    if name == "04_relaxed_sync.ipynb":   # DiLoCo with H = 1 and a plain outer step is data parallelism
        assert float(outputs.split("max relative gap:")[1].split()[0]) < 1e-5
        inner = outputs.split("inner step:")[1].split("sync step:")[0]
        assert "replica" not in inner
    if name == "07_gpu_workflow.ipynb":   # FP8 (emulated on CPU) and Muon train; the profile's rows are the step
        assert re.search(r"attention (\d+) of \1 traced attentions fused", outputs)    # every traced one fused
        for run in ("FP8", "Muon"):
            losses = json.loads(outputs.split(f"{run} run losses at the logged steps: ")[1].splitlines()[0])
            assert losses == sorted(losses, reverse=True) and losses[-1] < losses[0] - 1, (run, losses)
        assert float(outputs.split("(FP8's rounding: ")[1].split(")")[0]) != 0   # the FP8 forward differs from fp32's
        rows, clock = map(float, re.search(r"rows sum to (\S+) ms; loop clock (\S+) ms", outputs).groups())
        assert abs(rows - clock) <= 0.05 * clock, (rows, clock)
    assert os.environ.get("XLA_FLAGS") == env_before
