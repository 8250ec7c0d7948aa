"""Combinations of features that used to pass silently: each is now honoured or refused by name.

Tiny MLP classifier (:mod:`jaxpar.models._mlp`) on the 8 simulated CPU devices; each test fails on
the code where the combination was silent.
"""
import jax
import numpy as np
import optax
import pytest
from flax import nnx

import jaxpar
from jaxpar.parallel.compression import qsgd
from jaxpar.config import ConfigError, check, load_config
from jaxpar.models import MLPClassifier, classifier_loss
from jaxpar.parallel.sync import SyncError, stale
from jaxpar.run import train
from jaxpar.run import BatchRamp
from jaxpar.step._compose import StrategyMismatchError

QUICK = "configs/quickstart.yaml"


def model_fn():
    return MLPClassifier(features=4, embed=8, mlp=8, classes=3, depth=2, rngs=nnx.Rngs(0))


def batch(rows=16, seed=0):
    rng = np.random.default_rng(seed)
    return {"x": rng.normal(size=(rows, 4)).astype(np.float32), "y": rng.integers(0, 3, rows).astype(np.int32)}


def test_a_strategy_other_than_the_layouts_is_refused_naming_both():
    mesh = jaxpar.make_mesh({"data": 2, "tensor": 4})
    tx = optax.sgd(0.1)
    _, layout = jaxpar.init_train_state(model_fn, tx, mesh)          # default Strategy()
    with pytest.raises(StrategyMismatchError, match=r"dp2-zero3-tp4-sp.*'dp2-tp4'.*zero, sequence_parallel"):
        jaxpar.make_train_step(classifier_loss, tx, layout, jaxpar.Strategy(zero=3, sequence_parallel=True))


def test_the_step_runs_the_layouts_strategy_and_an_equal_one_is_accepted():
    mesh = jaxpar.make_mesh({"data": 8})
    tx = optax.sgd(0.1)
    strategy = jaxpar.Strategy(zero=1, compression=qsgd(levels=127))
    state, layout = jaxpar.init_train_state(model_fn, tx, mesh, strategy)
    assert layout.strategy is strategy
    same = jaxpar.Strategy(zero=1, compression=qsgd(levels=127))     # another codec object with the same options
    implicit = jaxpar.make_train_step(classifier_loss, tx, layout, donate=False)
    explicit = jaxpar.make_train_step(classifier_loss, tx, layout, same, donate=False)
    b = batch()
    (a, ma), (e, _) = implicit(state, b), explicit(state, b)
    assert "comm_ratio" in ma and "residual_norm" in ma         # the compressed exchange ran
    np.testing.assert_array_equal(jax.device_get(a.params["out"]["kernel"]), jax.device_get(e.params["out"]["kernel"]))
    with pytest.raises(StrategyMismatchError, match="compression"):
        jaxpar.make_train_step(classifier_loss, tx, layout, jaxpar.Strategy(zero=1, compression=qsgd(levels=7)))


