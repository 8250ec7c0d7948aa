"""Goodput: a run's wall time by bucket in ``summary.json``, the records, TensorBoard and the closing line.

* one ``train()`` call with skipped steps, an eval and a checkpoint: every bucket it has is measured, the
  skipped steps' share of the step time is theirs, ``other`` is small, the records and TensorBoard carry it;
* carrying an earlier attempt's buckets: the steps after the checkpoint it had done move to ``lost``;
* acceptance (slow): ``jaxpar train`` killed with ``kill -9`` and resumed reports its lost steps and their
  seconds, its compile time, and buckets that sum to the wall time within 2%.
"""
from __future__ import annotations

import json
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpar
from jaxpar.run import Checkpointer, train
from jaxpar.run._goodput import BUCKETS, Goodput, describe
from jaxpar.step._state import TrainState
from conftest import need_devices
from test_faults import ARGS as FAULT_ARGS, QUICK, _env

ROOT = Path(__file__).resolve().parents[1]


def _step(state, batch):
    """w -> mean(batch); the batch of step 3 is NaN: that update is dropped (``skipped``)."""
    grad = state.params - batch.mean()
    bad = ~jnp.isfinite(grad).all()
    new = state._replace(step=state.step + 1, params=jnp.where(bad, state.params, state.params - 0.5 * grad))
    return new, {"loss": 0.5 * jnp.mean((state.params - batch) ** 2), "grad_norm": jnp.linalg.norm(grad),
                 "skipped": bad}


def _batch(i):
    return np.full((2, 2), np.nan if i in (3, 5) else 1.0, np.float32)


def _tb_tags(tb_dir: Path) -> set[str]:
    from tensorboardX.proto import event_pb2
    import struct

    tags = set()
    for path in tb_dir.glob("events.out.tfevents.*"):
        data, pos = path.read_bytes(), 0
        while pos < len(data):
            (n,) = struct.unpack("<Q", data[pos:pos + 8])
            tags |= {v.tag for v in event_pb2.Event.FromString(data[pos + 12:pos + 12 + n]).summary.value}
            pos += 12 + n + 4
    return tags


def test_every_bucket_measured_in_summary_records_and_tensorboard(tmp_path):
    mesh = jaxpar.make_mesh({"data": 2}, devices=jax.devices()[:2])
    state = TrainState(jnp.int32(0), jnp.zeros(2), ())
    with Checkpointer(tmp_path / "ck", every=4, async_save=False) as ck:
        state, summary = train(_step, state, _batch, mesh=mesh, steps=8, on_nonfinite="skip", checkpointer=ck,
                               eval_fn=lambda s: float(jnp.sum(s.params)), eval_every=4, log_every=1,
                               out_dir=tmp_path, tensorboard=True, progress="none")
    g = summary.goodput
    assert summary.skipped_steps == [4, 6]
    for bucket in ("productive", "compile", "checkpoint_save", "data_wait", "eval", "skipped", "logging"):
        assert g[f"{bucket}_s"] > 0, bucket
    assert g["lost_s"] == 0 and g["lost_steps"] == 0 and g["checkpoint_restore_s"] == 0 and g["attempts"] == 1
    assert sum(g[f"{b}_s"] for b in BUCKETS) + g["other_s"] == pytest.approx(g["wall_s"], rel=1e-9)
    assert 0 <= g["other_s"] <= 0.05 * g["wall_s"], g
    assert g["goodput"] == pytest.approx(g["productive_s"] / g["wall_s"])
    assert summary.wall_time == g["wall_s"]         # one clock; a first attempt's wall time is the run's
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train_recs = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train_recs] == list(range(1, 9))
    walls = [r["goodput/wall_s"] for r in train_recs]
    assert walls == sorted(walls) and walls[-1] <= g["wall_s"]              # cumulative, the summary last
    assert train_recs[3]["goodput/skipped_s"] > 0 == train_recs[2]["goodput/skipped_s"]   # step 4 skipped
    tags = _tb_tags(tmp_path / "tb")
    assert {"goodput/goodput", "goodput/productive_s", "goodput/compile_s", "goodput/other_s"} <= tags
    assert summary.line().endswith(describe(g)) and describe(g).startswith(f"goodput {g['goodput']:.1%} (")
    assert f"compile {g['compile_s'] / g['wall_s']:.1%}" in describe(g)


def _rec(step, productive, skipped=0.0, wall=None, **more):
    wall = wall if wall is not None else 2 * (productive + skipped)
    return {"kind": "train", "step": step, "goodput/productive_s": productive, "goodput/skipped_s": skipped,
            "goodput/compile_s": 1.0, "goodput/wall_s": wall, **more}


def test_a_resumed_run_carries_the_earlier_buckets_and_moves_redone_steps_to_lost():
    kept = [_rec(2, 2.0), _rec(4, 4.0, 0.5)]                   # checkpoint at 5: between the records of 4 and 6
    dropped = [_rec(6, 5.0, 1.5), _rec(8, 7.0, 1.5, wall=20.0)]
    clock = Goodput()
    clock.carry(kept, dropped, start=5)
    # at step 5: productive 4.5, skipped 1.0 (halfway); the earlier attempt got to step 8 (7.0, 1.5)
    assert clock.base["productive"] == pytest.approx(4.5) and clock.base["skipped"] == pytest.approx(1.0)
    assert clock.base["lost"] == pytest.approx(2.5 + 0.5) and clock.lost_steps == 3 and clock.attempts == 2
    assert clock.base["compile"] == 1.0 and clock.base_wall == 20.0
    again = Goodput()                           # the earlier attempt died right after its record at the checkpoint
    again.carry(kept, [], start=4)
    assert again.base["productive"] == 4.0 and again.base["lost"] == 0 and again.lost_steps == 0
    assert again.base_wall == 9.0 and again.attempts == 2
    fresh = Goodput()
    fresh.carry([{"kind": "train", "step": 1, "loss": 1.0}], [], start=1)    # records without goodput: nothing
    assert fresh.base_wall == 0 and fresh.attempts == 1


