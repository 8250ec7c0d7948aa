"""PipeDream weight stashing: the version rule on the no-flush table, the per-stage train step
against a one-device per-stage reference, the compiled tick loop, checkpoints and named errors."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxpar
from jaxpar.config import ConfigError, load_config
from jaxpar.models import GPT, GPTConfig, lm_loss
from jaxpar.parallel.pipeline import bubble_fraction
from jaxpar.parallel.pipeline import pipedream
from jaxpar.parallel.pipeline._schedules import gpipe, num_ticks, one_f_one_b
from jaxpar.parallel.pipeline._stage import TICKS_SCOPE
from jaxpar.errors import StashingError
from jaxpar.parallel.pipeline._pipedream import lower_stashed, older_versions, stashed_versions, update_ticks, version
from jaxpar.run import Checkpointer, CheckpointWarning

from helpers import make_batch
from test_async_pipeline import _assert_trees_close, _trip_counts
from test_cli import QUICK

SCFG = GPTConfig(vocab=32, seq_len=8, embed=16, heads=2, layers=4)
ROWS = 16
SEED = 100   # see _batches


# ----------------------------------------------------------------------------- the table
@pytest.mark.parametrize("p,m", [(2, 2), (4, 4), (4, 2)])
@pytest.mark.parametrize("k", [1, 2])
def test_table_has_no_flush_and_at_most_p_minus_s_versions(p, m, k):
    """On the table: every step after the first adds exactly m F + m B ticks per
    stage (no idle cell), and stage s holds at most p - s versions (every stage at most p with
    vertical sync); m < p is allowed (the version rule does not depend on m)."""
    if m % k:
        pytest.skip("update_every must divide m")
    steps = 4
    s = pipedream(p, m, steps)
    assert num_ticks(s) == 2 * m * steps + 2 * (p - 1)
    assert [num_ticks(pipedream(p, m, n + 1)) - num_ticks(pipedream(p, m, n)) for n in (1, 2, 3)] == [2 * m] * 3
    steady = s.table[2 * (p - 1) + 2 * m: num_ticks(s) - 2 * (p - 1) - 2 * m]   # between the fill and the drain
    assert steady and all(a is not None for row in steady for a in row)
    assert bubble_fraction(pipedream(p, m, 16)) < bubble_fraction(pipedream(p, m, 4)) < bubble_fraction(
        pipedream(p, m, 1))
    got = stashed_versions(s, update_every=k)
    assert all(n <= p - st for st, n in enumerate(got)) and got[-1] == 1 and got[0] == older_versions(p, k) + 1
    assert max(stashed_versions(s, update_every=k, vertical_sync=True)) <= p
    sp = lower_stashed(s, m=m, update_every=k)
    assert sp.n_slots == older_versions(p, k) + 1 == max(got)      # what the compiled program holds per stage
    assert len(update_ticks(s, k)) == p * m * steps // k


@pytest.mark.parametrize("vsync", [False, True])
def test_each_forward_reads_the_newest_version_or_stage_0s(vsync):
    """The version rule against the table: F(i) on stage s runs after max(0, i - (p-1-s)) of the
    stage's backwards, so without vertical sync it reads the stage's newest version (an older one
    kept in the state for the first p-1-s forwards of a call); with it, the version stage 0 read."""
    p, m, k = 4, 4, 2
    s = pipedream(p, m, 3)
    for st in range(p):
        done = 0
        for row in s.table:
            a = row[st]
            if a is None:
                continue
            if a.kind == "B":
                done += 1
                continue
            v = version(p, st, a.microbatch, k, vsync)
            if vsync:
                assert v == version(p, 0, a.microbatch, k) <= done // k
            elif a.microbatch >= p - 1 - st:
                assert v == done // k
            else:
                assert -older_versions(p, k) <= v < 0 and done == 0


def test_table_errors_are_named():
    with pytest.raises(StashingError, match=r"tick 2, stage 0: F\(mb=2, chunk=0\) runs after 0 backwards"
                                            r".*not a 1F1B table.*pipedream\(p, m"):
        lower_stashed(gpipe(2, 4), m=4)
    with pytest.raises(StashingError, match="update_every=3 must divide the micro-batches per step m=4"):
        lower_stashed(pipedream(2, 4, 3), m=4, update_every=3)
    assert lower_stashed(one_f_one_b(2, 4), m=4).n_slots == 2       # 1F1B's own order, one step: legal


# ----------------------------------------------------------------------------- semantics
def _params(cfg=SCFG):
    return nnx.to_pure_dict(nnx.state(GPT(cfg, rngs=nnx.Rngs(0)), nnx.Param))


PRE, POST = ("wte", "wpe"), ("lnf_scale", "lnf_bias", "head")     # GPT's leaves before / after the blocks


def _reference(tx, batches, p, m, k=1, vsync=False, cfg=SCFG):
    """One device, micro-batch by micro-batch: stage s keeps every version W_s(u) (a whole tree, of
    which it owns its layers and its outer leaves) and its own optimizer state. Micro-batch i runs
    forward and backward on W_s(v_s(i)) at every stage s, v_s(i) = floor(max(0, i - d_s) / k),
    d_s = p-1-s (p-1 on every stage with vertical sync); after every k-th micro-batch each stage
    applies its optimizer to the mean of the k gradients (its own part of them)."""
    graphdef = nnx.graphdef(GPT(cfg, rngs=nnx.Rngs(0)))
    grad = jax.jit(jax.value_and_grad(lambda w, b: lm_loss(nnx.merge(graphdef, w), b)))
    w0 = _params(cfg)
    hist = [[w0] for _ in range(p)]          # hist[s][u] = W_s(u)
    opt = [tx.init(w0) for _ in range(p)]
    acc = jax.tree.map(jnp.zeros_like, w0)
    add = jax.jit(lambda a, g: jax.tree.map(lambda x, y: x + y / k, a, g))
    assemble = jax.jit(lambda trees: _assemble(trees, cfg.layers // p))

    @jax.jit
    def update(g, o, w):
        u, o = tx.update(g, o, w)
        return optax.apply_updates(w, u), o

    losses = []
    for t, batch in enumerate(batches):
        mbs = jax.tree.map(lambda x: np.asarray(x).reshape(x.shape[0] // m, m, *x.shape[1:]).swapaxes(0, 1), batch)
        total = 0.0
        for j in range(m):
            i = t * m + j
            v = [max(0, i - ((p - 1) if vsync else (p - 1 - s))) // k for s in range(p)]
            loss, g = grad(assemble([hist[s][v[s]] for s in range(p)]),
                           jax.tree.map(lambda x, j=j: x[j], mbs))
            total += float(loss) / m
            acc = add(acc, g)    # every stage keeps its own part of it
            if (i + 1) % k == 0:
                for s in range(p):
                    w, opt[s] = update(acc, opt[s], hist[s][-1])
                    hist[s].append(w)
                acc = jax.tree.map(jnp.zeros_like, acc)
        losses.append(total)
    # what the state keeps: each stage's newest version, then its older ones (W(0) repeated at first)
    kept = [assemble([hist[s][max(0, len(hist[s]) - 1 - j)] for s in range(p)])
            for j in range(older_versions(p, k) + 1)]
    return np.array(losses), jax.device_get(kept)


def _assemble(stage_trees, per):
    """One parameter tree from per-stage trees: stage s's layers, stage 0's leaves before the
    blocks and the last stage's after them (the owners)."""
    p = len(stage_trees)
    w = {n: stage_trees[0][n] for n in PRE} | {n: stage_trees[p - 1][n] for n in POST}
    w["blocks"] = jax.tree.map(lambda *a: jnp.concatenate(a), *(jax.tree.map(
        lambda x, s=s: x[s * per:(s + 1) * per], stage_trees[s]["blocks"]) for s in range(p)))
    return w


