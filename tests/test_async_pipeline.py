"""PipeDream-2BW: the no-flush table, the delayed-gradient train step against a one-device
reference, its memory, its errors, config and checkpoints."""
import re
import warnings

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import jaxpar
from jaxpar.config import ConfigError, load_config
from jaxpar.models import GPT, GPTConfig, lm_loss
from jaxpar.errors import AsyncPipelineError
from jaxpar.parallel.pipeline._pipedream import step_windows, two_bw_versions
from jaxpar.parallel.pipeline import bubble_fraction
from jaxpar.parallel.pipeline._stage import TICKS_SCOPE
from jaxpar.step._two_bw_step import WINDOWS_SCOPE
from jaxpar.parallel.pipeline import lower
from jaxpar.parallel.pipeline import get_schedule, pipedream_2bw
from jaxpar.parallel.pipeline._schedules import num_ticks, one_f_one_b
from jaxpar.run import Checkpointer

from helpers import make_batch
from test_cli import QUICK

ACFG = GPTConfig(vocab=64, seq_len=16, embed=32, heads=8, layers=4)
STEPS = 8


# ----------------------------------------------------------------------------- the table
@pytest.mark.parametrize("p,m", [(2, 2), (4, 4), (4, 8)])
def test_2bw_table_has_no_flush_after_the_first_step(p, m):
    """Every step after the first takes m F + m B ticks per stage, no idle cell,
    and touches only its own step's and the next step's micro-batches (versions W(t-1), W(t))."""
    steps = 5
    s = pipedream_2bw(p, m, steps)
    windows = step_windows(p, m, steps)
    assert windows[0] == (0, 2 * m + 2 * (p - 1)) and windows[-1][1] == num_ticks(s)
    for t, (lo, hi) in enumerate(windows):
        cells = [a for row in s.table[lo:hi] for a in row]
        assert {a.microbatch // m for a in cells if a} <= {t, t + 1}
        if 0 < t < steps - 1:
            assert hi - lo == 2 * m and None not in cells
    assert two_bw_versions(s, m)[0] == 2 and max(two_bw_versions(s, m)) == 2
    assert two_bw_versions(one_f_one_b(p, m), m) == (1,) * p
    # the bubble shrinks as steps grow: the fill is paid once
    assert [bubble_fraction(pipedream_2bw(p, m, k)) for k in (1, 4, 16)] == sorted(
        [bubble_fraction(pipedream_2bw(p, m, k)) for k in (1, 4, 16)], reverse=True)
    assert num_ticks(pipedream_2bw(p, m, 16)) / 16 < 2 * m + 1


def test_2bw_per_step_table_is_as_long_as_1f1b_and_needs_m_ge_p():
    p, m = 4, 8
    prog = lower(get_schedule("pipedream-2bw", p, m))
    assert len(prog.ticks) == num_ticks(one_f_one_b(p, m)) and prog.n_res <= p
    with pytest.raises(ValueError, match="pipedream_2bw needs m >= p.*use m >= 4"):
        get_schedule("pipedream-2bw", 4, 2)


# ----------------------------------------------------------------------------- semantics
def _init_params(cfg=ACFG):
    return nnx.to_pure_dict(nnx.state(GPT(cfg, rngs=nnx.Rngs(0)), nnx.Param))


def _reference(tx, batches, cfg=ACFG):
    """One device, sequential: g_t = grad f_t(W(t-1)); W(t+1) = W(t) - update(g_t); W(-1) = W(0)."""
    graphdef = nnx.graphdef(GPT(cfg, rngs=nnx.Rngs(0)))
    grad = jax.jit(jax.value_and_grad(lambda p, b: lm_loss(nnx.merge(graphdef, p), b)))
    params = _init_params(cfg)
    prev, opt, losses = params, tx.init(params), []
    for b in batches:
        loss, g = grad(prev, b)
        updates, opt = tx.update(g, opt, params)
        prev, params = params, optax.apply_updates(params, updates)
        losses.append(float(loss))
    return np.array(losses), jax.device_get(params), jax.device_get(prev)


def _two_bw(p, tx, m=None, cfg=ACFG, sizes=None, zero=0):
    mesh = jaxpar.make_mesh(sizes or {"pipe": p, "data": 8 // p})
    strategy = jaxpar.Strategy(microbatches=m or p, schedule="pipedream-2bw", zero=zero)
    state, layout = jaxpar.init_train_state(lambda: GPT(cfg, rngs=nnx.Rngs(0)), tx, mesh, strategy)
    return mesh, state, layout, jaxpar.make_train_step(lm_loss, tx, layout, strategy)


def _run_2bw(p, tx, batches, **kw):
    """``(losses, final state)`` of the one-step 2BW program over ``batches`` (``kw``: of :func:`_two_bw`)."""
    mesh, state, _, step = _two_bw(p, tx, **kw)
    losses = []
    for b in batches:
        state, metrics = step(state, jaxpar.shard_batch(b, mesh))
        losses.append(float(metrics["loss"]))
    return losses, state


def _batches(n=STEPS, rows=8):
    return [make_batch(rows, ACFG, seed=t) for t in range(n)]


def _assert_trees_close(got, ref, rtol=1e-5, atol=1e-7) -> int:
    """Every leaf within ``rtol`` / ``atol``; returns how many elements are not within rtol / 1e-7."""
    ref_flat = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_flatten_with_path(ref)[0]}
    loose = 0
    for k, v in jax.tree_util.tree_flatten_with_path(got)[0]:
        r = ref_flat[jax.tree_util.keystr(k)]
        np.testing.assert_allclose(v, r, rtol=rtol, atol=atol, err_msg=jax.tree_util.keystr(k))
        loose += int((~np.isclose(v, r, rtol=rtol, atol=1e-7)).sum())
    return loose


@pytest.mark.parametrize("opt", ["sgd", pytest.param("adam", marks=pytest.mark.exhaustive)])
@pytest.mark.parametrize("p", [2, pytest.param(4, marks=pytest.mark.exhaustive)])
def test_2bw_equals_delayed_gradient_reference(p, opt):
    """8 steps of pipe=p x data=8/p 2BW equal sequential delayed-gradient SGD / Adam."""
    tx = optax.sgd(0.5) if opt == "sgd" else optax.adam(1e-2)
    batches = _batches()
    ref_losses, ref_params, ref_prev = _reference(tx, batches)
    losses, state = _run_2bw(p, tx, batches)
    _assert_matches_reference(opt, losses, state, ref_losses, ref_params, ref_prev)
    # the delay matters: the undelayed optimizer's losses differ from step 2 on
    assert not np.allclose(losses[2:], _undelayed_losses(tx, batches)[2:], rtol=1e-3)


@pytest.mark.exhaustive
@pytest.mark.fusion_emitters
def test_2bw_with_zero3_fsdp_and_tensor_equals_delayed_gradient_reference():
    """2BW composes with ZeRO-3 and tensor parallelism on the other axes (pipe2 x fsdp2 x tensor2):
    the same reference, and both weight versions stay sharded over fsdp."""
    tx = optax.adam(1e-2)
    batches = _batches()
    ref_losses, ref_params, ref_prev = _reference(tx, batches)
    losses, state = _run_2bw(2, tx, batches, sizes={"pipe": 2, "fsdp": 2, "tensor": 2}, zero=3)
    _assert_matches_reference("adam", losses, state, ref_losses, ref_params, ref_prev)
    assert "fsdp" in str(state.params["blocks"]["w1"].sharding.spec)
    assert "fsdp" in str(state.versions["blocks"]["w1"].sharding.spec)


def _assert_matches_reference(opt, losses, state, ref_losses, ref_params, ref_prev):
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    # Adam normalises its step: where a gradient is within round-off of zero, round-off moves that
    # element by a fraction of lr (helpers.adam_atol). Seen: at most 0.17% of the elements outside
    # rtol 1e-5 / atol 1e-7, none beyond 2.8e-4 * lr; so Adam gets an absolute allowance of 1e-3 * lr
    # on at most 1% of the elements.
    strict = _assert_trees_close(jax.device_get(state.params), ref_params, atol=1e-7 if opt == "sgd" else 1e-5)
    strict += _assert_trees_close(jax.device_get(state.versions), ref_prev, atol=1e-7 if opt == "sgd" else 1e-5)
    assert strict <= (0 if opt == "sgd" else 1e-2 * sum(np.size(a) for a in jax.tree.leaves(ref_params)) * 2)


# ----------------------------------------------------------------------------- no flush: K steps per call
def _strategy(p, m=None):
    return jaxpar.Strategy(microbatches=m or p, schedule="pipedream-2bw")


def _stacked(batches):
    return jax.tree.map(lambda *b: np.stack(b), *batches)


@pytest.mark.parametrize("opt", ["sgd", pytest.param("adam", marks=pytest.mark.exhaustive)])
@pytest.mark.exhaustive      # the flushed 2BW reference test and the no-flush resume run in the default pass
@pytest.mark.parametrize("p,k", [(2, 4), (4, 8)])
def test_no_flush_program_equals_delayed_gradient_reference(p, k, opt):
    """The no-flush program (steps_per_call=k, the optimizer between windows):
    8 steps (two calls of 4 at p=2, one of 8 at p=4) equal sequential delayed-gradient SGD / Adam."""
    tx = optax.sgd(0.5) if opt == "sgd" else optax.adam(1e-2)
    batches = _batches()
    ref_losses, ref_params, ref_prev = _reference(tx, batches)
    mesh, state, layout, _ = _two_bw(p, tx)
    step = jaxpar.make_train_step(lm_loss, tx, layout, _strategy(p), steps_per_call=k)
    losses = []
    for c in range(0, STEPS, k):
        state, metrics = step(state, _stacked(batches[c:c + k]))
        assert metrics["loss"].shape == (k,) and metrics["grad_norm"].shape == (k,)
        losses += [float(x) for x in metrics["loss"]]
    assert int(state.step) == STEPS
    _assert_matches_reference(opt, losses, state, ref_losses, ref_params, ref_prev)


def _trip_counts(hlo: str, scope: str) -> list[int]:
    """Trip counts of the compiled ``while`` loops made under name scope ``scope``."""
    out = []
    for line in hlo.splitlines():
        op = re.search(r'op_name="([^"]*)"', line)
        if " while(" in line and op and op.group(1).endswith(f"{scope}/while"):
            out.append(int(re.search(r'"known_trip_count":\{"n":"(\d+)"', line).group(1)))
    return out


@pytest.mark.parametrize("p,m", [(2, 2), pytest.param(4, 4, marks=pytest.mark.exhaustive)])
def test_no_flush_program_runs_the_table_ticks(p, m):
    """On the compiled program: one tick loop of 2m + 2(p-1) ticks (the first step,
    with the fill), then a loop over the k-1 later steps around a tick loop of 2m ticks: the
    table's windows, and in all exactly the table's ticks."""
    k = 4 if p == 2 else 3
    tx = optax.sgd(0.5)     # p=2: the programs of the reference tests above (the compile cache serves them)
    mesh, state, layout, _ = _two_bw(p, tx, m)
    step = jaxpar.make_train_step(lm_loss, tx, layout, _strategy(p, m), steps_per_call=k)
    hlo = step.lower(state, _stacked(_batches(k, rows=8))).compile().as_text()
    ticks = sorted(_trip_counts(hlo, TICKS_SCOPE), reverse=True)
    assert ticks == [2 * m + 2 * (p - 1), 2 * m]
    assert _trip_counts(hlo, WINDOWS_SCOPE) == [k - 1]
    assert [hi - lo for lo, hi in step_windows(p, m, k)] == [ticks[0]] + [ticks[1]] * (k - 1)
    assert ticks[0] + (k - 1) * ticks[1] == num_ticks(pipedream_2bw(p, m, k)) == num_ticks(step.pipeline_program.schedule)
    # the flushed 2BW step (steps_per_call=1) fills and drains every step
    one = jaxpar.make_train_step(lm_loss, tx, layout, _strategy(p, m))
    hlo1 = one.lower(state, jaxpar.shard_batch(make_batch(8, ACFG), mesh)).compile().as_text()
    assert _trip_counts(hlo1, TICKS_SCOPE) == [num_ticks(get_schedule("pipedream-2bw", p, m))] == [ticks[0]]


def test_steps_per_call_errors_are_named():
    tx = optax.sgd(0.1)
    mesh, state, layout, _ = _two_bw(2, tx)
    with pytest.raises(ValueError, match=r"make_train_step\(steps_per_call=0\): must be an int >= 1"):
        jaxpar.make_train_step(lm_loss, tx, layout, _strategy(2), steps_per_call=0)
    step = jaxpar.make_train_step(lm_loss, tx, layout, _strategy(2), steps_per_call=2)
    with pytest.raises(ValueError, match=r"every batch leaf must be \[steps=2, batch, ...\]"):
        step(state, _stacked(_batches(3)))


def _undelayed_losses(tx, batches, cfg=ACFG):
    graphdef = nnx.graphdef(GPT(cfg, rngs=nnx.Rngs(0)))
    grad = jax.jit(jax.value_and_grad(lambda p, b: lm_loss(nnx.merge(graphdef, p), b)))
    params = _init_params(cfg)
    opt, losses = tx.init(params), []
    for b in batches:
        loss, g = grad(params, b)
        updates, opt = tx.update(g, opt, params)
        params = optax.apply_updates(params, updates)
        losses.append(float(loss))
    return np.array(losses)


@pytest.mark.exhaustive      # ~27 s: in the exhaustive tier, for the default suite's time
def test_2bw_holds_two_versions_in_the_compiled_step():
    """The compiled 2BW step's arguments are 1F1B's plus one more copy of the
    stage's parameters (two versions per stage), and its temporaries are 1F1B's."""
    tx = optax.sgd(0.1)
    mesh, state, layout, step = _two_bw(2, tx)
    batch = jaxpar.shard_batch(make_batch(8, ACFG), mesh)
    two = step.lower(state, batch).compile().memory_analysis()
    flush = jaxpar.Strategy(microbatches=2, schedule="1f1b")
    s1, l1 = jaxpar.init_train_state(lambda: GPT(ACFG, rngs=nnx.Rngs(0)), tx, mesh, flush)
    one = jaxpar.make_train_step(lm_loss, tx, l1, flush).lower(s1, batch).compile().memory_analysis()
    per_device = sum(a.addressable_shards[0].data.nbytes for a in jax.tree.leaves(state.params))
    assert two.argument_size_in_bytes - one.argument_size_in_bytes == per_device
    # the swap (W(t) becomes the older version while W(t+1) is written) costs at most one transient
    # copy of the stage's parameters in temporaries
    assert two.temp_size_in_bytes <= one.temp_size_in_bytes + 1.05 * per_device


# ----------------------------------------------------------------------------- errors and config
@pytest.mark.parametrize("sizes,kw,match", [
    ({"data": 2}, {"microbatches": 2}, r"schedule='pipedream-2bw' needs a 'pipe' mesh axis > 1"),
    ({"pipe": 4, "data": 2}, {"microbatches": 2}, r"Strategy.microbatches=2 .* use microbatches >= 4"),
])
def test_2bw_bad_settings_are_named(sizes, kw, match):
    mesh = jaxpar.make_mesh(sizes, devices=jax.devices()[:int(np.prod(list(sizes.values())))])
    with pytest.raises(AsyncPipelineError, match=match):
        jaxpar.init_train_state(lambda: GPT(ACFG, rngs=nnx.Rngs(0)), optax.sgd(0.1), mesh,
                                jaxpar.Strategy(schedule="pipedream-2bw", **kw))


def test_2bw_step_needs_a_state_made_for_it():
    mesh = jaxpar.make_mesh({"pipe": 2, "data": 4})
    _, layout = jaxpar.init_train_state(lambda: GPT(ACFG, rngs=nnx.Rngs(0)), optax.sgd(0.1), mesh,
                                        jaxpar.Strategy(microbatches=2))
    with pytest.raises(jaxpar.StrategyMismatchError, match="init_train_state.*fields that differ: schedule"):
        jaxpar.make_train_step(lm_loss, optax.sgd(0.1), layout, jaxpar.Strategy(microbatches=2, schedule="2bw"))


PIPE2 = ["mesh.pipe=2", "mesh.data=2", "mesh.fsdp=1", "mesh.tensor=2", "model.layers=4"]


def test_2bw_in_yaml():
    cfg = load_config(QUICK, [*PIPE2, "parallel.schedule=pipedream-2bw", "parallel.microbatches=4"])
    assert cfg.parallel.schedule == "pipedream-2bw"
    for overrides, match in [(["parallel.microbatches=1"], r"parallel.schedule='pipedream-2bw'.*m >= 2"),
                             (["mesh.pipe=1", "mesh.data=4"], r"needs mesh.pipe > 1"),
                             (["parallel.compression={kind: qsgd}"], r"parallel.compression='qsgd' with parallel.schedule='pipedream-2bw'"),
                             (["parallel.steps_per_call=4", "train.log_every=6"],
                              r"train.log_every=6 is not a multiple of parallel.steps_per_call=4"),
                             (["parallel.steps_per_call=0"], r"parallel.steps_per_call=0: must be an int >= 1"),
                             (["parallel.steps_per_call=2", "parallel.sync={kind: diloco, every: 4}"],
                              r"parallel.steps_per_call=2 with parallel.sync='diloco-h4'")]:
        with pytest.raises(ConfigError, match=match):
            load_config(QUICK, [*PIPE2, "parallel.schedule=pipedream-2bw", "parallel.microbatches=2", *overrides])
    ok = load_config(QUICK, [*PIPE2, "parallel.schedule=pipedream-2bw", "parallel.microbatches=2",
                             "parallel.steps_per_call=4", "train.steps=100", "train.log_every=20", "checkpoint.every=40",
                             "train.eval_every=0"])
    assert ok.parallel.steps_per_call == 4


# ----------------------------------------------------------------------------- checkpoints
@pytest.mark.exhaustive   # 25 s; test_train_loop_runs_k_steps_per_call_and_resumes resumes 2BW bit-exactly by default
def test_2bw_resumes_bit_exact(tmp_path):
    """Saved after 4 steps and resumed, 4 more steps give exactly the uninterrupted run's
    weights and older version (W(t-1) is part of the checkpoint)."""
    tx = optax.adam(1e-2)
    batches = _batches()
    mesh, state, layout, step = _two_bw(2, tx)
    with Checkpointer(tmp_path / "ck", async_save=False) as ck:
        for t, b in enumerate(batches):
            if t == 4:
                ck.save(4, state, wait=True)
            state, _ = step(state, jaxpar.shard_batch(b, mesh))
        whole = jax.device_get((state.params, state.versions))
        _, _, layout2, step2 = _two_bw(2, tx)
        resumed = ck.restore(layout2).state
        for b in batches[4:]:
            resumed, _ = step2(resumed, jaxpar.shard_batch(b, mesh))
    again = jax.device_get((resumed.params, resumed.versions))
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(whole)))


