"""The grouped expert GEMMs (jaxpar.parallel.moe._grouped, Pallas Triton) against the tile loop they replace on a
GPU mesh: run in Pallas's interpreter on the CPU, the forward and every gradient (x, the combine weights, w1, w2,
w3) equal the tile loop's at fp32 1e-5, at three routings (balanced, skewed, one expert empty and some choices
dropped), plain and gated, on one device and under expert parallelism (the exchange's rounds); which kernel each
platform gets. Compiled deviceless for ``h100:1x8`` (slow): a 2-layer Qwen3-MoE step on ``expert 8`` runs the
experts' GEMMs as grouped kernels, at most 3 a layer forward and 6 backward beside the recomputation, with no loop
whose trip count is the routing's but the exchange's rounds, and GEMM work within 1.10x of its dense twin's."""
from __future__ import annotations

import functools
import json
from collections import Counter
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax.sharding import NamedSharding, PartitionSpec as P

from conftest import need_devices
import jaxpar
from jaxpar.analysis import dot_flops, grouped_calls, grouped_flops, routing_loops, while_trip_counts
from jaxpar.devices import parse_target, target_devices
from jaxpar.errors import MoEError
from jaxpar.parallel.moe import dispatch_combine, expert_rules, routed_mlp, send_rows, use_moe_kernel
from jaxpar.parallel.moe._grouped import Kernel, choose_moe_kernel
from jaxpar.plan import expert_lines

ROOT = Path(__file__).resolve().parents[1]
E, ROWS, D, M, TILE = 4, 64, 32, 64, 16     # experts, routed choices (32 tokens x top-2), embed, hidden, tile
TOL = dict(rtol=1e-5, atol=1e-5)
#: Each routing's choices per expert (the rest of the 64: dropped, expert E).
ROUTINGS = {"balanced": (16, 16, 16, 16), "skewed": (37, 13, 9, 5), "one-empty": (20, 17, 0, 19)}


def _experts(counts) -> jnp.ndarray:
    e = np.concatenate([np.full(c, i) for i, c in enumerate(counts)] + [np.full(ROWS - sum(counts), E)])
    return jnp.asarray(np.random.default_rng(1).permutation(e), jnp.int32)


def _weights(gated: bool, seed: int = 0) -> tuple:
    k = jax.random.split(jax.random.key(seed), 3)
    w = lambda key, shape: jax.random.normal(key, shape) / np.sqrt(shape[1])    # noqa: E731
    return w(k[0], (E, D, M)), w(k[1], (E, M, D)), w(k[2], (E, D, M)) if gated else None


def _routed_grads(kernel: str, counts, gated: bool):
    x = jax.random.normal(jax.random.key(2), (ROWS // 2, D))
    rows, expert = jnp.repeat(jnp.arange(ROWS // 2), 2), _experts(counts)
    weight = jax.random.uniform(jax.random.key(3), (ROWS,))
    probe = jax.random.normal(jax.random.key(4), x.shape)

    def loss(x, weight, w1, w2, w3):
        y = routed_mlp(x, rows, weight, expert, w1, w2, w3, activation="silu" if gated else "gelu", tile=TILE)
        return jnp.sum(y * probe)
    with use_moe_kernel(kernel):
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))(x, weight, *_weights(gated))


@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
@pytest.mark.parametrize("routing", list(ROUTINGS))
def test_the_grouped_kernels_equal_the_tile_loop_forward_and_every_gradient(routing, gated):
    got, want = (_routed_grads(k, ROUTINGS[routing], gated) for k in ("grouped", "loop"))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, **TOL)
    if routing == "one-empty":
        dw1 = got[1][2]
        assert not np.any(dw1[2]) and np.all(np.abs(dw1).sum((1, 2))[[0, 1, 3]] > 0)


@need_devices(4)
def test_under_expert_parallelism_the_grouped_kernels_equal_the_tile_loop():
    """EP 4 (the exchange's all_to_all, then the kernels on each device's received rows), gated, a routing that
    sends one peer more than a round holds: the forward and every gradient equal the tile loop's."""
    mesh = jaxpar.make_mesh({"expert": 4}, devices=jax.devices()[:4])
    rules = (("batch", "expert"), ("length", None), ("embed", None), ("mlp", None)) + expert_rules(mesh.axis_names)
    G, T, k = 4, 16, 2
    x = jax.random.normal(jax.random.key(5), (G, T, D))
    logits = jax.random.normal(jax.random.key(6), (G, T, E)).at[..., 0].add(3.0)    # skewed towards expert 0
    weight, expert = jax.lax.top_k(jax.nn.softmax(logits), k)
    slot = jnp.zeros(expert.shape, jnp.int32)
    probe = jax.random.normal(jax.random.key(7), x.shape)
    assert int((expert == 0).sum((1, 2)).max()) > send_rows(1, T, k, E, 4, T, dropless=True)    # 2 rounds

    def loss(x, weight, w1, w2, w3):
        return jnp.sum(dispatch_combine(x, expert, slot, weight, w1, w2, w3=w3, capacity=T, activation="silu")
                       * probe)
    out = {}
    for kernel in ("grouped", "loop"):
        with use_moe_kernel(kernel), jaxpar.use_rules(mesh, rules):
            grad = jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4))
            args = (x, weight, *_weights(True, 8))
            assert ("pallas_call" in str(jax.make_jaxpr(grad)(*args))) == (kernel == "grouped")
            out[kernel] = jax.jit(grad)(*args)
    for g, w in zip(jax.tree.leaves(out["grouped"]), jax.tree.leaves(out["loop"])):
        np.testing.assert_allclose(g, w, **TOL)


