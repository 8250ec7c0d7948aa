"""The gradient noise scale: the estimator against an analytic value, the data-parallel
measurement against explicitly materialised per-replica gradients, the moving averages through a
checkpoint, the logged metrics and PNG, and the errors for bad options."""
import json
import os
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxpar
from jaxpar.config import check
from jaxpar.config import ConfigError, JobConfig, LoggingConfig, MeshConfig, ParallelConfig
from jaxpar.config._schema import NoiseScaleConfig
from jaxpar.models import GPT, lm_loss
from jaxpar.models import MLPClassifier, classifier_loss
from jaxpar.step import _noise_scale as ns
from jaxpar.run import Checkpointer
from jaxpar.run import LogOptions, train

from conftest import need_devices
from helpers import CFG, make_batch, mesh_for

pytestmark = need_devices(8)


def _mesh(sizes):
    return jaxpar.make_mesh(sizes, devices=jax.devices()[:int(np.prod(list(sizes.values())))])


class LinearModel(nnx.Module):
    def __init__(self, d: int, rngs: nnx.Rngs):
        del rngs
        self.w = nnx.Param(jnp.zeros((d,), jnp.float32))


def linreg_loss(model, batch):
    return 0.5 * jnp.mean((batch["x"] @ model.w[...] - batch["y"]) ** 2)


def test_estimate_matches_analytic_noise_scale_of_linear_regression():
    """Linear regression ``y = w*·x + ε``, ``x ~ N(0, I_d)``, ``ε ~ N(0, σ²)``, per-example loss
    ``½(w·x − y)²``, so the per-example gradient is ``g = (δ·x − ε) x`` with ``δ = w − w*``.

    ``G = E[g] = E[x xᵀ] δ = δ``. For Gaussian ``x``, ``E[(δ·x)² x xᵀ] = |δ|² I + 2 δδᵀ``, so
    ``E[g gᵀ] = (|δ|² + σ²) I + 2 δδᵀ`` and ``Σ = E[g gᵀ] − G Gᵀ = (|δ|² + σ²) I + δδᵀ``:
    ``tr(Σ) = d (|δ|² + σ²) + |δ|²`` and ``B_simple = tr(Σ) / |G|² = (d (|δ|² + σ²) + |δ|²) / |δ|²``.
    With ``d = 8``, ``|δ|² = 1``, ``σ² = 1``: ``B_simple = 17``.

    The step runs on DP8 with a learning rate of 0 (``δ`` stays fixed) and fresh batches of 64
    (``B_small = 8``), measuring every step; after 200 draws the bias-corrected moving averages
    (decay 0.995) give the estimate.

    Each step's metrics are waited for before the next step is dispatched (``jaxpar.run.train`` bounds the
    steps in flight likewise: ``max_inflight``). Without the wait, when the device threads fall behind (a
    loaded machine), the host runs dozens of steps ahead until a device's launch waits for XLA:CPU's limit of
    computations in flight, holding one of the 8 threads of the client's pool: the step it waits for cannot
    run all 8 of its devices, and XLA aborted the worker at the rendezvous timeout (issue 87; docs/testing.md,
    "A suite that ends")."""
    d, sigma2, batch, steps = 8, 1.0, 64, 200
    w_star = np.ones(d, np.float32) / np.sqrt(d)              # w = 0: |δ|² = |w*|² = 1
    analytic = (d * (1.0 + sigma2) + 1.0) / 1.0
    mesh = mesh_for({"data": 8})
    tx = optax.sgd(0.0)
    state, layout = ns.with_noise_scale(*jaxpar.init_train_state(lambda: LinearModel(d, nnx.Rngs(0)), tx, mesh),
                                        every=1, ema=0.995)
    step = jaxpar.make_train_step(linreg_loss, tx, layout)
    rng = np.random.default_rng(0)
    for _ in range(steps):
        x = rng.normal(size=(batch, d)).astype(np.float32)
        y = (x @ w_star + np.sqrt(sigma2) * rng.normal(size=batch)).astype(np.float32)
        state, metrics = step(state, jaxpar.shard_batch({"x": x, "y": y}, mesh))
        jax.block_until_ready(metrics)
    estimate = float(metrics["noise_scale"])
    assert abs(estimate / analytic - 1) < 0.10, (estimate, analytic)
    assert abs(float(metrics["noise_grad_sq"]) - 1.0) < 0.15               # |G|² = |δ|² = 1
    assert abs(float(metrics["noise_trace"]) / analytic - 1) < 0.10        # tr(Σ) = 17