def test_the_logged_lr_is_the_one_the_optimizer_state_holds():
    """``optax.inject_hyperparams`` keeps each update's learning rate in the state: the step logs it, and the
    update equals the optimizer's without it. A skipped step applies none: its lr is the last applied one,
    and the schedule goes on from there (a schedule of the step would have moved on). Without the wrapper
    nothing is logged; a schedule passed to the step is refused by name."""
    mesh = jaxpar.make_mesh({"data": 2}, devices=jax.devices()[:2])
    schedule = lambda count: 0.1 / (1.0 + count)        # noqa: E731
    tx, plain_tx = optax.inject_hyperparams(optax.sgd)(learning_rate=schedule), optax.sgd(schedule)
    state, layout = jaxpar.init_train_state(model_fn, tx, mesh)
    plain_state, plain_layout = jaxpar.init_train_state(model_fn, plain_tx, mesh)
    for name in ("lr_schedule", "log_lr"):
        with pytest.raises(TypeError, match=name):
            jaxpar.make_train_step(classifier_loss, tx, layout, **{name: schedule})
    step = jaxpar.make_train_step(classifier_loss, tx, layout, donate=False, skip_nonfinite=True)
    plain = jaxpar.make_train_step(classifier_loss, plain_tx, plain_layout, donate=False, skip_nonfinite=True)
    bad = batch()
    bad["x"][0, 0] = np.nan
    logged = []
    for b in (batch(), bad, batch()):
        (state, m), (plain_state, pm) = step(state, b), plain(plain_state, b)
        logged.append(float(m["lr"]))
        assert "lr" not in pm
    assert logged == pytest.approx([0.1, 0.1, 0.05], rel=1e-6)     # updates 0 and 1 (the nan step applied none)
    # the same updates, to fp32 rounding: the skip rule reads the updated parameters too (a non-finite one
    # skips), and XLA:CPU then rounds `p + u` of one of the two programs once otherwise (1 ulp)
    np.testing.assert_allclose(jax.device_get(state.params["out"]["kernel"]),
                               jax.device_get(plain_state.params["out"]["kernel"]), rtol=2.4e-7, atol=0)


@pytest.mark.exhaustive
@pytest.mark.fusion_emitters
def test_explicit_dp_runs_inside_several_steps_per_call():
    """explicit_dp=True with steps_per_call=2 scans the explicit program (its per-layer collectives,
    not XLA's), and its two steps are two calls of the one-step program."""
    from jaxpar.models import GPT, GPTConfig, lm_loss

    cfg = GPTConfig(vocab=32, seq_len=8, embed=16, heads=2, layers=2)
    mesh = jaxpar.make_mesh({"data": 4}, devices=jax.devices()[:4])
    tx, strategy = optax.adam(0.01), jaxpar.Strategy(zero=3)
    state, layout = jaxpar.init_train_state(lambda: GPT(cfg, rngs=nnx.Rngs(0)), tx, mesh, strategy)
    toks = [np.random.default_rng(i).integers(0, 32, (8, 9)).astype(np.int32) for i in (0, 1)]
    b0, b1 = ({"tokens": t[:, :-1], "targets": t[:, 1:]} for t in toks)
    stacked = jax.tree.map(lambda *a: np.stack(a), b0, b1)

    def collectives(explicit, k):
        step = jaxpar.make_train_step(lm_loss, tx, layout, explicit_dp=explicit, steps_per_call=k)
        text = step.lower(state, stacked if k > 1 else b0).compile().as_text()
        return {op: text.count(f" {op}(") for op in ("all-gather", "reduce-scatter", "all-reduce")}

    assert collectives(True, 2) == collectives(True, 1) != collectives(False, 1)
    one = jaxpar.make_train_step(lm_loss, tx, layout, explicit_dp=True, donate=False)
    two = jaxpar.make_train_step(lm_loss, tx, layout, explicit_dp=True, steps_per_call=2, donate=False)
    (s1, m0), (got, m) = one(state, b0), two(state, stacked)
    s2, m1 = one(s1, b1)
    np.testing.assert_allclose(np.asarray(m["loss"]), [float(m0["loss"]), float(m1["loss"])], rtol=1e-6)
    for a, b in zip(jax.tree.leaves(jax.device_get(got.params)), jax.tree.leaves(jax.device_get(s2.params))):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_async_stale_reports_a_skip_of_any_replica(tmp_path):
    """Replica 0's rows are NaN: its update is dropped, replica 1's is applied, and the step says so
    (the metrics used to be the last replica's only, so the skip went unreported and
    ``train(on_nonfinite='skip')`` stopped a healthy run)."""
    mesh = jaxpar.make_mesh({"replica": 2, "data": 1}, devices=jax.devices()[:2])
    strategy = jaxpar.Strategy(sync=stale(0, mode="async"))
    tx = optax.sgd(0.1)
    state, layout = jaxpar.init_train_state(model_fn, tx, mesh, strategy)
    step = jaxpar.make_train_step(classifier_loss, tx, layout, skip_nonfinite=True, donate=False)
    b = batch(8)
    b["x"][:4] = np.nan                               # replica 0 takes rows 0..3
    new, metrics = step(state, b)
    assert not bool(metrics["skipped"]) and int(metrics["skipped_updates"]) == 1    # replica 1's update applied
    after = jax.device_get(new.params["out"]["kernel"])
    assert np.isfinite(after).all() and not np.array_equal(after, jax.device_get(state.params["out"]["kernel"]))
    from jaxpar.run import LogOptions

    _, summary = train(step, state, lambda i: b, mesh=mesh, steps=2, on_nonfinite="skip",
                       log=LogOptions(out_dir=str(tmp_path), progress="none", tensorboard=False, plot=False))
    assert summary.skipped_steps == [1, 2]