def test_each_platform_gets_its_kernel_and_a_kernel_that_cannot_run_is_named():
    grouped, interpreted = Kernel(grouped=True), Kernel(grouped=True, interpret=True)
    assert [choose_moe_kernel(p, 128, 2048, 768, "auto") for p in ("cuda", "gpu", "cpu", "tpu")] == [
        grouped, grouped, Kernel(), Kernel()]
    assert choose_moe_kernel("cpu", 32, 2048, 768, "grouped") == interpreted
    assert choose_moe_kernel("cuda", 128, 2048, 768, "loop") == Kernel()
    assert choose_moe_kernel("cuda", 128, 2048, 100, "auto") == Kernel()         # the tile loop where it cannot run
    with pytest.raises(MoEError, match=r"hidden size 100 .*use_moe_kernel\('auto'\)"):
        choose_moe_kernel("cuda", 128, 2048, 100, "grouped")
    with pytest.raises(MoEError, match="tile 24 rows"):
        choose_moe_kernel("cuda", 24, 2048, 768, "grouped")
    with pytest.raises(MoEError, match="kernel='triton' is not an MoE kernel"):
        with use_moe_kernel("triton"):
            pass
    with use_moe_kernel("grouped"):
        assert "pallas_call" in str(jax.make_jaxpr(functools.partial(
            routed_mlp, rows=jnp.arange(4), weight=jnp.ones(4), expert=jnp.zeros(4, jnp.int32),
            tile=16))(jnp.ones((4, D)), w1=jnp.ones((1, D, M)), w2=jnp.ones((1, M, D))))


def _target_mesh(target: str, axes: dict):
    return jaxpar.make_mesh(axes, devices=target_devices(parse_target(target)))


@pytest.mark.parametrize("target", ["h100:1x1", pytest.param("a100-80gb:1x1", marks=pytest.mark.exhaustive),
                                    pytest.param("b200:1x1", marks=pytest.mark.exhaustive)])
