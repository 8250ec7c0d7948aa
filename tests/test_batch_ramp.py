"""Batch-size ramps (``data.batch_ramp``, :mod:`jaxpar.run._ramp`): the batch of each step, the
records, errors, and a real ``jaxpar train`` killed with SIGKILL mid-ramp and resumed, bit-identical
to an uninterrupted run."""
from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from jaxpar.config import ConfigError, build_data, check, load_config
from jaxpar.run import BatchRamp, ramp_batch_fn
from jaxpar.run._ramp import RampError

from test_compression_train import ARGS, EVERY, QUICK, STEPS, _kill_after_checkpoint, _records, _run, final_states

RAMP = ["data.batch_ramp={sizes: [16, 32, 64], steps: [0, 3, 7]}"]


def test_ramp_batch_fn_asks_the_data_for_the_steps_size():
    seen = []

    def make(step, *, batch_size, rows=None):
        seen.append((step, batch_size, rows))
        return {"x": np.zeros((batch_size, 2))}

    fn = ramp_batch_fn(make, BatchRamp((8, 24), (0, 5)))
    assert [fn(s)["x"].shape[0] for s in (0, 4, 5, 9)] == [8, 8, 24, 24]
    assert seen[-1] == (9, 24, None)
    cfg = load_config(QUICK, [*ARGS, *RAMP])
    batch_fn, _ = build_data(cfg.data, seq_len=cfg.model.seq_len, vocab=cfg.model.vocab, eval_batches=0)
    assert [batch_fn(s)["tokens"].shape for s in (0, 3, 7)] == [(16, 32), (32, 32), (64, 32)]
    np.testing.assert_array_equal(batch_fn(2)["tokens"], batch_fn(2)["tokens"])      # a function of the step


@pytest.mark.parametrize("ramp,words", [
    ("{sizes: [16, 20], steps: [0, 4]}", ["data.batch_ramp", "size 20 (from step 4)", "multiple of 8"]),
    ("{sizes: [32, 64], steps: [0, 4]}", ["data.batch_ramp", "first size 32", "data.batch_size=16"]),
    ("{sizes: [16, 32], steps: [1, 4]}", ["data.batch_ramp", "start at 0"]),
    ("{sizes: [16, 32], steps: [0]}", ["data.batch_ramp", "same length"]),
    ("{sizes: [16], every: 4}", ["data.batch_ramp", "unknown key", "every", "belong to adaptive: true"]),
    ("{sizes: [16], period: 4}", ["data.batch_ramp", "unknown key", "period"]),
    ("{sizes: [16, 32], steps: [0, 4], adaptive: true, every: 4}", ["unknown key", "steps", "a fixed ramp"]),
    ("{sizes: [16, 32], adaptive: true}", ["data.batch_ramp", "needs every"]),
    ("{sizes: [16, 32], adaptive: yes-please, every: 4}", ["data.batch_ramp.adaptive", "true or false"]),
    ("{sizes: [16, 20], adaptive: true, every: 4}", ["allowed size 20", "multiple of 8"]),
    ("{sizes: [16, 32], adaptive: true, every: 4}", ["logging.noise_scale.every is not set",
                                                     "logging.noise_scale.every=k"]),
])
def test_bad_ramps_name_the_key(ramp, words):
    with pytest.raises(ConfigError) as e:
        check(load_config(QUICK, [*ARGS, f"data.batch_ramp={ramp}"]), num_devices=8)
    for w in words:
        assert w in str(e.value), (w, str(e.value))
    with pytest.raises(RampError):
        BatchRamp((16, 8), (0, 0))


