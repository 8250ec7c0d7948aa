"""Batch-size ramps (``data.batch_ramp``, :mod:`jaxpar.train.ramp`): the batch of each step, the
records, errors, and a real ``jaxpar train`` killed with SIGKILL mid-ramp and resumed, bit-identical
to an uninterrupted run."""
from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxpar.config import ConfigError, build_data, check, load_config
from jaxpar.train.ramp import BatchRamp, RampError, ramp_batch_fn

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
    ("{sizes: [16], every: 4}", ["data.batch_ramp", "unknown key", "every"]),
])
def test_bad_ramps_name_the_key(ramp, words):
    with pytest.raises(ConfigError) as e:
        check(load_config(QUICK, [*ARGS, f"data.batch_ramp={ramp}"]), num_devices=8)
    for w in words:
        assert w in str(e.value), (w, str(e.value))
    with pytest.raises(RampError):
        BatchRamp((16, 8), (0, 0))


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


@pytest.mark.slow
def test_ramp_matches_decay_at_equal_tokens_and_the_noise_scale_grows(tmp_path):
    """Issue 13's experiment, as benchmarked (benchmarks/large_batch.py, docs/benchmarks.md section
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
