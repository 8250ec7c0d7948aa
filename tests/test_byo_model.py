"""Bring your own model: a model jaxpar has never seen (conv stem, nnx.MultiHeadAttention,
nnx.LayerNorm, nnx.Linear, odd sizes, plain nnx.with_partitioning names, blocks stacked with
nnx.vmap and run by jaxpar.scan_blocks) under every strategy, explicit data parallelism and
pipelines, against the single-device run.

Tolerances: the strategies train with plain SGD, so the parameters after n steps are
``p0 - lr * (sum of the n gradients)``: comparing the updates ``p_n - p0`` elementwise at
rtol 1e-4 (+ 1e-6 of the largest update, for gradients that are exactly zero in exact
arithmetic, like the attention key bias's) is a tight comparison of the gradients
themselves, with none of Adam's amplification of round-off in near-zero gradients. The
parameters themselves are stored in fp32, so each of the n steps rounds them to half an ulp
of their size: an update is known to 2 * n ulps of the parameter (a LayerNorm scale near 1.0
carries updates of 1e-4 at 1.2e-7 resolution), which is added to the tolerance per element.
"""
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import jaxpar
from jaxpar.analysis import collectives
from jaxpar.rules import path_str

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("patch_attention", ROOT / "examples" / "patch_attention.py")
pa = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pa)

LR, STEPS, BATCH = 0.1, 3, 16


def model_fn(**kw):
    return lambda: pa.PatchAttentionNet(rngs=nnx.Rngs(0), **kw)


def train(sizes, strategy=jaxpar.Strategy(), steps=STEPS, make=model_fn(), **step_kw):
    """``steps`` SGD steps on one fixed batch: (losses, initial params, final params)."""
    mesh = jaxpar.make_mesh(sizes, devices=jax.devices()[:1] if not sizes else None)
    tx = optax.sgd(LR)
    state, layout = jaxpar.init_train_state(make, tx, mesh, strategy)
    step = jaxpar.make_train_step(pa.loss, tx, layout, strategy, **step_kw)
    start = jax.device_get(state.params)
    batch = jaxpar.shard_batch(pa.batches(0, batch_size=BATCH), mesh)
    losses = []
    for _ in range(steps):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return np.array(losses), start, jax.device_get(state.params)


@pytest.fixture(scope="module")
def reference():
    return train({})


def assert_same_updates(got, ref, steps=STEPS):
    """Losses at rtol 1e-5; updates p_n - p0 (= -lr x summed gradients) at rtol 1e-4, plus 1e-6 of
    the largest update and the fp32 rounding of the stored parameters (2 * steps ulps of |p|)."""
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-5)
    flat = lambda t: dict((path_str(p), np.asarray(v)) for p, v in jax.tree_util.tree_flatten_with_path(t)[0])  # noqa: E731
    start, ref_end, got_end = flat(ref[1]), flat(ref[2]), flat(got[2])
    scale = max(float(np.abs(ref_end[k] - start[k]).max()) for k in start)
    ulp = np.finfo(np.float32).eps
    for k in start:
        want, have = ref_end[k] - start[k], got_end[k] - flat(got[1])[k]
        bound = 1e-4 * np.abs(want) + 1e-6 * scale + 2 * steps * ulp * np.abs(start[k])
        bad = np.abs(have - want) > bound
        assert not bad.any(), (f"{k}: {int(bad.sum())} of {bad.size} updates differ beyond the bound; worst "
                               f"{float(np.abs(have - want)[bad].max()):.3g} at bound "
                               f"{float(bound[bad][np.argmax(np.abs(have - want)[bad])]):.3g}")


MATRIX = {
    "dp8": ({"data": 8}, {}),
    "zero1": ({"data": 8}, {"zero": 1}),
    "zero2": ({"data": 8}, {"zero": 2}),
    "zero3-accum2": ({"data": 8}, {"zero": 3, "microbatches": 2}),
    "fsdp8": ({"fsdp": 8}, {}),
    "dp2-tp4": ({"data": 2, "tensor": 4}, {}),
    "fsdp4-tp2": ({"fsdp": 4, "tensor": 2}, {}),
    "dp2-zero2-fsdp2-tp2": ({"data": 2, "fsdp": 2, "tensor": 2}, {"zero": 2}),
}