def _setup(p, tx, m, k=1, vsync=False, steps=1, cfg=SCFG, sizes=None, zero=0):
    mesh = jaxpar.make_mesh(sizes or {"pipe": p, "data": 8 // p})
    strategy = jaxpar.Strategy(microbatches=m, schedule="pipedream", update_every=k, vertical_sync=vsync, zero=zero)
    state, layout = jaxpar.init_train_state(lambda: GPT(cfg, rngs=nnx.Rngs(0)), tx, mesh, strategy)
    return mesh, state, layout, jaxpar.make_train_step(lm_loss, tx, layout, strategy, steps_per_call=steps)


def _batches(n, cfg=SCFG):
    """Seeds from 100: with seed 0, the first update group (k=2) of the Adam case holds an element
    (blocks.w2[3, 12, 11]) whose two micro-batch gradients cancel to 4e-6 of their size, and Adam's
    first step there, g / (|g| + eps), is decided by fp32 round-off (1.4% of lr, then every later
    value drifts); the reference and the pipeline agree to round-off everywhere else."""
    return [make_batch(ROWS, cfg, seed=SEED + t) for t in range(n)]


def _stacked(batches):
    return jax.tree.map(lambda *b: np.stack(b), *batches)


def _run(p, tx, batches, m, k=1, vsync=False, steps=1, sizes=None, zero=0):
    mesh, state, _, step = _setup(p, tx, m, k, vsync, steps, sizes=sizes, zero=zero)
    losses = []
    for c in range(0, len(batches), steps):
        if steps == 1:
            state, metrics = step(state, jaxpar.shard_batch(batches[c], mesh))
        else:
            state, metrics = step(state, _stacked(batches[c:c + steps]))
        losses += list(np.atleast_1d(jax.device_get(metrics["loss"])))
    return losses, state, step


def _assert_matches(opt, losses, state, ref_losses, ref_versions):
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    atol = 1e-7 if opt == "sgd" else 1e-5      # Adam: as in test_async_pipeline (round-off near zero gradients)
    loose = _assert_trees_close(jax.device_get(state.params), ref_versions[0], atol=atol)
    for got, ref in zip(state.versions, ref_versions[1:]):
        loose += _assert_trees_close(jax.device_get(got), ref, atol=atol)
    size = sum(np.size(a) for a in jax.tree.leaves(ref_versions[0])) * len(ref_versions)
    assert loose <= (0 if opt == "sgd" else 1e-2 * size)


CASES = [  # p, optimizer, m, update_every, vertical sync, steps per call
    # pipe 2 x data 4, SGD, K = 2: in the exhaustive tier; the default run has it on pipe 2 x fsdp 2 x data 2 (below)
    pytest.param(2, "sgd", 2, 1, False, 2, id="p2-sgd", marks=pytest.mark.exhaustive),
    pytest.param(2, "adam", 4, 2, True, 1, id="p2-adam-k2-vsync", marks=pytest.mark.exhaustive),   # default: resume test
    pytest.param(4, "sgd", 4, 1, False, 3, id="p4-sgd", marks=pytest.mark.exhaustive),
    pytest.param(4, "adam", 4, 1, False, 1, id="p4-adam", marks=pytest.mark.exhaustive),
    pytest.param(4, "sgd", 4, 2, True, 2, id="p4-sgd-k2-vsync", marks=pytest.mark.exhaustive),
]


@pytest.mark.parametrize("p,opt,m,k,vsync,steps", CASES)
def test_stashing_equals_per_stage_reference(p, opt, m, k, vsync, steps):
    """4 optimizer steps of pipe=p x data=8/p weight stashing equal the per-stage
    one-device reference (losses, the newest version and the older ones kept), rtol 1e-5."""
    tx = optax.sgd(0.5) if opt == "sgd" else optax.adam(1e-2)
    batches = _batches(4 if steps < 3 else 6)
    ref_losses, ref_versions = _reference(tx, batches, p, m, k, vsync)
    losses, state, _ = _run(p, tx, batches, m, k, vsync, steps)
    assert int(state.step) == len(batches)
    _assert_matches(opt, losses, state, ref_losses, ref_versions)


FSDP2 = {"pipe": 2, "fsdp": 2, "data": 2}
SHARDED = [  # mesh, zero, optimizer, m, update_every, steps per call
    pytest.param(FSDP2, 0, "sgd", 2, 1, 2, id="fsdp2-data2-sgd-K2", marks=pytest.mark.exhaustive),
    pytest.param({"pipe": 2, "data": 4}, 1, "adam", 4, 2, 1, id="zero1-adam-k2", marks=pytest.mark.exhaustive),
    pytest.param({"pipe": 2, "fsdp": 2, "tensor": 2}, 3, "adam", 2, 1, 1, id="zero3-fsdp2-tensor2-adam",
                 marks=pytest.mark.exhaustive),
]


@pytest.mark.parametrize("sizes,zero,opt,m,k,steps", SHARDED)
def test_stashing_with_sharded_weights_equals_per_stage_reference(sizes, zero, opt, m, k, steps):
    """Weight stashing composes with FSDP / ZeRO on the other axes: the stage's version buffers and
    optimizer state follow the parameters' sharding (XLA gathers them for each action), and the
    numbers are the reference's."""
    tx = optax.sgd(0.5) if opt == "sgd" else optax.adam(1e-2)
    batches = _batches(4)
    ref_losses, ref_versions = _reference(tx, batches, sizes["pipe"], m, k)
    losses, state, _ = _run(sizes["pipe"], tx, batches, m, k, steps=steps, sizes=sizes, zero=zero)
    assert int(state.step) == len(batches)
    _assert_matches(opt, losses, state, ref_losses, ref_versions)
    if sizes.get("fsdp", 1) > 1:     # the state really is sharded over fsdp (not gathered on the way out)
        assert "fsdp" in str(state.params["blocks"]["w1"].sharding.spec)
        assert all("fsdp" in str(v["blocks"]["w1"].sharding.spec) for v in state.versions)


@pytest.mark.exhaustive
def test_stashing_memory_shrinks_with_fsdp():
    """FSDP shards what weight stashing holds: per device, the compiled step's arguments (current
    version, older versions, Adam's state) are 1/4 with fsdp=4 of what data=4 holds (to the few
    replicated scalars), and its temporaries (the in-loop version buffer among them) are smaller."""
    cfg = GPTConfig(vocab=64, seq_len=8, embed=64, heads=2, layers=4)

    def memory(sizes):
        mesh, state, _, step = _setup(2, optax.adam(1e-3), 2, cfg=cfg, sizes=sizes)
        return step.lower(state, jaxpar.shard_batch(make_batch(ROWS, cfg, seed=0), mesh)).compile().memory_analysis()

    data, fsdp = memory({"pipe": 2, "data": 4}), memory({"pipe": 2, "fsdp": 4})
    np.testing.assert_allclose(fsdp.argument_size_in_bytes, data.argument_size_in_bytes / 4, rtol=0.02)
    assert fsdp.temp_size_in_bytes < 0.75 * data.temp_size_in_bytes


def test_stashing_is_not_the_flushed_step():
    """The stash matters: the reference without stashing (every stage on its newest weights, as a
    1F1B with per-micro-batch updates and a flush would run) gives other losses."""
    tx, p, m = optax.sgd(0.5), 2, 2
    batches = _batches(4)
    stashed, _ = _reference(tx, batches, p, m)
    sync, _ = _reference(tx, batches, p, m, vsync=True)
    assert not np.allclose(stashed[1:], sync[1:], rtol=1e-4)


def test_compiled_program_runs_the_table_ticks():
    """On the compiled program: one tick loop of the table's 2mK + 2(p-1) ticks for K
    optimizer steps (2m per step after the first), and 1F1B's per-step count with K = 1. Each stage
    updates m = 2 times a step: step t logs the rate of its last update, ``schedule(2t + 1)``, which the
    first stage's optimizer state holds (the schedule in ``optax.inject_hyperparams``)."""
    p, m, k = 2, 2, 2                                  # the program of the fsdp2-data2-sgd-K2 case
    schedule = lambda count: 0.5 / (1.0 + count)       # noqa: E731
    tx = optax.inject_hyperparams(optax.sgd)(learning_rate=schedule)
    mesh, state, _, step = _setup(p, tx, m, steps=k, sizes=FSDP2)
    compiled = step.lower(state, _stacked(_batches(k))).compile()
    ticks = [num_ticks(pipedream(p, m, k))]
    assert _trip_counts(compiled.as_text(), TICKS_SCOPE) == ticks == [2 * m * k + 2 * (p - 1)]
    assert step.pipeline_program.n_slots == p      # version slots per stage in the program (sized by stage 0)
    state, metrics = compiled(state, _stacked(_batches(k)))
    np.testing.assert_allclose(jax.device_get(metrics["lr"]), [schedule(1), schedule(3)], rtol=1e-6)
    assert float(jaxpar.optimizers.learning_rate(state.opt_state)) == pytest.approx(schedule(3), rel=1e-6)


# ----------------------------------------------------------------------------- checkpoints
@pytest.mark.exhaustive      # ~30 s: in the exhaustive tier; the cross-schedule checkpoint test stays in the default run
def test_stashing_resumes_bit_exact(tmp_path):
    """Saved after 2 steps and resumed, 2 more give exactly the uninterrupted run's newest and
    older versions and optimizer state (the stash and each stage's state are in the checkpoint);
    the uninterrupted run (Adam, update_every=2, vertical sync) equals the per-stage reference."""
    tx, p, m, k = optax.adam(1e-2), 2, 4, 2          # the program of the p2-adam-k2-vsync case
    batches = _batches(4)
    mesh, state, _, step = _setup(p, tx, m, k, True)
    losses = []
    with Checkpointer(tmp_path / "ck", async_save=False) as ck:
        for t, b in enumerate(batches):
            if t == 2:
                ck.save(2, state, wait=True)
            state, metrics = step(state, jaxpar.shard_batch(b, mesh))
            losses.append(float(metrics["loss"]))
        whole = jax.device_get((state.params, state.versions, state.opt_state))
        _, _, layout2, step2 = _setup(p, tx, m, k, True)
        resumed = ck.restore(layout2).state
        for b in batches[2:]:
            resumed, _ = step2(resumed, jaxpar.shard_batch(b, mesh))
    again = jax.device_get((resumed.params, resumed.versions, resumed.opt_state))
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(whole)))
    _assert_matches("adam", losses, state, *_reference(tx, batches, p, m, k, vsync=True))


