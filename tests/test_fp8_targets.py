"""FP8 in the cost model, the planner, ``jaxpar inspect`` and ``jaxpar plan``: the FP8 peak per cluster,
the refusal of a target without FP8 GEMMs by name, the FP8 time and byte terms (analytic), and one
deviceless H100 compile whose FP8 GEMMs, FP8 all-gathers and bytes over ``fsdp`` are checked (slow)."""
from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest

from jaxpar import cost
from jaxpar.cli import main
from jaxpar.config import load_config
from jaxpar.commands import inspect_config
from jaxpar.config._build import build_option
from jaxpar.plan import fp8_lines
from jaxpar.commands._planner_options import plan_dtype
from jaxpar.plan import plan_overrides
from jaxpar.cost._roofline import fp8_kernels, fp8_quantize_bytes, layer_kernels
from jaxpar.cost._traffic import comms
from jaxpar.devices._targets import has_fp8_gemms, load_spec, presets
from jaxpar.errors import CostModelError, Fp8Error
from jaxpar.options import Fp8
from jaxpar.strategy import Strategy

ROOT = Path(__file__).resolve().parents[1]
QUICK = str(ROOT / "configs" / "quickstart.yaml")
FP8_ON = ["parallel.fp8.recipe=tensorwise"]
#: A GPT whose every block GEMM FP8 covers at min_dim 1024 (hidden 1024, MLP 4096).
WIDE = cost.gpt(layers=4, hidden=1024, heads=8, seq=512, vocab=4096, batch=64)


def test_the_fp8_peak_is_where_the_hardware_has_fp8_gemms():
    h100 = cost.load_cluster("h100")
    assert h100.peak("float8") == 1979e12 and h100.peak("bfloat16") == 989e12 and h100.has_fp8
    assert h100.compute_dtypes == ("bfloat16", "float32")             # float8 is never a compute dtype
    for name in ("a100_80gb", "tpu_v5e", "tpu_v5p", "tpu_v6e", "cpu_sim"):
        assert not cost.load_cluster(name).has_fp8, name
    for name in presets():                # a target has FP8 GEMMs exactly when its cost preset has the peak
        spec = load_spec(name)
        assert has_fp8_gemms(spec) == cost.load_cluster(spec.cluster).has_fp8, name
    assert {n for n in presets() if has_fp8_gemms(load_spec(n))} == {"h100", "h200", "b200"}
    with pytest.raises(CostModelError, match="not a compute dtype"):
        cost.step_time(WIDE, cost.Plan(data=8), h100, dtype="float8")


@pytest.mark.parametrize("target,name", [("tpu-v5e:2x4", "tpu-v5e"), ("a100-80gb:1x8", "a100-80gb")])
def test_a_target_without_fp8_gemms_is_refused_by_name(target, name):
    cfg = load_config(QUICK, FP8_ON + ["train.devices=0"])
    with pytest.raises(Fp8Error, match=rf"target {name} has no FP8 GEMMs: parallel.fp8 .* turn parallel.fp8 off "
                                       r"\(parallel.fp8=\{\}\) or choose b200 / h100 / h200"):
        inspect_config(cfg, target=target)          # refused before anything is built or compiled
    with pytest.raises(Fp8Error, match=rf"target {name} has no FP8 GEMMs"):
        plan_dtype(cfg, None, cost.load_cluster(load_spec(name).cluster))
    plan_dtype(load_config(QUICK), None, cost.load_cluster(load_spec(name).cluster))    # FP8 off: planned


def test_plan_refuses_an_fp8_config_on_a_target_without_fp8(tmp_path, capsys):
    config = tmp_path / "fp8.yaml"
    config.write_text(f"base: {QUICK}\nparallel: {{fp8: {{recipe: tensorwise}}}}\n")
    assert main(["plan", "--config", str(config), "--target", "tpu-v5e:2x4"]) == 2
    assert "jaxpar plan: error: target tpu-v5e has no FP8 GEMMs" in capsys.readouterr().err
    assert main(["plan", "--config", str(config), "--cluster", "cpu_sim", "--devices", "8", "--top", "1"]) == 0
    assert "fp8      not considered: cluster cpu_sim has no FP8 GEMMs" in capsys.readouterr().out