def test_checkpoint_of_another_schedule_resumes_2bw_with_equal_versions(tmp_path):
    tx = optax.sgd(0.1)
    mesh = jaxpar.make_mesh({"pipe": 2, "data": 4})
    state, _ = jaxpar.init_train_state(lambda: GPT(ACFG, rngs=nnx.Rngs(0)), tx, mesh,
                                       jaxpar.Strategy(microbatches=2))
    _, _, layout, _ = _two_bw(2, tx)
    with Checkpointer(tmp_path / "ck", async_save=False) as ck:
        ck.save(0, state, wait=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            restored = ck.restore(layout).state
    assert any("W(t-1) = W(t)" in str(w.message) for w in caught)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(restored.versions),
                                                    jax.tree.leaves(restored.params)))


def test_train_loop_runs_k_steps_per_call_and_resumes(tmp_path):
    """``train(..., steps_per_call=4)`` with the no-flush 2BW program: the stacked batches of its
    steps, a record per logged step, a checkpoint between calls, and a resume from it all equal
    the program called by hand (bit for bit)."""
    import json

    from jaxpar.run import LogOptions, train

    tx, k = optax.sgd(0.5), 4
    batches = _batches()
    mesh, state0, layout, _ = _two_bw(2, tx)
    step = jaxpar.make_train_step(lm_loss, tx, layout, _strategy(2), steps_per_call=k)
    fresh = lambda: jax.tree.map(lambda x: x.copy(), state0)  # noqa: E731  (the step donates its state)
    by_hand, losses = fresh(), []
    for c in range(0, STEPS, k):
        by_hand, m = step(by_hand, _stacked(batches[c:c + k]))
        losses += [float(x) for x in m["loss"]]
    log = LogOptions(log_every=k, out_dir=str(tmp_path / "out"), progress="none", plot=False)
    with Checkpointer(tmp_path / "ck", every=k, async_save=False) as ck:
        state, summary = train(step, fresh(), lambda t: batches[t], mesh=mesh, steps=STEPS, steps_per_call=k,
                               checkpointer=ck, log=log)
        assert summary.losses == losses and ck.steps() == [4, 8]
        for a, b in zip(jax.tree.leaves(jax.device_get(state)), jax.tree.leaves(jax.device_get(by_hand))):
            assert np.array_equal(a, b)
        recs = [json.loads(x) for x in open(tmp_path / "out" / "metrics.jsonl")]
        assert [r["step"] for r in recs] == [4, 8]
        assert abs(recs[1]["loss"] - np.mean(losses[4:])) < 1e-6
        resumed = ck.restore(layout, step=4).state
        resumed, _ = train(step, resumed, lambda t: batches[t], mesh=mesh, steps=4, steps_per_call=k,
                           log=LogOptions(log_every=k, progress="none"))
    for a, b in zip(jax.tree.leaves(jax.device_get(resumed)), jax.tree.leaves(jax.device_get(by_hand))):
        assert np.array_equal(a, b)
    for kw, match in [(dict(steps=6), "steps=6 is not a multiple of steps_per_call=4"),
                      (dict(steps=8, log=LogOptions(log_every=2, progress="none")), "log_every=2"),
                      (dict(steps=8, steps_per_call=0), "steps_per_call")]:
        with pytest.raises(ValueError, match=match):
            train(step, fresh(), lambda t: batches[t], mesh=mesh, **{"steps_per_call": k, **kw})