def test_checkpoint_of_another_schedule_restores_into_stashing_and_back(tmp_path):
    """A 1F1B checkpoint resumes weight stashing with every older version = W(t) (as at step 0, with
    a warning); a stashing checkpoint resumes 1F1B (the older versions are left behind) and a
    stashing layout keeping another number of versions (pipe=4: 3 instead of 1)."""
    tx = optax.adam(1e-2)
    flushed = jaxpar.Strategy(microbatches=2)
    mesh = jaxpar.make_mesh({"pipe": 2, "data": 4})
    model = lambda: GPT(SCFG, rngs=nnx.Rngs(0))                                     # noqa: E731
    state, flush_layout = jaxpar.init_train_state(model, tx, mesh, flushed)
    state = state._replace(params=jax.tree.map(lambda a: a + 1.0, state.params))     # not the init
    _, stash_layout = jaxpar.init_train_state(model, tx, mesh, jaxpar.Strategy(microbatches=2, schedule="pipedream"))
    mesh4 = jaxpar.make_mesh({"pipe": 4, "data": 2})
    _, stash4 = jaxpar.init_train_state(model, tx, mesh4, jaxpar.Strategy(microbatches=4, schedule="pipedream"))
    with Checkpointer(tmp_path / "ck", async_save=False) as ck:
        ck.save(0, state, wait=True)
        with pytest.warns(CheckpointWarning, match=r"W\(t-1\) = W\(t\)"):
            stashed = ck.restore(stash_layout).state
        assert len(stashed.versions) == 1
        for v in stashed.versions:
            assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(v), jax.tree.leaves(state.params)))
            assert jax.tree.structure(v) == jax.tree.structure(state.params)
        ck.save(1, stashed._replace(step=stashed.step + 1), wait=True)
        back = ck.restore(flush_layout).state
        with pytest.warns(CheckpointWarning, match=r"W\(t-1\) = W\(t\)"):
            four = ck.restore(stash4).state
    assert back.versions == () and int(back.step) == 1
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(back.params), jax.tree.leaves(state.params)))
    assert len(four.versions) == 3
    assert all(np.array_equal(a, b) for v in four.versions for a, b in zip(jax.tree.leaves(v),
                                                                            jax.tree.leaves(state.params)))