# The exhaustive tier (CI, a third a run) runs these; ZeRO-3, FSDP x TP, DP x ZeRO-2 x FSDP x TP and the GPT's matrix
# (tests/test_equivalence.py) cover the same reductions.
SLOW = {"zero1", "zero2", "fsdp8", "dp2-tp4"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.exhaustive] if n in SLOW else []) for n in MATRIX])
def test_user_model_matches_single_device(name, reference):
    sizes, kw = MATRIX[name]
    got = train(sizes, jaxpar.Strategy(**kw))
    assert got[0][-1] < got[0][0], "loss must go down"
    assert_same_updates(got, reference)


def test_user_model_bf16_compute_trains():
    """bf16 compute with fp32 master weights, explicit FSDP: close to fp32 (bf16 round-off)."""
    got = train({"fsdp": 8}, jaxpar.Strategy(compute_dtype="bfloat16"))
    ref = train({"fsdp": 8})
    np.testing.assert_allclose(got[0], ref[0], rtol=2e-2)
    assert got[0][-1] < got[0][0]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_explicit_by_default_for_fsdp_in_any_compute_dtype(dtype):
    """The stacked blocks are found in the compute dtype too (the step casts the parameters first)."""
    from jaxpar.step._grads import explicit_data_parallel
    strategy = jaxpar.Strategy(compute_dtype=dtype)
    state, layout = jaxpar.init_train_state(model_fn(), optax.sgd(LR), jaxpar.make_mesh({"fsdp": 8}), strategy)
    assert explicit_data_parallel(None, pa.loss, state.params, pa.batches(0, batch_size=BATCH), layout)


def test_explicit_data_parallel_on_two_data_axes_matches(reference):
    got = train({"data": 2, "fsdp": 4}, jaxpar.Strategy(zero=3), explicit_dp=True)
    assert_same_updates(got, reference)


def _compiled(sizes, strategy, make=model_fn(), devices=None, **step_kw):
    mesh = jaxpar.make_mesh(sizes, devices=devices)
    tx = optax.sgd(LR)
    state, layout = jaxpar.init_train_state(make, tx, mesh, strategy)
    step = jaxpar.make_train_step(pa.loss, tx, layout, strategy, **step_kw)
    batch = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), pa.batches(0, batch_size=BATCH))
    return mesh, layout, step.lower(state, batch).compile()


def test_zero3_signature_is_one_flat_gather_and_reduce_scatter_per_layer():
    """ZeRO-3 on data=8 (explicit by default): inside the layer loops one all-gather of the
    layer's whole shardable parameters in the forward, one in the backward, and one
    reduce-scatter of its gradients; the unshardable leaves (odd sizes) are all-reduced."""
    mesh, layout, compiled = _compiled({"data": 8}, jaxpar.Strategy(zero=3))
    in_loop = [c for c in collectives(compiled, mesh) if c.in_loop and c.axes == ("data",)]
    gathers = [c for c in in_loop if c.kind == "all-gather"]
    scatters = [c for c in in_loop if c.kind == "reduce-scatter"]
    blocks_specs, blocks_shapes = layout.params["blocks"], layout.shapes["blocks"]
    shardable = sum(4 * np.prod(s.shape[1:]) for s, sp in zip(jax.tree.leaves(blocks_shapes),
                    jax.tree.leaves(blocks_specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)))
                    if "data" in jax.tree.leaves(tuple(sp)))
    assert shardable > 0
    assert [g.bytes for g in gathers] == [shardable] * 2, "one flat gather per layer, forward and backward"
    assert len(scatters) == 1 and scatters[0].bytes * 8 == shardable, "one flat reduce-scatter per layer"


def test_xla_path_has_no_per_layer_gather_loop_collectives_of_ours():
    """explicit_dp=False leaves the collectives to XLA: no flat all-gather of the whole layer."""
    mesh, layout, compiled = _compiled({"data": 8}, jaxpar.Strategy(zero=3), explicit_dp=False)
    in_loop = [c for c in collectives(compiled, mesh) if c.in_loop and c.kind == "reduce-scatter"]
    assert not in_loop, "XLA:CPU lowers gradient reductions as all-reduce + slice"


class ScannedByNNX(pa.PatchAttentionNet):
    """The same model, but running its stacked blocks with nnx.scan itself."""

    def __call__(self, images):
        x = self.stem(images)
        x = x.reshape(x.shape[0], -1, x.shape[-1]) + self.pos[...]

        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def forward(h, block):
            return block(h)

        x = forward(x, self.blocks)
        return self.head(self.norm(x).mean(axis=1))