@pytest.mark.exhaustive        # four compiles, ~90 s on 2 cores
def test_no_flush_program_memory_is_flat_in_m():
    """The K-step program: same micro-batch size, m = 4 -> 16, its temporaries
    grow <= 1.25x (at most p micro-batches' residuals live, as in 1F1B: with this model GPipe's
    grow >= 2.5x, tests/test_pipeline.py), and it holds 1F1B's arguments plus one version."""
    import jax.numpy as jnp

    cfg = GPTConfig(vocab=64, seq_len=64, embed=32, heads=4, layers=4)
    tx, k, rows = optax.sgd(0.1), 2, 4          # 4 rows per micro-batch: 1 per data replica
    mem = {}
    for m in (4, 16):
        mesh, state, layout, _ = _two_bw(2, tx, m=m, cfg=cfg)
        step = jaxpar.make_train_step(lm_loss, tx, layout, _strategy(2, m), steps_per_call=k)
        batches = {n: jax.ShapeDtypeStruct((k, m * rows, cfg.seq_len), jnp.int32) for n in ("tokens", "targets")}
        mem[m] = step.lower(state, batches).compile().memory_analysis()
    flush = jaxpar.Strategy(microbatches=4, schedule="1f1b")
    s1, l1 = jaxpar.init_train_state(lambda: GPT(cfg, rngs=nnx.Rngs(0)), tx, mesh, flush)
    one = jaxpar.make_train_step(lm_loss, tx, l1, flush).lower(
        s1, {n: jax.ShapeDtypeStruct((4 * rows, cfg.seq_len), jnp.int32) for n in ("tokens", "targets")}
    ).compile().memory_analysis()
    t4, t16 = mem[4].temp_size_in_bytes, mem[16].temp_size_in_bytes
    assert t16 <= 1.25 * t4, (t4, t16)
    per_device = sum(a.addressable_shards[0].data.nbytes for a in jax.tree.leaves(s1.params))
    batch_bytes = lambda m: k * 2 * m * rows // 4 * cfg.seq_len * 4   # noqa: E731  (tokens + targets, per device)
    assert mem[4].argument_size_in_bytes - batch_bytes(4) == (one.argument_size_in_bytes - batch_bytes(4) // k
                                                              + per_device), (mem[4], one)
