"""jaxpar.cost against published tables and hand-computed values (pure Python)."""
import math
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from jaxpar import cost, devices

from jaxpar.cost import _collectives as C
from jaxpar.cost import PRECISIONS, activation_bytes_per_layer, zero_state_bytes
from jaxpar.cost._schedule import closed_form_stats, schedule_stats
from jaxpar.cost import gpt
from jaxpar.cost import narayanan_flops, step_flops
from jaxpar.parallel.pipeline import bubble_fraction, get_schedule, peak_in_flight
from jaxpar.strategy import Strategy
from jaxpar.options import ContextParallel

GB = 1e9
ROOT = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- published tables
# ZeRO (Rajbhandari et al. 2020) Table 1, Psi = 7.5B, K = 12, GB per device: DP, P_os, P_os+g, P_os+g+p.
ZERO_TABLE_1 = {1: (120, 120, 120, 120), 4: (120, 52.5, 41.3, 30), 16: (120, 35.6, 21.6, 7.5),
                64: (120, 31.4, 16.6, 1.88), 256: (120, 30.4, 15.4, 0.47), 1024: (120, 30.1, 15.1, 0.12)}


@pytest.mark.parametrize("n_d", sorted(ZERO_TABLE_1))
def test_zero_table_1(n_d):
    got = [zero_state_bytes(7.5e9, n_d, stage)["total"] / GB for stage in (0, 1, 2, 3)]
    for g, want in zip(got, ZERO_TABLE_1[n_d]):
        digits = len(str(want).split(".")[1]) if "." in str(want) else 0
        assert abs(g - want) <= 0.5 * 10**-digits + 1e-9, (n_d, got)     # the paper's value is g rounded


def test_zero_table_1_n64_exact():
    got = [zero_state_bytes(7.5e9, 64, s)["total"] / GB for s in (0, 1, 2, 3)]
    assert got == pytest.approx([120, 31.40625, 16.640625, 1.875], rel=1e-12)


@pytest.mark.parametrize("psi,mixed,fp32_accum", [(1e9, 16, 20), (7e9, 112, 140), (70e9, 1120, 1400),
                                                  (405e9, 6480, 8100)])
def test_ultrascale_playbook_memory(psi, mixed, fp32_accum):
    for name, want in (("mixed", mixed), ("mixed-fp32-accum", fp32_accum)):
        bp = PRECISIONS[name]
        got = zero_state_bytes(psi, 1, 0, param_bytes=bp.param, grad_bytes=bp.grad, opt_bytes=bp.opt)["total"]
        assert got / GB == pytest.approx(want, rel=1e-12)
    assert PRECISIONS["megatron"].k == 18 and PRECISIONS["mixed"].k == 16


@pytest.mark.parametrize("B,s,l,h,V", [(1536, 2048, 96, 12288, 51200), (512, 2048, 40, 6144, 51200),
                                       (8, 1024, 12, 768, 50304)])