@pytest.mark.exhaustive      # three CLI runs in subprocesses; tests/test_faults.py kills and resumes in the default run
def test_resume_mid_ramp_after_sigkill_is_bit_identical(tmp_path):
    ref = tmp_path / "ref"
    r = _run(ref, RAMP)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "global batch ramp 16 from step 0, 32 from step 3, 64 from step 7" in r.stdout
    _kill_after_checkpoint(tmp_path / "run", RAMP, step=EVERY + 2)       # killed at 32, resumed into 64
    r = _run(tmp_path / "run", RAMP, "--resume")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resume   step" in r.stdout
    a = {x["step"]: x for x in _records(ref)}
    b = {x["step"]: x for x in _records(tmp_path / "run")}
    assert [a[s]["batch_size"] for s in range(1, STEPS + 1)] == [16] * 3 + [32] * 4 + [64] * (STEPS - 7)
    for s in range(EVERY + 1, STEPS + 1):
        if s in b:
            assert b[s]["loss"] == a[s]["loss"] and b[s]["batch_size"] == a[s]["batch_size"], s
    states = final_states([ref, tmp_path / "run"], RAMP)
    for x, y in zip(jax.tree.leaves(states[0]), jax.tree.leaves(states[1])):
        np.testing.assert_array_equal(x, y)