def test_inspect_on_the_cpu_mesh_says_fp8_is_emulated():
    cfg = load_config(QUICK, FP8_ON)
    [line] = fp8_lines(build_option("fp8", cfg.parallel.fp8), None, None, None, "cpu")
    assert line.startswith("fp8      tensorwise: emulated by XLA:CPU") and "--target h100:1x8" in line


def test_the_planner_considers_fp8_only_where_a_peak_exists():
    h100, a100 = cost.load_cluster("h100"), cost.load_cluster("a100_80gb")
    r = cost.plan(WIDE, h100, top=3)
    assert r.best.plan.strategy.fp8 == Fp8() and r.best.without_fp8 > r.best.time.total
    without = cost.evaluate(WIDE, r.best.plan.with_strategy(fp8=None), h100)
    assert r.best.without_fp8 == pytest.approx(without.time.total, rel=1e-12)     # the same plan without FP8
    assert "without fp8 ms (gain)" in r.table(3)
    assert "parallel.fp8={recipe: tensorwise, min_dim: 1024}" in plan_overrides(r.best.plan)
    assert all(e.plan.strategy.fp8 is None and e.without_fp8 is None for e in cost.plan(WIDE, a100).ranked)
    assert all(e.plan.strategy.fp8 is None for e in cost.plan(WIDE, h100, fp8=False).ranked)
    narrow = cost.gpt(layers=4, hidden=768, heads=12, seq=512, vocab=4096, batch=64)    # no GEMM reaches 1024
    assert all(e.plan.strategy.fp8 is None for e in cost.plan(narrow, h100).ranked)
    assert cost.plan(narrow, h100, fp8_options=Fp8(min_dim=0)).best.plan.strategy.fp8 == Fp8(min_dim=0)
    with pytest.raises(cost.PlanError, match="cluster 'a100_80gb' has no FP8 GEMMs"):
        cost.plan(WIDE, a100, fp8=True)


def test_the_fp8_time_term_counts_the_covered_gemms_at_the_fp8_peak():
    """Compute: the covered GEMMs' FLOPs (forward and both backward GEMMs of q, k, v, the projection and
    the MLP) move from the bf16 peak to the FP8 peak; the rest stays. Elementwise: the casts' bytes."""
    flat = replace(cost.load_cluster("h100"), gemm_half_flops=0.0, memory_bandwidth=0.0)   # pure FLOP/s
    plan, fp8 = cost.Plan(data=8), cost.Plan(data=8, strategy=Strategy(fp8=Fp8()))
    h, f, s, rows = WIDE.hidden, WIDE.mlp, WIDE.seq, WIDE.batch // 8
    covered = WIDE.layers * 3 * rows * 2 * s * (4 * h * h + 2 * h * f)      # FLOPs per device per step
    bf16, fp8_t = (cost.step_time(WIDE, p, flat) for p in (plan, fp8))
    expected = covered / flat.efficiency * (1 / 989e12 - 1 / 1979e12)
    assert bf16.compute - fp8_t.compute == pytest.approx(expected, rel=1e-9)
    assert fp8_t.elementwise == bf16.elementwise == 0.0
    h100 = cost.load_cluster("h100")
    ks = layer_kernels(WIDE, fp8, rows, 2)
    fwd, bwd = fp8_quantize_bytes(ks, fp8_kernels(WIDE, fp8), "tensorwise", 2)
    T = rows * s                     # per layer: q, k, v and proj read (T, h) x (h, h); fc1, fc2 the MLP's
    assert fwd == 5 * (3 * (T * h + h * h) + (T * h + h * h) + (T * h + h * f) + (T * f + f * h))
    assert bwd == 5 * (3 * T * h + T * h + T * f + T * h)
    gap = cost.step_time(WIDE, fp8, h100).elementwise - cost.step_time(WIDE, plan, h100).elementwise
    assert gap == pytest.approx(WIDE.layers * (fwd + bwd) / h100.stream_bandwidth, rel=1e-9)
    with pytest.raises(CostModelError, match="cluster 'tpu_v5e' has no FP8 GEMMs"):
        cost.step_time(WIDE, fp8, cost.load_cluster("tpu_v5e"))


