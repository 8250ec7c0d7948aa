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
    mesh, state, layout, _ = setup(sizes, strategy, cfg)
    tx = optax.adamw(1e-3, weight_decay=0.1)
    step = jaxpar.make_train_step(lm_loss, tx, layout, strategy, **step_kw)
    return mesh, layout, step.lower(state, abstract_batch(batch, cfg)).compile()
