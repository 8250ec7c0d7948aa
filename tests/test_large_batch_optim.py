"""Large-batch optimizers: masked LARS / LAMB, learning-rate scaling rules, their errors.

* LARS and LAMB against a hand-written numpy reference over 3 steps (rtol 1e-5): biases and
  norm scales get neither weight decay nor a trust ratio; stacked layers get one trust ratio
  per layer. With every parameter masked in they equal ``optax.lars`` / ``optax.lamb``.
* The same optimizer on DP8, ZeRO-3 and TP2 x DP4 as on one device (a small model with
  stacked blocks, so the per-layer norms run on sharded leaves), compared like
  tests/test_equivalence.py; and the collectives the trust ratio adds (counted from the HLO).
* The logged learning rate follows ``optimizer.lr_scaling`` exactly; bad settings are named errors.
"""
import functools
import json
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec

import jaxpar
from jaxpar import optimizers as O
from jaxpar.analysis import collectives, count
from jaxpar.adapters import run_layers
from jaxpar.config import ConfigError, build_lr_schedule, build_model_fn, build_optimizer, load_config
from jaxpar.rules import constrain
from jaxpar.run import LogOptions, train
from jaxpar.adapters import abstract_model

from conftest import need_devices
from helpers import (GRAD_RTOL, PARAM_ATOL, PARAM_RTOL, adam_atol, assert_grads_close, flat, grad_atol,
                     keep_grads, mesh_for)

QUICK = "configs/quickstart.yaml"
LAMB_YAML = "configs/lamb.yaml"


# ----------------------------------------------------------------------------- numpy reference
LOGICAL = {"blocks": {"w": ("layers", "embed", "mlp"), "scale": ("layers", "embed"), "b": ("layers", "mlp")},
           "emb": ("vocab", "embed"), "bias": ("embed",)}
SHAPES = {"blocks": {"w": (2, 4, 3), "scale": (2, 4), "b": (2, 3)}, "emb": (5, 4), "bias": (4,)}
MATRICES = {"blocks/w", "emb"}          # what the default mask keeps: rank >= 2 without the layers axis


def toy_params_and_grads(steps=3):
    rng = np.random.default_rng(0)
    draw = lambda: jax.tree.map(lambda s: rng.normal(size=s).astype(np.float32), SHAPES,   # noqa: E731
                                is_leaf=lambda x: isinstance(x, tuple))
    params = draw()
    grads = [draw() for _ in range(steps)]
    return params, grads


def np_trust(w, u, stacked, coef=1.0, eps=0.0):
    """``coef ||w|| / (||u|| + eps)`` over each layer's slice; 1 where a norm is 0 (as optax)."""
    axes = tuple(range(stacked, w.ndim))
    wn = np.sqrt(np.sum(w * w, axis=axes, keepdims=True))
    un = np.sqrt(np.sum(u * u, axis=axes, keepdims=True))
    return np.where((wn == 0) | (un == 0), 1.0, coef * wn / (un + eps))


def np_lamb(params, grads, *, lr, b1, b2, eps, wd):
    p = {k: v.astype(np.float64) for k, v in flat(params).items()}
    m = {k: np.zeros_like(v) for k, v in p.items()}
    v = {k: np.zeros_like(x) for k, x in p.items()}
    for t, g_tree in enumerate(grads, 1):
        for k, g in flat(g_tree).items():
            g = g.astype(np.float64)
            m[k] = b1 * m[k] + (1 - b1) * g
            v[k] = b2 * v[k] + (1 - b2) * g * g
            u = (m[k] / (1 - b1 ** t)) / (np.sqrt(v[k] / (1 - b2 ** t)) + eps)
            if k in MATRICES:
                u = u + wd * p[k]
                u = u * np_trust(p[k], u, int(k.startswith("blocks/")))
            p[k] = p[k] - lr * u
    return p


def np_lars(params, grads, *, lr, momentum, coef, eps, wd):
    p = {k: v.astype(np.float64) for k, v in flat(params).items()}
    vel = {k: np.zeros_like(x) for k, x in p.items()}
    for g_tree in grads:
        for k, g in flat(g_tree).items():
            u = g.astype(np.float64)
            if k in MATRICES:
                u = u + wd * p[k]
                u = u * np_trust(p[k], u, int(k.startswith("blocks/")), coef, eps)
            vel[k] = momentum * vel[k] - lr * u
            p[k] = p[k] + vel[k]
    return p