def test_fp8_gathers_one_byte_per_covered_element_and_reduces_gradients_as_without():
    plan, fp8 = cost.Plan(fsdp=8), cost.Plan(fsdp=8, strategy=Strategy(fp8=Fp8()))
    covered = sum(leaf.size for leaf in WIDE.leaves if leaf.fp8(1024))      # q, k, v, o and the MLP, all layers
    assert covered == WIDE.layers * (4 * 1024 * 1024 + 2 * 1024 * 4096)

    def by_phase(p, lowering):
        out = {}
        for c in comms(WIDE, p, lowering=lowering, compute_bytes=2, grad_bytes=2):
            out[c.phase] = out.get(c.phase, 0.0) + c.bytes * c.count
        return out
    for lowering in ("xla", "ideal"):
        b, f = by_phase(plan, lowering), by_phase(fp8, lowering)
        assert b["params"] - f["params"] == pytest.approx(2 * covered)   # two gathers of each: 2 -> 1 byte per element
        assert f["grads"] == b["grads"]
    assert by_phase(fp8, "xla-cpu") == by_phase(plan, "xla-cpu")          # emulated on the CPU: as without


def test_fp8_under_tensor_parallelism_reduces_q_k_and_v_input_gradients_one_by_one_on_the_gpu():
    plan, fp8 = cost.Plan(tensor=8), cost.Plan(tensor=8, strategy=Strategy(fp8=Fp8()))
    act = WIDE.batch * WIDE.seq * WIDE.hidden * 2           # one bf16 activation of the residual stream
    tensor = lambda p, lw="xla": sum(c.bytes * c.count for c in comms(WIDE, p, lowering=lw)  # noqa: E731
                                     if c.phase == "tensor")
    # per layer: 4 all-reduces become 6 (q, k and v's input gradients apart: measured); ideal: as without
    assert tensor(fp8) - tensor(plan) == pytest.approx(WIDE.layers * 2 * act)
    assert tensor(fp8, "ideal") == tensor(plan, "ideal")


@pytest.mark.slow
def test_inspect_h100_fsdp8_fp8_reports_every_covered_gemm_and_fp8_all_gathers(capsys):
    """Deviceless ``h100:1x8`` compile of a 2-layer GPT (embed 1024) under FSDP8 with FP8: every covered
    GEMM in FP8, the covered weights gathered as FP8 values, and the cost model's bytes over fsdp within 5%."""
    cfg = load_config(QUICK, FP8_ON + ["model.embed=1024", "model.heads=8", "model.layers=2", "model.seq_len=128",
                                       "mesh.data=1", "mesh.fsdp=8", "mesh.tensor=1", "train.devices=0",
                                       "parallel.compute_dtype=bfloat16"])
    assert inspect_config(cfg, target="h100:1x8") == 0
    out = capsys.readouterr().out
    assert "all 18 GEMMs of the 6 covered weights compiled in FP8" in out      # wq wk wv wo w1 w2, x 3
    gathers = dict(re.findall(r"^fsdp \| (\w+) +\| +\d+ \| +([\d.]+ \w+)$", out, re.M))
    assert gathers["f8e4m3fn"] == "48.0 MiB"       # 2 layers x (4 + 8) Mi covered elements / 8 x 2 gathers x 1 byte
    ratio = float(re.search(r"bytes over fsdp per step .*\| +([\d.]+)$", out, re.M).group(1))
    assert 0.95 <= ratio <= 1.05, out
    assert "plan fsdp8-bfloat16-fp8" in out
