"""Shared fixtures for strategy tests: a small GPT, a fixed batch, and a runner."""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxpar
from jaxpar.models import GPT, GPTConfig, lm_loss
from jaxpar.rules import path_str

CFG = GPTConfig(vocab=64, seq_len=16, embed=32, heads=8, layers=2)
GLOBAL_BATCH = 16


def make_batch(batch=GLOBAL_BATCH, cfg=CFG, seed=0):
    toks = np.random.default_rng(seed).integers(0, cfg.vocab, (batch, cfg.seq_len + 1))
    return {"tokens": jnp.asarray(toks[:, :-1], jnp.int32), "targets": jnp.asarray(toks[:, 1:], jnp.int32)}


def mesh_for(sizes):
    devices = jax.devices()[:1] if not sizes else None
    return jaxpar.make_mesh(sizes, devices=devices)


LR = 1e-3   # AdamW learning rate of ``setup`` / ``run``; the parameter tolerances derive from it


class KeptGrads(NamedTuple):
    grads: Any


def keep_grads() -> optax.GradientTransformation:
    """Identity transformation whose state is the last gradients it was given.

    Chained in front of the optimizer it records the gradients exactly as the
    train step hands them to the optimizer (after accumulation and the
    data-parallel reduction, before any update), whatever path the strategy
    takes (explicit or XLA data parallelism, pipelines): no second program.
    """
    def init(params):
        return KeptGrads(jax.tree.map(jnp.zeros_like, params))

    def update(updates, state, params=None):
        del state, params
        return updates, KeptGrads(updates)

    return optax.GradientTransformation(init, update)


def setup(sizes, strategy=jaxpar.Strategy(), cfg=CFG, lr=LR, *, record_grads=False, **step_kw):
    """Mesh, sharded state, layout and train step (AdamW, weight decay 0.1) of the test GPT.

    ``record_grads=True`` chains :func:`keep_grads` in front of AdamW (same updates;
    ``state.opt_state[0].grads`` holds the last step's gradients)."""
    mesh = mesh_for(sizes)
    tx = optax.adamw(lr, weight_decay=0.1)
    if record_grads:
        tx = optax.chain(keep_grads(), tx)
    state, layout = jaxpar.init_train_state(lambda: GPT(cfg, rngs=nnx.Rngs(0)), tx, mesh, strategy)
    step = jaxpar.make_train_step(lm_loss, tx, layout, strategy, **step_kw)
    return mesh, state, layout, step


class RunResult(NamedTuple):
    losses: np.ndarray   # [steps] loss of each step
    params: Any          # params after the last step, on host
    grads: Any           # gradients of the first step (what the optimizer received), on host
    lr: float
    steps: int


def run(sizes, strategy=jaxpar.Strategy(), steps=3, cfg=CFG, batch=None, **step_kw):
    """Train ``steps`` AdamW steps (``step_kw`` go to ``make_train_step``); return a
    :class:`RunResult` (``result[0]`` losses, ``result[1]`` params, ``result[2]`` first grads)."""
    mesh, state, layout, step = setup(sizes, strategy, cfg, record_grads=True, **step_kw)
    batch = jaxpar.shard_batch(make_batch(cfg=cfg) if batch is None else batch, mesh)
    losses, grads = [], None
    for _ in range(steps):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
        if grads is None:   # fetch before the next step donates the state
            grads = jax.device_get(state.opt_state[0].grads)
    return RunResult(np.array(losses), jax.device_get(state.params), grads, LR, steps)


def abstract_batch(batch=GLOBAL_BATCH, cfg=CFG):
    return {k: jax.ShapeDtypeStruct((batch, cfg.seq_len), jnp.int32) for k in ("tokens", "targets")}


def compile_step(sizes, strategy=jaxpar.Strategy(), cfg=CFG, batch=GLOBAL_BATCH, **step_kw):
    mesh, state, layout, step = setup(sizes, strategy, cfg, **step_kw)
    return mesh, layout, step.lower(state, abstract_batch(batch, cfg)).compile()