def run_tx(tx, params, grads):
    state = tx.init(params)
    step = jax.jit(lambda p, g, s: (lambda u, s2: (optax.apply_updates(p, u), s2))(*tx.update(g, s, p)))
    for g in grads:
        params, state = step(params, g, state)
    return flat(params)


def test_default_mask_from_logical_names_and_rank():
    params, _ = toy_params_and_grads()
    mask = flat(O.trust_mask(params, LOGICAL))
    assert {k for k, on in mask.items() if on} == MATRICES
    by_rank = flat(O.trust_mask(params))           # no logical names: stacked norm scales look like matrices
    assert {k for k, on in by_rank.items() if on} == MATRICES | {"blocks/scale", "blocks/b"}
    over = flat(O.trust_mask(params, LOGICAL, exclude=["^emb$"], include=["blocks/scale"]))
    assert {k for k, on in over.items() if on} == {"blocks/w", "blocks/scale"}


def test_lamb_matches_numpy_reference():
    params, grads = toy_params_and_grads()
    kw = dict(b1=0.9, b2=0.999, eps=1e-6)
    got = run_tx(O.lamb(0.01, weight_decay=0.1, logical=LOGICAL, **kw), params, grads)
    ref = np_lamb(params, grads, lr=0.01, wd=0.1, **kw)
    for k in ref:
        np.testing.assert_allclose(got[k], ref[k], rtol=1e-5, err_msg=k)
    moved = {k: np.abs(got[k] - flat(params)[k]).max() for k in ref}
    assert all(m > 1e-3 for m in moved.values()), moved


def test_lars_matches_numpy_reference():
    params, grads = toy_params_and_grads()
    got = run_tx(O.lars(0.1, weight_decay=0.01, momentum=0.9, trust_coefficient=0.02, eps=1e-8, logical=LOGICAL),
                 params, grads)
    ref = np_lars(params, grads, lr=0.1, momentum=0.9, coef=0.02, eps=1e-8, wd=0.01)
    for k in ref:
        np.testing.assert_allclose(got[k], ref[k], rtol=1e-5, err_msg=k)


def test_all_masked_in_equals_optax():
    """With every leaf masked in and no stacked axes, the optimizers are optax's own."""
    params, grads = toy_params_and_grads()
    every = lambda p: jax.tree.map(lambda _: True, p)   # noqa: E731
    pairs = [(O.lamb(0.01, weight_decay=0.1, mask=every), optax.lamb(0.01, weight_decay=0.1)),
             (O.lars(0.1, weight_decay=0.01, mask=every), optax.lars(0.1, weight_decay=0.01))]
    for ours, theirs in pairs:
        got, ref = run_tx(ours, params, grads), run_tx(theirs, params, grads)
        for k in ref:
            np.testing.assert_allclose(got[k], ref[k], rtol=1e-6, err_msg=k)


# ----------------------------------------------------------------------------- strategies
L, FEATURES, EMBED, MLP, CLASSES, BATCH, LR, STEPS = 2, 8, 16, 32, 4, 16, 0.01, 3


def _param(value, logical):
    return nnx.Param(value, out_sharding=logical)


class StackedMLP(nnx.Module):
    """``features -> embed``, ``L`` stacked residual blocks (weights, bias, scale), ``embed -> classes``."""

    def __init__(self, *, rngs: nnx.Rngs):
        n = lambda shape, fan_in: jax.random.normal(rngs.params(), shape) / math.sqrt(fan_in)   # noqa: E731
        with nnx.use_eager_sharding(False):
            self.inp = _param(n((FEATURES, EMBED), FEATURES), (None, "embed"))
            self.inp_bias = _param(jnp.zeros((EMBED,)), ("embed",))
            self.w_up = _param(n((L, EMBED, MLP), EMBED), ("layers", "embed", "mlp"))
            self.b_up = _param(jnp.zeros((L, MLP)), ("layers", "mlp"))
            self.w_down = _param(n((L, MLP, EMBED), MLP), ("layers", "mlp", "embed"))
            self.scale = _param(jnp.ones((L, EMBED)), ("layers", "embed"))
            self.out = _param(n((EMBED, CLASSES), EMBED), ("embed", "classes"))

    def __call__(self, x):
        h = constrain(x @ self.inp[...] + self.inp_bias[...], ("batch", "embed"))
        blocks = {k: getattr(self, k)[...] for k in ("w_up", "b_up", "w_down", "scale")}
        logical = {k: tuple(getattr(self, k).out_sharding[1:]) for k in blocks}
        h = run_layers(_block, blocks, h, logical=logical)
        return h @ self.out[...]