def _per_replica_reference(layout, params, batch, n):
    """Each replica's gradient on its rows (``data`` splits the batch in contiguous blocks),
    computed one after the other on one device; the two squared norms of the estimator."""
    model = nnx.merge(layout.graphdef, jax.device_put(params, jax.devices()[0]))
    graphdef, _ = nnx.split(model)
    grad = jax.jit(jax.grad(lambda p, b: lm_loss(nnx.merge(graphdef, p), b)))
    b_small = len(batch["tokens"]) // n
    grads = [jax.device_get(grad(nnx.state(model), jax.tree.map(lambda a: a[i * b_small:(i + 1) * b_small], batch)))
             for i in range(n)]
    sq = lambda tree: sum(float(np.sum(np.square(np.asarray(g, np.float64)))) for g in jax.tree.leaves(tree))  # noqa
    mean = jax.tree.map(lambda *gs: np.mean(np.stack([np.asarray(g, np.float64) for g in gs]), 0), *grads)
    return float(np.mean([sq(g) for g in grads])), sq(mean), b_small


@pytest.mark.parametrize("zero", [0, 2], ids=["dp8", "zero2"])
def test_measured_norms_equal_materialised_per_replica_gradients(zero):
    mesh, strategy = mesh_for({"data": 8}), jaxpar.Strategy(zero=zero)
    tx = optax.adamw(1e-3)
    state, layout = ns.with_noise_scale(*jaxpar.init_train_state(lambda: GPT(CFG, rngs=nnx.Rngs(0)), tx, mesh,
                                                                 strategy), every=1, ema=0.9)
    step = jaxpar.make_train_step(lm_loss, tx, layout, strategy)
    host_batch = make_batch()
    params = jax.device_get(state.params)
    sq_small, sq_big, b_small = _per_replica_reference(layout, params, host_batch, 8)
    state, m = step(state, jaxpar.shard_batch(host_batch, mesh))
    np.testing.assert_allclose(float(m["grad_sq_small"]), sq_small, rtol=1e-5)
    np.testing.assert_allclose(float(m["grad_sq_big"]), sq_big, rtol=1e-5)
    np.testing.assert_allclose(float(m["grad_norm"]) ** 2, sq_big, rtol=1e-5)
    ref_state, ref = ns.update(ns.init_state(), sq_small, sq_big, b_small, 8 * b_small, 0.9)
    for k in ("noise_trace", "noise_grad_sq", "noise_scale"):      # differences of the norms: looser
        np.testing.assert_allclose(float(m[k]), float(ref[k]), rtol=2e-4)
    assert int(state.stats["noise_scale"]["count"]) == 1


def _mlp_run(d: str, steps: int, every: int = 1):
    mesh = _mesh({"data": 2})
    tx = optax.adam(0.05)
    model_fn = lambda: MLPClassifier(features=4, embed=8, mlp=8, classes=3, depth=1, rngs=nnx.Rngs(0))  # noqa
    state, layout = ns.with_noise_scale(*jaxpar.init_train_state(model_fn, tx, mesh), every=every, ema=0.8)
    step = jaxpar.make_train_step(classifier_loss, tx, layout)

    def batch_fn(i):
        x = np.random.default_rng(i).normal(size=(8, 4)).astype(np.float32)
        return {"x": x, "y": (x[:, 0] > 0).astype(np.int32)}

    state, summary = train(step, state, batch_fn, mesh=mesh, steps=steps,
                           log=LogOptions(log_every=1, out_dir=d, progress="none"))
    return mesh, layout, step, state, batch_fn


def test_moving_averages_survive_a_checkpoint_bit_exactly_and_are_logged():
    with tempfile.TemporaryDirectory() as d:
        mesh, layout, step, state, batch_fn = _mlp_run(d, steps=4, every=2)
        records = [json.loads(line) for line in open(f"{d}/metrics.jsonl")]
        measured = [r["step"] for r in records if r.get("kind") == "train" and "noise_scale" in r]
        assert measured == [1, 3]                       # steps 0 and 2 measured (reported after them)
        assert {"grad_sq_small", "grad_sq_big", "noise_trace", "noise_grad_sq"} <= set(records[0])
        assert os.path.getsize(f"{d}/noise_scale.png") > 0
        saved = jax.device_get(state.stats)
        with Checkpointer(f"{d}/ck", async_save=False) as ck:
            ck.save(4, state, {}, wait=True)
            restored = ck.restore(layout).state
        for a, b in zip(jax.tree.leaves(saved), jax.tree.leaves(jax.device_get(restored.stats))):
            assert a.dtype == b.dtype and a.tobytes() == b.tobytes()
        # one more (measuring) step from each: the same bits
        batch = jaxpar.shard_batch(batch_fn(4), mesh)
        _, m1 = step(state, batch)
        _, m2 = step(restored, batch)
        assert float(m1["noise_scale"]) == float(m2["noise_scale"])