# ----------------------------------------------------------------------------- errors and config
def test_stashing_options_with_a_flushing_schedule_are_named():
    with pytest.raises(ValueError, match=r"update_every=2, vertical_sync=False are weight-stashing options, but "
                                         r"schedule='1f1b' flushes"):
        jaxpar.Strategy(microbatches=4, update_every=2)
    with pytest.raises(ValueError, match=r"vertical_sync=True .* schedule='pipedream-2bw' flushes"):
        jaxpar.Strategy(microbatches=4, schedule="2bw", vertical_sync=True)
    with pytest.raises(ValueError, match=r"Strategy.update_every=0: must be a positive int"):
        jaxpar.Strategy(schedule="pipedream", update_every=0)


@pytest.mark.parametrize("sizes,kw,match", [
    ({"data": 2}, {"microbatches": 2}, r"schedule='pipedream' needs a 'pipe' mesh axis > 1"),
    ({"pipe": 2, "data": 2}, {"microbatches": 4, "update_every": 3},
     r"Strategy.update_every=3 does not divide Strategy.microbatches=4"),
])
def test_bad_settings_are_named(sizes, kw, match):
    mesh = jaxpar.make_mesh(sizes, devices=jax.devices()[:int(np.prod(list(sizes.values())))])
    with pytest.raises(StashingError, match=match):
        jaxpar.init_train_state(lambda: GPT(SCFG, rngs=nnx.Rngs(0)), optax.sgd(0.1), mesh,
                                jaxpar.Strategy(schedule="pipedream", **kw))