def _block(p, x):
    h = constrain(jax.nn.gelu(x @ p["w_up"] + p["b_up"]), ("batch", "mlp"))
    return x + (h @ p["w_down"]) * p["scale"]


def stacked_loss(model, batch):
    logits = model(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def stacked_model():
    return StackedMLP(rngs=nnx.Rngs(0))


def stacked_batch():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(BATCH, FEATURES)).astype(np.float32)
    return {"x": x, "y": (np.arange(BATCH) % CLASSES).astype(np.int32)}


LOGICAL_STACKED = abstract_model(stacked_model)[2]
OPTIMIZERS = {"lamb": lambda: O.lamb(LR, weight_decay=0.1, logical=LOGICAL_STACKED),
              "lars": lambda: O.lars(LR, weight_decay=0.01, trust_coefficient=0.1, eps=1e-8, logical=LOGICAL_STACKED),
              "adamw": lambda: optax.adamw(LR, weight_decay=0.1)}
STRATEGIES = {"dp8": ({"data": 8}, {}), "zero3": ({"data": 8}, {"zero": 3}),
              "tp2-dp4": ({"data": 4, "tensor": 2}, {})}


@functools.lru_cache(maxsize=None)
def run_named(opt, name, compile_only=False):
    """:func:`run_stacked` on strategy ``name`` (``"one"``: one device), computed once per session."""
    sizes, kw = STRATEGIES[name] if name != "one" else ({}, {})
    return run_stacked(opt, sizes, kw, compile_only)


def run_stacked(opt, sizes, strategy_kw, compile_only=False):
    """Three steps of ``opt`` on the stacked model: losses, first-step grads, init and final params,
    the compiled step and the layout."""
    mesh, strategy = mesh_for(sizes), jaxpar.Strategy(**strategy_kw)
    tx = optax.chain(keep_grads(), OPTIMIZERS[opt]())
    state, layout = jaxpar.init_train_state(stacked_model, tx, mesh, strategy)
    step = jaxpar.make_train_step(stacked_loss, tx, layout, strategy)
    batch = jaxpar.shard_batch(stacked_batch(), mesh)
    compiled = step.lower(state, batch).compile()
    if compile_only:
        return dict(compiled=compiled, mesh=mesh, layout=layout)
    init, losses, grads = jax.device_get(state.params), [], None
    for _ in range(STEPS):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
        grads = jax.device_get(state.opt_state[0].grads) if grads is None else grads
    return dict(losses=np.array(losses), grads=grads, init=init, params=jax.device_get(state.params),
                compiled=compiled, mesh=mesh, layout=layout)


def lars_atol(init, grad, stacked, lr, steps, momentum=0.9, coef=0.1, wd=0.01, eps=1e-8, masked=True):
    """Per-element bound on how far gradient round-off ``delta`` carries through LARS.

    A step moves an element by ``lr * s * (g + wd w)``, ``s = coef ||w|| / ||g + wd w||`` (1 when
    masked out); ``s`` is a ratio of norms over a whole layer, so round-off moves it by a relative
    ``~delta / |g|`` at most, and the step by ``<= 2 lr s delta``. Momentum sums the steps with
    weights ``1, 1 + m, 1 + m + m^2``."""
    delta = GRAD_RTOL * np.abs(grad) + grad_atol(grad)
    s = np_trust(init, grad + wd * init, stacked, coef, eps) if masked else 1.0
    weight = sum(sum(momentum ** i for i in range(t)) for t in range(1, steps + 1))
    return 2 * lr * s * delta * weight


def assert_matches(result, ref, opt):
    """Losses rtol 1e-5, first-step gradients as tests/helpers.py, params with the optimizer's allowance:
    LAMB normalises each element like Adam (``helpers.adam_atol``; its trust ratio ``||w|| / ||u||`` is
    < 1 here, asserted), LARS carries round-off linearly (:func:`lars_atol`)."""
    np.testing.assert_allclose(result["losses"], ref["losses"], rtol=1e-5, err_msg="losses per step")
    assert_grads_close(result["grads"], ref["grads"])
    got, want, g1, w0 = flat(result["params"]), flat(ref["params"]), flat(ref["grads"]), flat(ref["init"])
    mask = flat(O.trust_mask(ref["init"], LOGICAL_STACKED))
    for k, p in got.items():
        stacked = 1 if k in ("w_up", "b_up", "w_down", "scale") else 0
        if opt == "lamb":
            assert not mask[k] or np.sqrt(np.mean(w0[k] ** 2)) < 1, f"{k}: trust ratio may exceed 1"
            extra = adam_atol(g1[k], LR, STEPS, b1=0.9, b2=0.999, eps=1e-6)
        else:
            extra = lars_atol(w0[k], g1[k], stacked, LR, STEPS, masked=mask[k])
        tol = PARAM_RTOL * np.abs(want[k]) + PARAM_ATOL + extra
        diff = np.abs(p.astype(np.float64) - want[k])
        assert (diff <= tol).all(), f"{opt} {k}: max |diff| {diff.max():.3g}, worst diff/tol {(diff / tol).max():.3g}"