def test_a_gated_moe_layer_compiled_for_a_gpu_runs_three_grouped_kernels_forward_and_six_backward(target):
    """Deviceless, 8 gated experts on one GPU, bf16 and fp32 (smaller blocks): the forward and backward of the
    routed experts are the grouped kernels' custom calls, 3 and 6, and every loop's trip count is known."""
    mesh = _target_mesh(target, {"data": 1})
    rules = (("batch", None), ("length", None), ("embed", None), ("mlp", None)) + expert_rules(mesh.axis_names)
    spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P()))  # noqa: E731
    G, T, k, experts, d, m = 2, 512, 2, 8, 256, 128

    def loss(x, weight, w1, w2, w3, expert):
        y = dispatch_combine(x, expert, jnp.zeros(expert.shape, jnp.int32), weight, w1, w2, w3=w3, capacity=T,
                             activation="silu")
        return jnp.sum(y.astype(jnp.float32))
    for dtype in (jnp.bfloat16, jnp.float32):
        args = (spec((G, T, d), dtype), spec((G, T, k), jnp.float32), spec((experts, d, m), dtype),
                spec((experts, m, d), dtype), spec((experts, d, m), dtype), spec((G, T, k), jnp.int32))
        with jaxpar.use_rules(mesh, rules):
            compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4))).lower(*args).compile()
        text = compiled.as_text()
        assert Counter(c.kernel for c in grouped_calls(text)) == {
            "moe_grouped_matmul": 3, "moe_grouped_matmul_t": 3, "moe_grouped_wgrad": 3}, dtype
        loops = [line for line in text.splitlines() if " while(" in line]       # searchsorted's: 4 trips
        assert routing_loops(text) == [] and len(loops) == len(while_trip_counts(text)), dtype
    rows = G * T * k + experts * 128                  # what inspect's experts line says they compute
    line = expert_lines(experts, k, G * T, mesh, compiled)[0]
    assert (f"grouped kernels (Pallas Triton), 9 calls per device per step, no tile loop; they compute "
            f"{9 * rows * 2 * d * m / 1e9:.3g} GFLOP at {rows:,} rows a call") in line, line


def _two_layers(tmp_path, dense: bool) -> str:
    """configs/qwen3_moe_gpu.yaml's model cut to 2 layers (``dense``: its twin, a Qwen3 MLP of 8 x 768)."""
    hf = json.loads((ROOT / "configs/hf/qwen3-moe-24l/config.json").read_text()) | {"num_hidden_layers": 2}
    if dense:
        hf = {key: v for key, v in hf.items() if key not in QWEN3_MOE_KEYS} | {
            "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}
        assert hf["intermediate_size"] == 8 * 768
    path = tmp_path / ("dense" if dense else "moe")
    path.mkdir()
    (path / "config.json").write_text(json.dumps(hf))
    return str(path)


QWEN3_MOE_KEYS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                  "decoder_sparse_step", "mlp_only_layers")


def _compiled_step(model: str, mesh: list[str]) -> str:
    from jaxpar.config import build_job, load_config
    cfg = load_config(str(ROOT / "configs/qwen3_moe_gpu.yaml"), [f"model.hf={model}", *mesh])
    job = build_job(cfg, target_devices(parse_target("h100:1x8")), data=False)
    return job.compile(job.state_layout())["step"].as_text()


@pytest.mark.exhaustive      # an acceptance check (issue 87 / 88) of a minute or more; CI runs it in its share
def test_the_qwen3_moe_step_compiled_for_h100_runs_grouped_kernels_within_1_10x_of_its_dense_twin(tmp_path):
    """configs/qwen3_moe_gpu.yaml with mesh.expert=8 mesh.fsdp=1 on h100:1x8, 2 of its layers (scanned,
    save-matmuls): per layer 3 grouped calls forward, 2 of them again in the backward's recomputation (the w2
    GEMM's output is not needed there) and 6 backward; no loop whose trips are the routing's but the exchange's
    rounds; GEMM work (dots, and each grouped call at the routed rows plus a tile an expert) within 1.10x of the
    twin's (a dense MLP of 8 x 768 on data 8)."""
    moe = _compiled_step(_two_layers(tmp_path, False), ["mesh.expert=8", "mesh.fsdp=1"])
    per_layer = Counter(c.kernel for c in grouped_calls(moe) for _ in range(int(c.runs) // 2))
    assert per_layer == {"moe_grouped_matmul": 3 + 2, "moe_grouped_matmul_t": 3, "moe_grouped_wgrad": 3}
    assert routing_loops(moe) == []
    twin = _compiled_step(_two_layers(tmp_path, True), ["mesh.data=8", "mesh.fsdp=1"])
    rows = 16 * 4096 * 8 / 8 + 128 / 8 * 128          # a device's routed rows, and a tile of each local expert
    ratio = (dot_flops(moe, 0.0) + grouped_flops(moe, rows)) / dot_flops(twin)
    print(f"GEMM work vs the dense twin: {ratio:.3f}")
    assert 1.0 < ratio <= 1.10