def test_step_errors_are_named():
    mesh = jaxpar.make_mesh({"pipe": 2, "data": 4})
    strategy = jaxpar.Strategy(microbatches=2, schedule="pipedream")
    _, layout = jaxpar.init_train_state(lambda: GPT(SCFG, rngs=nnx.Rngs(0)), optax.sgd(0.1), mesh, strategy)
    with pytest.raises(StashingError, match=r"clip_norm=1.0 with schedule='pipedream'.*clip_norm=None"):
        jaxpar.make_train_step(lm_loss, optax.sgd(0.1), layout, strategy, clip_norm=1.0)
    clipped = optax.chain(optax.clip_by_global_norm(0.1), optax.sgd(0.1))
    _, layout_c = jaxpar.init_train_state(lambda: GPT(SCFG, rngs=nnx.Rngs(0)), clipped, mesh, strategy)
    with pytest.raises(StashingError, match=r"does not update each pipeline stage's parameters on their own"):
        jaxpar.make_train_step(lm_loss, clipped, layout_c, strategy)
    _, flush = jaxpar.init_train_state(lambda: GPT(SCFG, rngs=nnx.Rngs(0)), optax.sgd(0.1), mesh,
                                       jaxpar.Strategy(microbatches=2))
    with pytest.raises(jaxpar.StrategyMismatchError, match=r"'pp2-pipedream-m2-dp4'.*'pp2-1f1b-m2-dp4'.*schedule"):
        jaxpar.make_train_step(lm_loss, optax.sgd(0.1), flush, strategy)