def test_explicit_dp_where_it_cannot_apply_is_a_named_error():
    make = lambda: ScannedByNNX(rngs=nnx.Rngs(0))   # noqa: E731
    with pytest.raises(jaxpar.ExplicitDPError, match=r"stacked on 'layers' but the model does not run them "
                                                     r"through jaxpar.scan_blocks"):
        _compiled({"data": 8}, jaxpar.Strategy(zero=3), make=make, explicit_dp=True)
    with pytest.raises(jaxpar.ExplicitDPError, match=r"no data axis"):
        _compiled({"tensor": 2}, jaxpar.Strategy(), devices=jax.devices()[:2], explicit_dp=True)
    with pytest.raises(jaxpar.ExplicitDPError, match=r"with pipe=2"):
        _compiled({"pipe": 2, "data": 4}, jaxpar.Strategy(microbatches=2), explicit_dp=True)


def test_model_scanned_by_nnx_still_trains_by_default(reference):
    """Left to decide (explicit_dp=None), a model with its own nnx.scan gets XLA's collectives."""
    got = train({"data": 8}, jaxpar.Strategy(zero=3), make=lambda: ScannedByNNX(rngs=nnx.Rngs(0)))
    assert_same_updates(got, reference)


PIPELINES = {
    "1f1b": {"microbatches": 4},
    "1f1b-zero3": {"microbatches": 4, "zero": 3},
    "interleaved": {"microbatches": 4, "schedule": "interleaved", "virtual_stages": 2},
    "1f1b-auto": {"microbatches": 4, "stage_layers": "auto"},
}


@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.exhaustive] if n in ("1f1b", "interleaved") else [])
                                  for n in PIPELINES])   # 1f1b in 1f1b-zero3; interleaved in tests/test_pipeline.py
def test_user_model_pipelined_matches_single_device(name, reference):
    """pipe=2 x data=2 x tensor=2 with the user's own loss function."""
    got = train({"pipe": 2, "data": 2, "tensor": 2}, jaxpar.Strategy(**PIPELINES[name]))
    assert_same_updates(got, reference)


def test_auto_stage_layers_measure_the_users_layers():
    """'auto' balances the compiled cost of the user's own layer against what runs before and
    after the blocks: a heavy head (many classes) gets fewer layers on the last stage."""
    from jaxpar.parallel.pipeline._cut import cut_model
    from jaxpar.parallel.pipeline._piped import auto_stage_layers

    def stages(**kw):
        mesh = jaxpar.make_mesh({"pipe": 4, "data": 2})
        _, layout = jaxpar.init_train_state(model_fn(layers=8, **kw), optax.sgd(LR), mesh,
                                            jaxpar.Strategy(microbatches=4))
        mb = jax.tree.map(lambda a: jax.ShapeDtypeStruct((4, *a.shape[1:]), a.dtype),
                          pa.batches(0, batch_size=4, classes=kw.get("classes", 5)))
        cut = cut_model(pa.loss, layout.graphdef, layout.shapes, mb)
        return auto_stage_layers(cut, *cut.split(layout.shapes), mb, 4)

    assert stages() == (2, 2, 2, 2)
    heavy = stages(classes=4000)
    assert sum(heavy) == 8 and heavy[-1] < 2, heavy


def test_import_jaxpar_does_not_load_the_bundled_models():
    code = "import jaxpar, sys; assert 'jaxpar.models' not in sys.modules, sorted(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})


@pytest.mark.parametrize("target", ["h100:1x8", "tpu-v5e:2x4"])
def test_explicit_dp_is_not_the_default_on_gpu_and_tpu(target):
    """On the GPU and TPU compilers XLA's own data-parallel collectives are combined and scheduled
    under compute (docs/explicit_dp.md): explicit_dp=None leaves them to XLA there, for the same
    FSDP model that is explicit by default on CPU (the test above)."""
    from jaxpar.devices import parse_target, target_devices
    from jaxpar.step._grads import explicit_data_parallel
    from jaxpar.step import state_layout

    mesh = jaxpar.make_mesh({"fsdp": 8}, devices=target_devices(parse_target(target)))
    layout = state_layout(model_fn(), optax.sgd(LR), mesh, jaxpar.Strategy())
    batch = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), pa.batches(0, batch_size=BATCH))
    params = layout.abstract_state().params
    assert not explicit_data_parallel(None, pa.loss, params, batch, layout)
    assert explicit_data_parallel(True, pa.loss, params, batch, layout)     # still honoured when asked