def test_bad_options_give_named_errors():
    mesh = _mesh({"data": 2})
    tx = optax.sgd(0.1)
    model_fn = lambda: MLPClassifier(features=4, embed=8, mlp=8, classes=3, depth=1, rngs=nnx.Rngs(0))  # noqa
    plain_state, plain = jaxpar.init_train_state(model_fn, tx, mesh)
    for every, ema, match in [(0, 0.9, r"every=0\)"), (-3, 0.9, r"every=-3\)"), (2.5, 0.9, r"every=2.5\)"),
                              (True, 0.9, r"every=True\)"), (None, 0.9, r"every=None\)"),
                              (10, 1.0, r"ema=1.0\)"), (10, -0.1, r"ema=-0.1\)")]:
        with pytest.raises(ns.NoiseScaleError, match=r"with_noise_scale\(" + match):
            ns.with_noise_scale(plain_state, plain, every=every, ema=ema)
        with pytest.raises(ns.NoiseScaleError, match=r"^noise_scale\(" + match):
            ns.noise_scale(every=every, ema=ema)
    with pytest.raises(TypeError, match="every"):                       # every is required: no part without it
        ns.with_noise_scale(plain_state, plain)
    one = _mesh({"data": 1, "tensor": 2})
    _, single = ns.with_noise_scale(*jaxpar.init_train_state(model_fn, tx, one), every=10)
    with pytest.raises(ns.NoiseScaleError, match=r"noise_scale_every=10: the mesh has no data axis"):
        jaxpar.make_train_step(classifier_loss, tx, single)      # the table's need (jaxpar.compat._needs)
    bad = {"logging": LoggingConfig(noise_scale=NoiseScaleConfig(every=0, ema=1.5))}
    with pytest.raises(ConfigError, match=r"logging\.noise_scale\.every=0.*\n.*logging\.noise_scale\.ema=1\.5"):
        check(JobConfig(**bad), num_devices=8)
    piped = JobConfig(mesh=MeshConfig(data=4, pipe=2), logging=LoggingConfig(noise_scale=NoiseScaleConfig(every=10)),
                      parallel=ParallelConfig(microbatches=2, schedule="pipedream-2bw"))
    with pytest.raises(ConfigError, match=r"logging\.noise_scale\.every=10 with parallel\.schedule='pipedream-2bw'"):
        check(piped, num_devices=8)


def test_the_noise_scale_is_switched_on_in_one_place():
    """The noise-scale part (``with_noise_scale(..., every=, ema=)``, or ``parts=[noise_scale(...)]``) switches the measurement on and the step reads it from the
    state's part; a state without the part measures nothing; make_train_step takes no noise-scale keyword."""
    mesh = _mesh({"data": 2})
    tx = optax.sgd(0.1)
    model_fn = lambda: MLPClassifier(features=4, embed=8, mlp=8, classes=3, depth=1, rngs=nnx.Rngs(0))  # noqa
    plain_state, plain = jaxpar.init_train_state(model_fn, tx, mesh)
    _, layout = ns.with_noise_scale(plain_state, plain, every=2, ema=0.8)
    assert layout.parts[ns.KEY].options == ns.Measure(2, 0.8)
    assert sorted(jaxpar.make_train_step(classifier_loss, tx, layout).programs) == ["measure", "step"]
    assert ns.KEY not in plain.parts
    assert sorted(jaxpar.make_train_step(classifier_loss, tx, plain).programs) == ["step"]
    for keyword in ("noise_scale_every", "noise_scale_ema"):
        for on in (plain, layout):                  # not make_train_step's, with or without the part
            with pytest.raises(TypeError, match=keyword):
                jaxpar.make_train_step(classifier_loss, tx, on, **{keyword: 2 if keyword.endswith("every") else 0.8})
    traced = jaxpar.state_layout(model_fn, tx, mesh, parts=[ns.noise_scale(every=2, ema=0.8)]).parts[ns.KEY]
    assert (traced.options, traced.shapes) == (layout.parts[ns.KEY].options, layout.parts[ns.KEY].shapes)