def test_narayanan_flops(B, s, l, h, V):
    want = 96 * B * s * l * h**2 * (1 + s / (6 * h) + V / (16 * l * h))
    assert narayanan_flops(B, s, l, h, V) == want
    assert step_flops(gpt(l, h, h // 64, s, V, B), "full") == pytest.approx(want, rel=1e-12)
    # no recomputation: 3/4 of the layers' FLOPs, the same logits
    assert step_flops(gpt(l, h, h // 64, s, V, B), "none") == pytest.approx(
        72 * B * s * l * h**2 * (1 + s / (6 * h)) + 6 * B * s * h * V, rel=1e-12)


SCHEDULE_GRID = [(k, p, m, v) for k in ("gpipe", "1f1b", "zb-h1") for p in (2, 3, 4, 8) for m in (p, 2 * p, 3 * p)
                 for v in (1,)] + [("interleaved", p, m, 2) for p in (2, 4) for m in (p, 2 * p, 4 * p)] + [
    (k, 16, 32, 1) for k in ("gpipe", "1f1b", "zb-h1")] + [("interleaved", 8, 32, 2)]   # beyond TABLE_LIMIT


@pytest.mark.parametrize("kind,p,m,v", SCHEDULE_GRID)
def test_bubble_is_the_tables(kind, p, m, v):
    s = get_schedule(kind, p, m, v)
    table = (float(bubble_fraction(s)), peak_in_flight(s)[0])
    assert schedule_stats(kind, p, m, v) == (pytest.approx(table[0], abs=1e-15), table[1])
    assert closed_form_stats(kind, p, m, v)[0] == pytest.approx(table[0], abs=1e-15)
    assert closed_form_stats(kind, p, m, v)[1] == table[1]


def test_korthikanti_activations():
    s, b, h, a, t = 2048, 1, 12288, 96, 8
    assert activation_bytes_per_layer(s, b, h, a) == s * b * h * (34 + 5 * a * s / h)
    assert activation_bytes_per_layer(s, b, h, a, tensor=t) == s * b * h * (10 + 24 / t + 5 * a * s / (h * t))
    assert activation_bytes_per_layer(s, b, h, a, tensor=t, sequence_parallel=True) == pytest.approx(
        s * b * h / t * (34 + 5 * a * s / h))
    assert activation_bytes_per_layer(s, b, h, a, tensor=t, sequence_parallel=True, remat="save-matmuls") == \
        pytest.approx(34 * s * b * h / t)
    assert activation_bytes_per_layer(s, b, h, a, remat="full") == 2 * s * b * h


# ----------------------------------------------------------------------------- collectives
LINK = C.Link(alpha=5e-6, beta=1e-10, gamma=2e-11)
SIZES = [2**10, 2**16, 2**20, 2**26, 2**30]
PS = [2, 8, 64, 1000]


def hand(kind, alg, n, p):
    a, b, g = LINK.alpha, LINK.beta, LINK.gamma
    lg, q = math.ceil(math.log2(p)), 2 ** int(math.log2(p))
    fold = (2 * a + 2 * n * b + n * g) if p != q else 0
    return {
        ("all-reduce", "ring"): 2 * (p - 1) * a + 2 * (p - 1) / p * n * b + (p - 1) / p * n * g,
        ("all-reduce", "tree"): 2 * lg * (a + n * b) + lg * n * g,
        ("all-reduce", "recursive-doubling"): math.log2(q) * (a + n * b + n * g) + fold,
        ("all-reduce", "rabenseifner"): 2 * math.log2(q) * a + 2 * (q - 1) / q * n * b + (q - 1) / q * n * g + fold,
        ("all-reduce", "lower-bound"): lg * a + 2 * (p - 1) / p * n * b + (p - 1) / p * n * g,
        ("all-gather", "ring"): (p - 1) * a + (p - 1) / p * n * b,
        ("all-gather", "bruck"): lg * a + (p - 1) / p * n * b,
        ("reduce-scatter", "ring"): (p - 1) * a + (p - 1) / p * n * (b + g),
        ("reduce-scatter", "lower-bound"): lg * a + (p - 1) / p * n * (b + g),
        ("all-to-all", "pairwise"): (p - 1) * a + (p - 1) / p * n * b,
        ("collective-permute", "direct"): a + n * b,
    }[(kind, alg)]


HAND_CASES = ["all-reduce/ring", "all-reduce/tree", "all-reduce/recursive-doubling", "all-reduce/rabenseifner",
              "all-reduce/lower-bound", "all-gather/ring", "all-gather/bruck", "reduce-scatter/ring",
              "reduce-scatter/lower-bound", "all-to-all/pairwise", "collective-permute/direct"]


@pytest.mark.parametrize("case", HAND_CASES)
@pytest.mark.parametrize("p", PS)
def test_algorithms_against_hand_values(case, p):
    kind, alg = case.split("/")
    for n in SIZES:
        assert C.time(kind, n, p, LINK, alg) == pytest.approx(hand(kind, alg, n, p), rel=1e-12), (n, p)


def test_hand_spot_values():
    # p = 8, n = 1 MiB: ring all-reduce = 14 alpha + 1.75 n beta + 0.875 n gamma
    n = 2**20
    assert C.time("all-reduce", n, 8, LINK, "ring") == pytest.approx(14 * 5e-6 + 1.75 * n * 1e-10 + 0.875 * n * 2e-11)
    assert C.time("all-gather", n, 8, LINK, "recursive-doubling") == pytest.approx(3 * 5e-6 + 0.875 * n * 1e-10)
    assert C.time("reduce-scatter", n, 8, LINK, "recursive-halving") == pytest.approx(3 * 5e-6 + 0.875 * n * 1.2e-10)


@pytest.mark.parametrize("p", PS)
def test_ring_all_reduce_tends_to_2_s_beta(p):
    n = 2**40
    ratio = C.time("all-reduce", n, p, C.Link(1e-6, 1e-10), "ring") / (2 * n * 1e-10)
    assert ratio == pytest.approx((p - 1) / p, rel=1e-4)      # the latency 2(p-1)alpha vanishes
    assert C.time("all-reduce", 2**50, 10**6, C.Link(1e-6, 1e-10), "ring") / (2 * 2**50 * 1e-10) == pytest.approx(1, rel=2e-5)


@pytest.mark.parametrize("kind", C.KINDS)
@pytest.mark.parametrize("p", PS)
def test_lower_bound_never_above_an_algorithm(kind, p):
    for n in SIZES + [1, 3, 1000]:
        times = C.algorithm_times(kind, n, p, LINK)
        bound = times.pop("lower-bound")
        assert all(bound <= t * (1 + 1e-12) for t in times.values()), (kind, n, p, times, bound)


@pytest.mark.parametrize("p", [8, 64, 1000])
def test_small_sizes_recursive_doubling_large_sizes_ring_or_rabenseifner(p):
    assert C.best("all-reduce", 2**10, p, LINK)[0] == "recursive-doubling"
    assert C.best("all-reduce", 2**30, p, LINK)[0] in ("ring", "rabenseifner")


def test_cost_modules_import_no_jax():
    """The modules of jaxpar/cost (and the pure pipeline tables / analysis helpers they use), and the HLO
    readers that compare compiled programs with them (jaxpar.analysis._loops, jaxpar.analysis._axis_bytes), load
    without JAX. ``import jaxpar.cost`` would run jaxpar/__init__.py, which imports JAX, so a fresh interpreter
    registers the parent packages as empty namespace packages and imports jaxpar.cost by itself."""
    code = f"""
import sys, types
root = {str(ROOT / 'jaxpar')!r}
for name, path in (("jaxpar", root), ("jaxpar.parallel", root + "/parallel"),
                   ("jaxpar.parallel.pipeline", root + "/parallel/pipeline"), ("jaxpar.analysis", root + "/analysis")):
    mod = types.ModuleType(name); mod.__path__ = [path]; sys.modules[name] = mod
import jaxpar.cost, jaxpar.cost._planner, jaxpar.analysis._loops, jaxpar.analysis._axis_bytes
r = jaxpar.cost.plan(jaxpar.cost.gpt(2, 32, 8, 16, 64, 16), jaxpar.cost.load_cluster("h100"))
bad = sorted(m for m in sys.modules if m == "jax" or m.startswith(("jax.", "flax", "optax")))
assert not bad, bad
print("ok", r.best.plan.name())
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ok")


# ----------------------------------------------------------------------------- shared-memory links
SHM = C.Link(alpha=2e-4, beta=1e-9, gamma=1e-10, shared_memory=True)


@pytest.mark.parametrize("p", PS)
def test_shared_memory_algorithms_against_hand_values(p):
    a, b, g = SHM.alpha, SHM.beta, SHM.gamma
    f = (p - 1) / p
    for n in SIZES:
        assert C.time("all-reduce", n, p, SHM, "one-shot") == pytest.approx(a + (p - 1) * n * (b + g), rel=1e-12)
        assert C.time("all-reduce", n, p, SHM, "two-shot") == pytest.approx(2 * a + 2 * f * n * b + f * n * g, rel=1e-12)
        assert C.time("reduce-scatter", n, p, SHM, "one-shot") == pytest.approx(a + f * n * (b + g), rel=1e-12)
        for kind in ("all-gather", "all-to-all"):
            assert C.time(kind, n, p, SHM, "one-shot") == pytest.approx(a + f * n * b, rel=1e-12)
        assert C.time("collective-permute", n, p, SHM, "one-shot") == pytest.approx(a + n * b, rel=1e-12)


def test_shared_memory_link_chooses_one_shot_small_two_shot_large():
    assert set(C.algorithm_times("all-reduce", 1024, 8, SHM)) == {"one-shot", "two-shot"}
    assert C.best("all-reduce", 1024, 8, SHM)[0] == "one-shot"
    assert C.best("all-reduce", 2**30, 8, SHM)[0] == "two-shot"
    assert C.best("all-reduce", 1024, 8, C.Link(2e-4, 1e-9))[0] == "recursive-doubling"   # a network link


def test_cpu_sim_preset_is_calibrated_and_shared():
    from jaxpar import cost

    c = cost.load_cluster("cpu_sim")
    assert c.intra.shared_memory and c.shared_compute > 1 and c.memory_bandwidth > 0
    assert any("benchmarks/calibrate.py" in s for s in c.sources)
    alone = c.with_devices(1)
    assert alone.peak("float32") == pytest.approx(c.peak("float32") * min(8, c.shared_compute))
    assert alone.memory_bandwidth == c.memory_bandwidth        # measured with 8 busy devices only
    h = cost.load_cluster("h100")
    assert h.with_devices(1).peak("bfloat16") == h.peak("bfloat16")       # GPUs do not share compute


@pytest.mark.parametrize("key,value,match", [
    ("shared_compute", 0.5, r"shared_compute=0.5 must be a number >= 1"),
    ("memory_gbps", -1, r"memory_gbps=-1 must be a number >= 0"),
])
def test_bad_shared_compute_and_memory_bandwidth(key, value, match):
    from jaxpar.cost import ClusterError
    from jaxpar.cost import cluster_from_dict

    d = {"devices_per_node": 8, "device_memory_gib": 80, "peak_tflops": {"bfloat16": 989},
         "intra_node": {"alpha_us": 10, "bandwidth_gbps": 450}, key: value}
    with pytest.raises(ClusterError, match=match):
        cluster_from_dict(d, "mine")


def test_optimizer_update_is_memory_bound_and_sharded_by_zero():
    from jaxpar import cost
    from jaxpar.cost import Plan
    from jaxpar.cost import step_time
    from jaxpar.cost._time import update_bytes

    m = cost.gpt(12, 768, 12, 1024, 50304, 64)
    h = cost.load_cluster("h100")
    dp, z2 = step_time(m, Plan(data=8), h), step_time(m, Plan(data=8, strategy=Strategy(zero=2)), h)
    assert dp.optimizer == pytest.approx(update_bytes(m, Plan(data=8), 2) / 3350e9)
    assert z2.optimizer == pytest.approx(dp.optimizer / 8, rel=0.02)      # small unsplittable leaves stay whole


def test_elementwise_term_repeats_the_residual_stream_under_tp_and_splits_it_under_sp():
    """Per token and layer, forward: 10h (norms, residual adds) + 2f (bias, GELU) values in the compute
    dtype and 2·a·s fp32 softmax values; training moves 3x that. TP splits f and a, SP also h."""
    from jaxpar import cost
    from jaxpar.cost import Plan
    from jaxpar.cost import step_time
    from jaxpar.cost._time import elementwise_bytes

    m = gpt(4, 128, 8, 64, 256, 16)
    h, f, a, s, tokens = 128, 512, 8, 64, 16 * 64 * 4
    per = lambda rh, t: 3 * tokens * ((rh + 2 * f / t) * 4 + 2 * a * s / t * 4)   # noqa: E731
    assert elementwise_bytes(m, Plan(), 4) == per(10 * h, 1)
    assert elementwise_bytes(m, Plan(tensor=8), 4) == per(10 * h, 8)
    assert elementwise_bytes(m, Plan(tensor=8, strategy=Strategy(sequence_parallel=True)), 4) == per(10 * h / 8, 8)
    assert elementwise_bytes(m, Plan(data=8), 4) == per(10 * h, 1) / 8
    c = cost.load_cluster("cpu_sim")
    tp, sp = (step_time(m, Plan(tensor=8, strategy=Strategy(sequence_parallel=q)), c, dtype="float32")
              for q in (False, True))
    assert tp.elementwise == pytest.approx(elementwise_bytes(m, Plan(tensor=8), 4) / c.memory_bandwidth)
    assert tp.elementwise > 3 * sp.elementwise and tp.total == pytest.approx(
        tp.compute + tp.elementwise + tp.data + tp.tensor + tp.pipeline + tp.optimizer)


def test_a_flash_kernel_moves_no_softmax_bytes_and_computes_half_the_causal_scores():
    from jaxpar.cost._roofline import layer_elementwise_bytes, layer_kernels
    m, plan = cost.gpt(4, 1024, 16, 4096, 256, 8), cost.Plan()
    softmax = 3 * 4096 * (2 * 16 * 4096 * 4)            # per token: 2 a s fp32 values, forward and backward
    assert (layer_elementwise_bytes(m, plan, 1, 2) - layer_elementwise_bytes(m, plan, 1, 2, fused_attention=True)
            == softmax)
    xla = {k.name: k for k in layer_kernels(m, plan, 1, 2)}
    flash = {k.name: k for k in layer_kernels(m, plan, 1, 2, fused_attention=True)}
    assert flash["scores"].flops * 2 == xla["scores"].flops and flash["scores"].passes == xla["scores"].passes + 1
    assert flash["context"].flops * 2 == xla["context"].flops and flash["context"].passes == xla["context"].passes
    selective = {k.name: k.passes for k in layer_kernels(m, cost.Plan(remat="save-matmuls"), 1, 2, fused_attention=True)}
    assert selective["scores"] == 4 and selective["context"] == 3      # save-matmuls keeps the kernel's residuals
    ring = cost.Plan(context=4, strategy=Strategy(context=ContextParallel(balance=True)))   # the flash blocks
    assert ({k.name: k.flops for k in layer_kernels(m, ring, 1, 2)}
            == {k.name: k.flops for k in layer_kernels(m, ring, 1, 2, fused_attention=True)})
    blocks = {k.name: k.passes for k in layer_kernels(m, ring, 1, 2, fused_attention=True)}
    assert blocks["scores"] == 5 and blocks["context"] == 4    # one more pass of each: the dQ and dK/dV kernels
    assert cost.load_cluster("h100").fused_attention and not cost.load_cluster("tpu_v5e").fused_attention
    with pytest.raises(cost.ClusterError, match="fused_attention='yes' must be true or false"):
        cost.cluster_from_dict({**yaml.safe_load(cost.presets()["h100"].read_text()), "fused_attention": "yes"})


def test_the_device_calibration_fits_the_gemm_curve_and_writes_a_cluster(tmp_path):
    """``e * w / (w + h)`` through exact points is recovered; a run on this CPU (tiny GEMMs) writes a YAML that
    loads as a cluster with the base preset's links and peaks and the measured rates."""
    e, h, peak = 0.75, 3e9, 1e15
    points = [(w, w / (peak * e * w / (w + h))) for w in (1e9, 1e10, 1e11, 1e12)]
    fit = cost.fit_gemm_efficiency(points, peak)
    assert fit == {"efficiency": 0.75, "gemm_half_gflop": 3.0, "max_rel_residual": 0.0}
    out = tmp_path / "measured.yaml"
    got = devices.calibrate_device(out, reps=2, shapes=((64, 64, 64), (128, 128, 128)), stream_bytes=2**20,
                                host_bytes=2**20, say=lambda _: None)
    c, h100 = cost.load_cluster(out), cost.load_cluster("h100")
    assert c.name == "h100_measured" and c.intra == h100.intra and c.peak_flops == h100.peak_flops and c.fused_attention
    assert c.efficiency == got["fit"]["efficiency"] and c.memory_bandwidth == round(got["stream_gbps"]) * 1e9
    assert len(got["gemms"]) == 2 and "measured" in c.description
    link, update = got["host"]["link_gbps"], got["host"]["update_gbps"]       # this CPU's memcpy and Adam
    assert c.host_link == round(link, 1) * 1e9 and c.host_memory_bandwidth == round(update, 1) * 1e9
    assert min(got["host"]["to_device_gbps"], got["host"]["to_host_gbps"]) <= link <= max(
        got["host"]["to_device_gbps"], got["host"]["to_host_gbps"])