def test_a_program_compiled_inside_another_trace_is_counted_once():
    """The pipeline's stage probe compiles while the step is traced: its seconds are in the step's trace too."""
    from jaxpar.run._goodput import compile_seconds

    @jax.jit
    def probe(y):
        time.sleep(0.3)                 # 0.3 s of tracing, inside the outer trace
        return jnp.cos(y) @ y

    @jax.jit
    def outer(x):
        probe.lower(jax.ShapeDtypeStruct(x.shape, x.dtype)).compile()
        return x * 2

    Goodput()                           # the listener
    t, c = time.perf_counter(), compile_seconds()
    jax.block_until_ready(outer(jnp.ones((16, 16))))
    wall, compiled = time.perf_counter() - t, compile_seconds() - c
    assert 0.3 <= compiled <= wall, (compiled, wall)


def _gpt_loss(model, batch):
    from jaxpar.parallel import cross_entropy
    return cross_entropy(model(batch["tokens"]), batch["targets"])


@need_devices(4)
def test_a_pipelined_run_counts_no_compile_second_twice(tmp_path):
    import optax
    from flax import nnx
    from jaxpar.models import GPT, GPTConfig
    from helpers import make_batch

    cfg = GPTConfig(vocab=64, seq_len=16, embed=32, heads=4, layers=2)
    mesh = jaxpar.make_mesh({"pipe": 2, "data": 2}, devices=jax.devices()[:4])
    tx = optax.sgd(0.1)
    state, layout = jaxpar.init_train_state(lambda: GPT(cfg, rngs=nnx.Rngs(0)), tx, mesh,
                                            jaxpar.Strategy(microbatches=2, schedule="1f1b"))
    step = jaxpar.make_train_step(_gpt_loss, tx, layout)
    _, summary = train(step, state, lambda i: make_batch(4, cfg, seed=i), mesh=mesh, steps=2, log_every=1,
                       progress="none")
    g = summary.goodput
    assert 0 < g["compile_s"] <= g["wall_s"], g
    assert 0 <= g["goodput"] <= 1 and g["productive_s"] >= 0 and g["other_s"] >= 0, g


# ----------------------------------------------------------------------------- acceptance 2: kill -9 and resume
STEPS, EVERY = 12, 4
ARGS = [a for a in FAULT_ARGS if not a.startswith(("train.steps=", "checkpoint.every="))] + [
    f"train.steps={STEPS}", f"checkpoint.every={EVERY}"]


def _cmd(out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "jaxpar.cli", "train", QUICK, *ARGS, f"train.out_dir={out}", *extra]


def _kill_after(out: Path, step: int, timeout: float = 240) -> None:
    """Start a run; ``kill -9`` it once it has reported ``step`` and committed a checkpoint."""
    proc = subprocess.Popen(_cmd(out), cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout] + [lines.put(None)], daemon=True).start()
    seen, deadline = [], time.monotonic() + timeout
    while (line := lines.get(timeout=max(1.0, deadline - time.monotonic()))) is not None:
        seen.append(line)
        ck = out / "checkpoints"
        if (line.startswith("step ") and "  loss " in line and int(line.split()[1].split("/")[0]) >= step
                and ck.is_dir() and any(p.name.isdigit() for p in ck.iterdir())):
            proc.send_signal(signal.SIGKILL)
            break
    assert proc.wait(timeout=60) == -signal.SIGKILL, "".join(seen)


@pytest.mark.slow
def test_killed_and_resumed_run_reports_lost_steps_compile_and_buckets_summing_to_wall(tmp_path):
    _kill_after(tmp_path, EVERY + 2)
    killed = [r for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "train"]
    with Checkpointer(tmp_path / "checkpoints") as ck:
        resumed_from = ck.latest_step()
    reached = killed[-1]["step"]
    assert resumed_from is not None and resumed_from < reached, (resumed_from, reached)
    at = next(r for r in killed if r["step"] == resumed_from)        # log_every=1: a record at every step
    redone_s = sum(killed[-1][f"goodput/{b}_s"] - at[f"goodput/{b}_s"] for b in ("productive", "skipped"))
    r = subprocess.run(_cmd(tmp_path, "--resume"), cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr
    g = json.loads((tmp_path / "summary.json").read_text())["goodput"]
    assert g["attempts"] == 2 and g["lost_steps"] == reached - resumed_from
    assert g["lost_s"] == pytest.approx(redone_s, rel=1e-9) and g["lost_s"] > 0
    assert g["compile_s"] > killed[-1]["goodput/compile_s"] > 0          # both attempts compiled their step
    assert g["checkpoint_restore_s"] > 0 and g["wall_s"] > killed[-1]["goodput/wall_s"]
    assert sum(g[f"{b}_s"] for b in BUCKETS) + g["other_s"] == pytest.approx(g["wall_s"], rel=1e-9)
    assert 0 <= g["other_s"] <= 0.02 * g["wall_s"], g                  # the measured buckets: >= 98% of the wall
    done = next(x for x in r.stdout.splitlines() if x.startswith("done "))
    assert f"lost {g['lost_s'] / g['wall_s']:.1%} in {reached - resumed_from} redone steps" in done
    assert f"goodput {g['goodput']:.1%} over 2 attempts (compile " in done