@pytest.mark.exhaustive
def test_ramp_matches_decay_at_equal_tokens_and_the_noise_scale_grows(tmp_path):
    """The batch-ramp experiment, as benchmarked (benchmarks/large_batch.py, docs/benchmarks.md section
    10): a batch ramp at a constant learning rate ends within 3% of the cosine-decayed batch-32 run
    (eval loss, same tokens, fewer steps); the measured noise scale grows over training."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "lb.json"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS" and not k.startswith("JAX_")}
    r = subprocess.run([sys.executable, str(root / "benchmarks" / "large_batch.py"), "--only", "ramp,noise",
                        "--img", str(tmp_path), "--json", str(out)], cwd=root, env=env, capture_output=True,
                       text=True, timeout=3000)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())["results"]
    decay, ramp = res["B=32, cosine lr decay"], res["ramp 32-64-128, constant lr"]
    assert ramp["tokens"] == decay["tokens"] and ramp["steps"] < decay["steps"]
    assert ramp["eval_loss"] <= 1.03 * decay["eval_loss"], res
    noise = res["B=32, noise scale every 5"]["noise_scale"]
    assert noise["last"] > 10 * noise["first"], noise
    assert (tmp_path / "large_batch_noise.png").stat().st_size > 10_000


# --- adaptive ramps: the batch grows toward the measured noise scale ---------------------------------------

def _adaptive_run(d, steps: int, *, factor: float, restore: int | None = None):
    """A small classifier on data=4 whose batch grows among 8..64 by the noise scale (measured every
    step), checkpointed every 6 steps; ``restore``: resume from that checkpoint of ``d`` instead."""
    import optax
    from flax import nnx

    import jaxpar
    from jaxpar.models import MLPClassifier, classifier_loss
    from jaxpar.run import Checkpointer
    from jaxpar.run import LogOptions, train
    from jaxpar.step import with_noise_scale
    from jaxpar.run import AdaptiveRamp

    mesh = jaxpar.make_mesh({"data": 4}, devices=jax.devices()[:4])
    tx = optax.sgd(0.2)
    model_fn = lambda: MLPClassifier(features=4, embed=8, mlp=8, classes=3, depth=1, rngs=nnx.Rngs(0))  # noqa
    state, layout = with_noise_scale(*jaxpar.init_train_state(model_fn, tx, mesh), every=1, ema=0.5)
    step = jaxpar.make_train_step(classifier_loss, tx, layout)
    ramp = AdaptiveRamp((8, 16, 32, 64), every=3, factor=factor)

    def make(i, *, batch_size):
        x = np.random.default_rng(i).normal(size=(batch_size, 4)).astype(np.float32)
        return {"x": x, "y": (x[:, 0] + 0.5 * x[:, 1] > 0).astype(np.int32)}

    with Checkpointer(f"{d}/ck", every=6, async_save=False) as ck:
        start = 0
        if restore is not None:
            restored = ck.restore(layout, step=restore)
            state, start = restored.state, restore
            ramp.load_state_dict(restored.meta["batch_ramp"])
        state, _ = train(step, state, ramp_batch_fn(make, ramp), mesh=mesh, steps=steps - start, start_step=start,
                         checkpointer=ck, ramp=ramp, log=LogOptions(log_every=1, out_dir=f"{d}/out", progress="none"))
    records = [json.loads(line) for line in open(f"{d}/out/metrics.jsonl")]
    return state, ramp, records


def test_adaptive_ramp_follows_the_noise_scale_and_resumes_bit_exact(tmp_path):
    state, ramp, records = _adaptive_run(tmp_path / "ref", 12, factor=0.5)
    train_recs = {r["step"]: r for r in records if r.get("kind") == "train"}
    grown = [r for r in records if r.get("kind") == "batch_ramp"]
    assert grown and grown[0]["step"] <= 6, (grown, ramp)        # a decision before the checkpoint of step 6
    assert 8 < grown[0]["batch_size"] < 64                       # toward the noise scale, not to the largest size
    size = 8
    for done in range(3, 12, 3):                                 # the rule, on the logged noise scale
        b = train_recs[done]["noise_scale"]
        want = max([s for s in (8, 16, 32, 64) if s <= 0.5 * b] + [size])
        assert ramp.size_at(done) == want, (done, b, ramp)
        size = want
    for s in range(1, 13):                                       # each step ran with its size
        assert train_recs[s]["batch_size"] == ramp.size_at(s - 1)
    # resumed from step 6 (with the decisions of the checkpoint's record) = uninterrupted, bit for bit
    import shutil
    shutil.copytree(tmp_path / "ref" / "ck", tmp_path / "run" / "ck")
    shutil.rmtree(tmp_path / "run" / "ck" / "12")
    resumed, ramp2, records2 = _adaptive_run(tmp_path / "run", 12, factor=0.5, restore=6)
    assert ramp2.state_dict() == ramp.state_dict()
    for a, b in zip(jax.tree.leaves(jax.device_get(state)), jax.tree.leaves(jax.device_get(resumed))):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    assert [r for r in records2 if r.get("kind") == "batch_ramp"] == [r for r in grown if r["step"] > 6]


def test_adaptive_ramp_rule_state_and_errors():
    from jaxpar.run import AdaptiveRamp

    r = AdaptiveRamp((16, 32, 64, 128), every=5, factor=2.0, start=10)
    assert not r.due(5) and r.due(10) and not r.due(12)
    assert r.decide(10, float("nan")) is None and r.decide(10, 7.9) is None     # nothing measured / 15.8 < 32
    assert r.decide(10, 20.0) == 32 and r.decide(15, 20.0) is None             # 40 -> 32; no growth twice
    assert r.decide(20, 10.0) is None                                          # it never shrinks
    assert r.decide(25, 1e9) == 128 and [r.size_at(s) for s in (9, 10, 24, 25)] == [16, 32, 32, 128]
    assert r.tokens_before(26, seq_len=2) == 2 * (10 * 16 + 15 * 32 + 1 * 128)
    again = AdaptiveRamp((16, 32, 64, 128), every=5)
    again.load_state_dict(r.state_dict())
    assert again.state_dict() == r.state_dict() == {"decisions": [[0, 16], [10, 32], [25, 128]]}
    assert again.decide(10, 40.0) == 32 and again.state_dict() == {"decisions": [[0, 16], [10, 32]]}  # a rerun
    with pytest.raises(RampError, match=r"size\(s\) \[48\]"):
        again.load_state_dict({"decisions": [[0, 16], [4, 48]]})
    for kw, match in [(dict(sizes=(32, 16), every=5), "increase strictly"), (dict(sizes=(16,), every=0), "every=0"),
                      (dict(sizes=(16, 32), every=5, factor=0), "factor=0"), (dict(sizes=(), every=5), "non-empty"),
                      (dict(sizes=(16,), every=5, start=-1), "start=-1")]:
        with pytest.raises(RampError, match=match):
            AdaptiveRamp(**kw)
    with pytest.raises(RampError, match="allowed size 40 is not divisible by data = 16"):
        AdaptiveRamp((16, 40), every=5).check_divisible(16, "data = 16")