@need_devices(8)
@pytest.mark.parametrize("opt", ["lamb", "lars"])
@pytest.mark.parametrize("name", list(STRATEGIES))
def test_strategy_matches_single_device(name, opt):
    result = run_named(opt, name)
    assert result["losses"][-1] < result["losses"][0]
    assert_matches(result, run_named(opt, "one"), opt)


def sharded_masked_leaves(layout) -> list[str]:
    """Masked-in parameters whose (per-layer) elements are split over a mesh axis of size > 1."""
    from jaxpar.rules import axes_of, path_str

    sizes = dict(layout.mesh.shape)
    mask = flat(O.trust_mask(layout.shapes, layout.logical))
    specs = jax.tree_util.tree_flatten_with_path(layout.params, is_leaf=lambda x: isinstance(x, PartitionSpec))[0]
    split = {path_str(p): math.prod(sizes[a] for e in s for a in axes_of(e)) > 1 for p, s in specs}
    return sorted(k for k, on in mask.items() if on and split[k])


@need_devices(8)
@pytest.mark.parametrize("name", [pytest.param("dp8", marks=pytest.mark.exhaustive), "zero3", "tp2-dp4"])
def test_trust_ratio_collectives(name):
    """The trust ratio's norms of sharded leaves add small all-reduces and nothing else.

    DP8: none (the leaves are replicated). ZeRO-3 / TP: two norms (``||w||``, ``||u||``) per layer of
    each masked-in leaf split over a mesh axis, i.e. ``2 x 4`` bytes per layer all-reduced over that
    axis; XLA's combiner packs them (with the step's other small all-reduces) into tuple all-reduces,
    so the number of added instructions is at most two per sharded leaf (0 under TP2 x DP4 here)."""
    base, lamb = run_named("adamw", name, compile_only=True), run_named("lamb", name)
    before, after = collectives(base["compiled"], base["mesh"]), collectives(lamb["compiled"], lamb["mesh"])
    for kind in ("all-gather", "reduce-scatter", "all-to-all", "collective-permute"):
        assert count(after, kind) == count(before, kind), kind
    added = count(after, "all-reduce") - count(before, "all-reduce")
    added_bytes = sum(c.bytes for c in after if c.kind == "all-reduce") - sum(
        c.bytes for c in before if c.kind == "all-reduce")
    sharded = sharded_masked_leaves(lamb["layout"])
    layers = sum(L if k in ("w_up", "w_down") else 1 for k in sharded)
    print(f"{name}: +{added} all-reduce instructions, +{added_bytes} B per device; sharded masked-in "
          f"leaves {sharded} ({layers} layer slices)")
    assert added_bytes == 2 * 4 * layers
    assert 0 <= added <= 2 * len(sharded)


# ----------------------------------------------------------------------------- scaling rules
@pytest.mark.parametrize("rule,factor", [("linear", 4.0), ("sqrt", 2.0), ("none", 1.0)])
def test_scaled_lr_and_schedule(rule, factor):
    assert O.scaled_lr(0.1, 1024, 256, rule) == pytest.approx(0.1 * factor, rel=1e-12)
    cfg = load_config(QUICK, [f"optimizer.lr_scaling.rule={rule}", "optimizer.lr_scaling.base_batch=8",
                              "data.batch_size=32", "optimizer.warmup_steps=10", "optimizer.lr=1e-3"]).optimizer
    s = build_lr_schedule(cfg, 100, global_batch=32)
    assert float(s(5)) == pytest.approx(0.5e-3 * factor, rel=1e-6)
    assert float(s(10)) == pytest.approx(1e-3 * factor, rel=1e-6)
    assert float(s(100)) == pytest.approx(1e-3 * factor * cfg.min_lr_ratio, rel=1e-4)