class _Tied(nnx.Module):
    """An input projection, stacked layers, and the projection's transpose as the head (tied)."""

    def __init__(self):
        self.w_in = nnx.Param(jnp.full((3, 4), 0.1))
        self.blocks = nnx.Param(jnp.stack([jnp.eye(4)] * 2))

    def __call__(self, x):
        h = jaxpar.run_layers(lambda w, h: jnp.tanh(h @ w), self.blocks[...], x @ self.w_in[...])
        return h @ self.w_in[...].T


def test_tied_weights_are_named():
    mesh = jaxpar.make_mesh({"pipe": 2, "data": 4})
    strategy = jaxpar.Strategy(microbatches=2, schedule="pipedream")
    tx = optax.sgd(0.1)
    state, layout = jaxpar.init_train_state(_Tied, tx, mesh, strategy)
    step = jaxpar.make_train_step(lambda model, b: jnp.mean((model(b["x"]) - b["x"]) ** 2), tx, layout, strategy)
    with pytest.raises(StashingError, match=r"parameters \['w_in'\] are read both before the stacked blocks"):
        step(state, jaxpar.shard_batch({"x": np.ones((8, 3), np.float32)}, mesh))


PIPE2 = ["mesh.pipe=2", "mesh.data=4", "mesh.fsdp=1", "mesh.tensor=1", "model.layers=4"]