# ----------------------------------------------------------------------------- comparing runs
# fp32 standards: a whole model's loss to rtol 1e-5, its gradients to rtol 1e-4 plus an atol
# of 1e-5 x the leaf's largest gradient (round-off of a sum is relative to its largest terms,
# not to each small element), its parameters to rtol 1e-4 / atol 1e-6 plus Adam's allowance.
LOSS_RTOL = 1e-5
GRAD_RTOL, GRAD_ATOL_REL = 1e-4, 1e-5
PARAM_RTOL, PARAM_ATOL = 1e-4, 1e-6
ADAM_EPS = 1e-8          # optax.adamw's default eps


def flat(tree) -> dict:
    """``{path: numpy array}`` of a pytree of arrays."""
    return {path_str(p): np.asarray(v) for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def grad_atol(ref_grad) -> float:
    return GRAD_ATOL_REL * float(np.max(np.abs(ref_grad), initial=0.0))


def assert_grads_close(grads, ref_grads):
    """Gradients (before the optimizer) at rtol 1e-4, atol 1e-5 x the leaf's gradient scale."""
    ref = flat(ref_grads)
    got = flat(grads)
    assert got.keys() == ref.keys(), (sorted(got), sorted(ref))
    for k, g in got.items():
        np.testing.assert_allclose(g, ref[k], rtol=GRAD_RTOL, atol=grad_atol(ref[k]), err_msg=f"gradient {k}")


def adam_atol(ref_grad, lr: float, steps: int, b1: float = 0.9, b2: float = 0.999, eps: float = ADAM_EPS):
    """Per-element bound on how far ``steps`` AdamW steps can carry gradient round-off.

    AdamW moves each element by ``lr * (m_hat_t / (sqrt(v_hat_t) + eps) + wd * param)``: a
    *normalised* step. ``m_hat_t = sum_i w_i g_i`` and ``v_hat_t = sum_i u_i g_i**2`` with
    bias-corrected weights ``w``, ``u`` that each sum to 1. Let two runs' gradients differ by
    at most ``delta`` per element (what :func:`assert_grads_close` lets through:
    ``1e-4 |g| + 1e-5 x the leaf's scale``; assumed at every step). Then per step t:

    * ``|m_hat| <= r_t sqrt(v_hat)`` with ``r_t = sqrt(sum_i w_i**2 / u_i)`` (Cauchy-Schwarz;
      1.000, 1.001, 1.003 for t = 1, 2, 3), so each run's step is at most ``r_t lr`` and the
      two differ by at most ``2 r_t lr`` -- reached where a gradient is within round-off of
      zero: its sign, and so the direction of a step of size ~lr, is set by round-off;
    * to first order ``|d m_hat| <= delta`` and ``|d sqrt(v_hat)| <= delta`` (weighted mean and
      weighted 2-norm), so the step differs by at most ``(1 + r_t) lr delta / (sqrt(v_hat_t) + eps)``,
      and ``sqrt(v_hat_t) >= sqrt(u_1) |g_1|`` (step 1's share of ``v_hat_t``, ~1/t).

    Summed: ``|dparam| <= lr * sum_t min(2 r_t, (1 + r_t) delta / (sqrt(u_1) |g_1| + eps))``,
    an atol ``c * lr * steps`` with a per-element ``c``: ~3e-4 where the first gradient is far
    above round-off (almost everywhere), up to ~2 where it is within round-off of zero
    (0.1 % of the test GPT's elements). (Weight decay only adds ``lr * wd * dparam``.)
    Example: Adam turns a 1e-9 difference in a 5e-8 gradient into a 3e-6 difference in a
    parameter -- which SGD would turn into 3e-12.
    """
    g = np.abs(np.asarray(ref_grad, np.float64))
    delta = GRAD_RTOL * g + grad_atol(ref_grad)
    total = np.zeros_like(g)
    for t in range(1, steps + 1):
        i = np.arange(1, t + 1)
        w = (1 - b1) * b1 ** (t - i) / (1 - b1 ** t)     # m_hat_t's weights on g_1 .. g_t
        u = (1 - b2) * b2 ** (t - i) / (1 - b2 ** t)     # v_hat_t's weights
        r = np.sqrt(np.sum(w ** 2 / u))
        total += np.minimum(2 * r, (1 + r) * delta / (np.sqrt(u[0]) * g + eps))
    return lr * total


def assert_params_close(params, ref_params, ref_grads, lr: float, steps: int):
    """Parameters after ``steps`` AdamW steps: fp32 rtol 1e-4 / atol 1e-6 plus :func:`adam_atol`
    (computed from the reference run's first-step gradients)."""
    ref, g1 = flat(ref_params), flat(ref_grads)
    got = flat(params)
    assert got.keys() == ref.keys(), (sorted(got), sorted(ref))
    for k, p in got.items():
        r = ref[k].astype(np.float64)
        diff = np.abs(p.astype(np.float64) - r)
        tol = PARAM_RTOL * np.abs(r) + PARAM_ATOL + adam_atol(g1[k], lr, steps)
        bad = diff > tol
        if bad.any():
            i = np.unravel_index(np.argmax(np.where(bad, diff / tol, 0)), diff.shape)
            raise AssertionError(
                f"parameter {k} after {steps} AdamW steps (lr={lr}): {int(bad.sum())} / {diff.size} elements "
                f"beyond tolerance; worst at {tuple(map(int, i))}: got {p[i]!r}, reference {ref[k][i]!r}, "
                f"|diff| {diff[i]:.3g} > tol {tol[i]:.3g} (first-step reference gradient {g1[k][i]:.3g})")


def assert_runs_match(result: RunResult, reference: RunResult, loss_rtol=LOSS_RTOL):
    """Same losses (every step), same first-step gradients, same parameters after Adam."""
    assert result.steps == reference.steps and result.lr == reference.lr
    np.testing.assert_allclose(result.losses, reference.losses, rtol=loss_rtol, err_msg="losses per step")
    assert_grads_close(result.grads, reference.grads)
    assert_params_close(result.params, reference.params, reference.grads, reference.lr, reference.steps)


def explicit_one_device(model_fn, loss_fn, batch_fn, lr: float, steps: int, batch_axes=("data", "fsdp")):
    """A model in JAX's explicit-sharding style trained on one device as the style writes it by hand:
    an Explicit one-device mesh with jaxpar's axis names, optax Adam, the batch on ``batch_axes`` (the
    axes the model's activations name). ``batch_fn(step)`` gives the batch dict. Returns
    ``(losses, final params, first step's gradients)``."""
    from jax.sharding import AxisType, NamedSharding, PartitionSpec

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1, 1), ("pipe", "data", "fsdp", "tensor"),
                             axis_types=(AxisType.Explicit,) * 4)
    tx = optax.adam(lr)
    with jax.set_mesh(mesh):
        graphdef, params = nnx.split(model_fn(), nnx.Param)
        params = nnx.to_pure_dict(params)
        opt = tx.init(params)

        @jax.jit
        def step(params, opt, batch):
            value, grads = jax.value_and_grad(lambda p: loss_fn(nnx.merge(graphdef, p), batch))(params)
            updates, opt = tx.update(grads, opt, params)
            return optax.apply_updates(params, updates), opt, value, grads

        losses, first_grads = [], None
        for i in range(steps):
            b = jax.device_put(batch_fn(i), NamedSharding(mesh, PartitionSpec(batch_axes)))
            params, opt, value, grads = step(params, opt, b)
            losses.append(float(value))
            first_grads = first_grads if first_grads is not None else jax.device_get(grads)
    return losses, jax.device_get(params), first_grads


def train_steps(model_fn, loss_fn, batch_fn, axes, strategy, lr: float, steps: int):
    """``steps`` Adam steps of ``model_fn()`` on a mesh of ``axes`` under ``strategy``, batch ``i`` from
    ``batch_fn(i)``. Returns ``(state, layout, losses, step, mesh)``."""
    n = int(np.prod(list(axes.values())))
    mesh = jaxpar.make_mesh(axes, devices=jax.devices()[:n])
    tx = optax.adam(lr)
    state, layout = jaxpar.init_train_state(model_fn, tx, mesh, strategy)
    step = jaxpar.make_train_step(loss_fn, tx, layout)
    losses = []
    for i in range(steps):
        state, metrics = step(state, jaxpar.shard_batch(batch_fn(i), mesh))
        losses.append(float(metrics["loss"]))
    return state, layout, losses, step, mesh