def test_logged_lr_follows_the_rule(tmp_path):
    """The loop's ``lr`` metric (metrics.jsonl), the rate ``tx``'s state holds, is the scaled schedule: warm-up to
    lr x B / B0, then flat (the other rules' schedules: test_scaled_lr_and_schedule)."""
    rule, steps, warm, lr, batch, base = "linear", 5, 3, 2e-3, 16, 4
    cfg = load_config(LAMB_YAML, [f"optimizer.lr_scaling.rule={rule}", f"optimizer.lr_scaling.base_batch={base}",
                                  f"data.batch_size={batch}", f"optimizer.lr={lr}", f"optimizer.warmup_steps={warm}",
                                  "optimizer.lr_schedule=constant"]).optimizer
    mesh = jaxpar.make_mesh({"data": 2}, devices=jax.devices()[:2])
    params = jaxpar.param_layout(stacked_model, mesh)
    tx, schedule = build_optimizer(cfg, steps, global_batch=batch, params=params)
    state, layout = jaxpar.init_train_state(stacked_model, tx, mesh, param_layout=params)
    step = jaxpar.make_train_step(stacked_loss, tx, layout)        # tx's state holds each update's lr
    train(step, state, lambda i: stacked_batch(), mesh=mesh, steps=steps,
          log=LogOptions(log_every=1, out_dir=str(tmp_path), progress="none", tensorboard=False, plot=False))
    logged = [r["lr"] for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())
              if r["kind"] == "train"]
    peak = lr * batch / base
    want = [peak * min(1.0, i / warm) for i in range(steps)]     # step i + 1 logs the lr of update i
    np.testing.assert_allclose(logged, np.float32(want), rtol=1e-6)


def _params(cfg):
    """The config's GPT's parameter layout on one device."""
    return jaxpar.param_layout(build_model_fn(cfg.model), jaxpar.make_mesh({}, devices=jax.devices()[:1]))


def test_lamb_config_builds_with_the_model_mask():
    cfg = load_config(LAMB_YAML, ["model.embed=32", "model.layers=1"])
    tx, schedule = build_optimizer(cfg.optimizer, cfg.train.steps, global_batch=cfg.data.batch_size,
                                   params=_params(cfg))
    assert float(schedule(cfg.optimizer.warmup_steps)) == pytest.approx(cfg.optimizer.lr * 64 / 32)
    cut = load_config(LAMB_YAML, ["optimizer.trust_mask.exclude=['^wte$']"]).optimizer
    build_optimizer(cut, 10, global_batch=64, params=_params(cfg))


# ----------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("override,message", [
    ("optimizer.lr_scaling.base_batch=0", "optimizer.lr_scaling.base_batch=0: must be a positive int"),
    ("optimizer.lr_scaling.base_batch=-4", "optimizer.lr_scaling.base_batch=-4"),
    ("optimizer.lr_scaling.rule=cubic", "optimizer.lr_scaling.rule='cubic': unknown rule; allowed: linear, sqrt"),
    ("optimizer.name=lion", "optimizer.name='lion': unknown value; allowed: adamw, adam, sgd, lars, lamb"),
    ("optimizer.trust_coefficient=0", "optimizer.trust_coefficient=0"),
    ("optimizer.trust_mask.exclude=['(']", "optimizer.trust_mask.exclude: '(' is not a valid regular expression"),
])
def test_bad_settings_name_the_key(override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(LAMB_YAML, [override])


def test_mask_only_with_lars_or_lamb():
    with pytest.raises(ConfigError, match=re.escape("optimizer.trust_mask.include=['w1']: only used by")):
        load_config(QUICK, ["optimizer.trust_mask.include=['w1']"])


def test_mask_naming_no_parameter_is_an_error():
    cfg = load_config(LAMB_YAML, ["optimizer.trust_mask.exclude=['ln1_scale', 'no_such_param']"])
    with pytest.raises(ConfigError, match=re.escape("optimizer.trust_mask.exclude=['ln1_scale', 'no_such_param']: "
                                              "'no_such_param' matches no parameter; parameter paths are")):
        build_optimizer(cfg.optimizer, 10, global_batch=64, params=_params(cfg))
    with pytest.raises(O.MaskError, match="'nothing' matches no parameter"):   # the library's own error
        O.trust_mask({"w": jnp.ones((2, 2))}, include=["nothing"])


def test_scaling_needs_the_batch_and_plain_values_are_checked():
    cfg = load_config(LAMB_YAML).optimizer
    with pytest.raises(ConfigError, match="global batch, which was not given"):
        build_optimizer(cfg, 10)
    with pytest.raises(ValueError, match=r"scaled_lr\(base_batch=0\): must be a positive int"):
        O.scaled_lr(0.1, 64, 0)
    with pytest.raises(ValueError, match=r"scaled_lr\(rule='cube'\): unknown rule"):
        O.scaled_lr(0.1, 64, 32, "cube")