def test_compression_on_a_replica_mesh_is_refused_at_init():
    mesh = jaxpar.make_mesh({"replica": 2, "data": 4})
    with pytest.raises(SyncError, match=r"compression='qsgd.*replica=2.*Fold the replica devices into the data axis"):
        jaxpar.init_train_state(model_fn, optax.sgd(0.1), mesh, jaxpar.Strategy(compression=qsgd()))


def test_a_ramp_step_inside_a_call_of_k_steps_is_refused_by_name():
    mesh = jaxpar.make_mesh({"data": 2}, devices=jax.devices()[:2])
    tx = optax.sgd(0.1)
    state, layout = jaxpar.init_train_state(model_fn, tx, mesh)
    step = jaxpar.make_train_step(classifier_loss, tx, layout)
    ramp = BatchRamp(sizes=(8, 16), steps=(0, 3))
    with pytest.raises(ValueError, match=r"step 3 falls inside a call of 2 steps.*multiple of 2"):
        train(step, state, lambda i: batch(ramp.size_at(i)), mesh=mesh, steps=4, ramp=ramp, steps_per_call=2)


def test_a_ramp_step_inside_a_call_is_a_config_problem():
    overrides = ["mesh.pipe=2", "mesh.data=4", "parallel.schedule=pipedream-2bw", "parallel.microbatches=2",
                 "parallel.steps_per_call=2", "train.steps=8", "train.log_every=2", "train.eval_every=0",
                 "checkpoint.every=0", "data.batch_size=32", "data.batch_ramp={sizes: [32, 64], steps: [0, 3]}"]
    with pytest.raises(ConfigError, match=r"data.batch_ramp.steps=\[0, 3\] with parallel.steps_per_call=2"):
        check(load_config(QUICK, overrides), num_devices=8)


def test_the_docs_table_is_the_compat_table():
    """docs/strategies.md's table is generated from jaxpar.compat._table (python -m jaxpar.compat._markdown)."""
    from pathlib import Path

    from jaxpar.compat._markdown import markdown_table

    assert markdown_table() in Path("docs/strategies.md").read_text()


def test_the_library_and_the_config_raise_the_same_refusal():
    """One table: the library's error and the config's problem are the same message with other names."""
    from jaxpar.compat import LIBRARY_NAMES, Setting, problems
    from jaxpar.errors import StashingError

    strategy = jaxpar.Strategy(schedule="pipedream", microbatches=2, compression=qsgd())
    (problem,) = problems(Setting(strategy, {"pipe": 2, "data": 4}))
    with pytest.raises(StashingError) as lib:
        jaxpar.init_train_state(model_fn, optax.sgd(0.1), jaxpar.make_mesh({"pipe": 2, "data": 4}), strategy)
    assert str(lib.value) == problem.render(LIBRARY_NAMES)
    overrides = ["mesh.pipe=2", "mesh.data=4", "parallel.schedule=pipedream", "parallel.microbatches=2",
                 "parallel.compression={kind: qsgd}", "optimizer.clip_norm=null"]
    with pytest.raises(ConfigError) as cfg:
        check(load_config(QUICK, overrides), num_devices=8)
    assert "parallel.compression='qsgd" in str(cfg.value) and "parallel.schedule='pipedream'" in str(cfg.value)