def test_stashing_in_yaml():
    cfg = load_config(QUICK, [*PIPE2, "parallel.schedule=pipedream", "parallel.microbatches=4",
                              "parallel.update_every=2", "parallel.vertical_sync=true", "optimizer.clip_norm=null"])
    assert (cfg.parallel.schedule, cfg.parallel.update_every, cfg.parallel.vertical_sync) == ("pipedream", 2, True)
    sharded = load_config(QUICK, ["mesh.pipe=2", "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=1", "model.layers=4",
                                  "parallel.schedule=pipedream", "parallel.zero=3", "optimizer.clip_norm=null"])
    assert (sharded.mesh.fsdp, sharded.parallel.zero) == (2, 3)          # FSDP / ZeRO compose with stashing
    for overrides, match in [(["parallel.update_every=3"], r"parallel.update_every=3 does not divide"),
                             (["optimizer.clip_norm=1.0"], r"optimizer.clip_norm=1.0 with parallel.schedule"),
                             (["mesh.pipe=1", "mesh.data=8"], r"parallel.schedule='pipedream' needs mesh.pipe > 1"),
                             (["parallel.schedule=1f1b"], r"parallel.update_every=2.*weight-stashing options"),
                             (["parallel.compression={kind: qsgd}"], r"parallel.compression='qsgd' with parallel.schedule='pipedream'")]:
        with pytest.raises(ConfigError, match=match):
            load_config(QUICK, [*PIPE2, "parallel.schedule=pipedream", "parallel.microbatches=4",
                                "parallel.update_every=2", "optimizer.clip_norm=null", *overrides])


def test_gantt_chart_marks_the_updates(tmp_path):
    from jaxpar.parallel.pipeline._render import render_png

    s = pipedream(4, 4, 2)
    path = render_png(s, tmp_path / "pipedream.png", step_size=4, updates=update_ticks(s, 2))
    assert path.endswith(".png") and (tmp_path / "pipedream.png").stat().st_size > 0


def test_yaml_schedule_reads_the_step_not_the_update_count():
    """With ``update_every < microbatches`` a stage updates ``m / k`` times per step; the optimizer's
    schedule (built from YAML, written in steps) then reads ``count // (m / k)``: every update of
    step ``t`` uses the logged ``lr(t)``, and warm-up and decay last as many steps as configured."""
    import jax.numpy as jnp

    from jaxpar.config._job import updates_per_step
    from jaxpar.config import build_optimizer, build_strategy
    from test_cli import QUICK

    cfg = load_config(QUICK, ["mesh.pipe=2", "mesh.data=4", "mesh.fsdp=1", "mesh.tensor=1", "model.layers=4",
                              "parallel.schedule=pipedream", "parallel.microbatches=4", "parallel.update_every=1",
                              "optimizer.name=sgd", "optimizer.momentum=0", "optimizer.weight_decay=0",
                              "optimizer.warmup_steps=5", "optimizer.clip_norm=null", "train.steps=20"])
    per_step = updates_per_step(build_strategy(cfg.parallel), {"pipe": 2, "data": 4})
    assert per_step == 4
    tx, schedule = build_optimizer(cfg.optimizer, cfg.train.steps, updates_per_step=per_step)
    params = {"w": jnp.zeros(())}
    state = tx.init(params)
    lrs = []
    for _ in range(12):                    # 3 steps of 4 updates each
        updates, state = tx.update({"w": jnp.ones(())}, state, params)
        lrs.append(-float(updates["w"]))
    want = [float(schedule(t)) for t in range(3) for _ in range(4)]
    np.testing.assert_allclose(lrs, want, rtol=1e-6)
    assert lrs[0] < lrs[4] < lrs[8]        # still warming up: the schedule moved once per step

