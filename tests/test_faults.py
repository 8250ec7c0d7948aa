"""Fault handling end to end, in real subprocesses of ``python -m jaxpar.cli train``.

* exact resume: SIGKILL at a random step after a checkpoint, ``--resume``: final params and the
  loss curve from the resumed step on are bit-identical to an uninterrupted run;
* preemption: SIGTERM mid-run -> checkpoint at the current step, exit 0, resume continues;
* corruption: a truncated file in the latest checkpoint -> warning naming the step, fallback;
* ``--resume`` with no checkpoint -> clear error naming the directory.

One uninterrupted run (module fixture) is the reference for all of them.
"""
from __future__ import annotations

import json
import os
import queue
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxpar.config import build_job, load_config
from jaxpar.run import Checkpointer

ROOT = Path(__file__).resolve().parents[1]
QUICK = str(ROOT / "configs" / "quickstart.yaml")
STEPS, EVERY = 20, 5
# Small enough for ~40 ms steps on 2 cores: the run lasts long enough to be interrupted mid-way.
ARGS = ["model.embed=64", "model.layers=2", "model.seq_len=64", "data.kind=synthetic", "data.batch_size=16",
        f"train.steps={STEPS}", "train.log_every=1", f"checkpoint.every={EVERY}", "checkpoint.keep=3",
        "train.eval_batches=0", "logging.samples=0", "logging.tensorboard=false", "train.progress=lines",
        "optimizer.warmup_steps=0"]


def _cmd(out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "jaxpar.cli", "train", QUICK, *ARGS, f"train.out_dir={out}", *extra]


def _env() -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("JAX_NUM_CPU_DEVICES", None)
    return env


def run(out: Path, *extra: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(_cmd(out, *extra), cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout)


def committed(out: Path) -> list[int]:
    """Steps of the checkpoints Orbax has finished (renamed from their temporary directory)."""
    ck = out / "checkpoints"
    return sorted(int(p.name) for p in ck.iterdir() if p.name.isdigit()) if ck.is_dir() else []


def run_until(out: Path, step: int, sig: int, timeout: float = 240) -> tuple[int, str, str]:
    """Start a run, send ``sig`` once it has reported step ``step`` (or later) and committed a
    checkpoint (async saves may lag on a loaded machine); return (exit code, stdout, stderr)."""
    proc = subprocess.Popen(_cmd(out), cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout] + [lines.put(None)], daemon=True).start()
    err: list[str] = []
    threading.Thread(target=lambda: err.extend(proc.stderr), daemon=True).start()
    seen, sent, deadline = [], False, time.monotonic() + timeout
    while True:
        line = lines.get(timeout=max(1.0, deadline - time.monotonic()))
        if line is None:
            break
        seen.append(line)
        reported = line.startswith("step ") and "  loss " in line and int(line.split()[1].split("/")[0]) >= step
        if not sent and reported and committed(out):
            proc.send_signal(sig)
            sent = True
    rc = proc.wait(timeout=60)
    time.sleep(0.1)
    assert sent, f"the run ended before step {step} and a checkpoint:\n{''.join(seen)}{''.join(err)}"
    return rc, "".join(seen), "".join(err)


def records(out: Path, kind: str = "train") -> list[dict]:
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["kind"] == kind]


def losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records(out)}


@pytest.fixture(scope="module")
def layout():
    """The layout of the runs' train state, built as ``jaxpar train`` builds it (nothing is allocated)."""
    return build_job(load_config(QUICK, ARGS), data=False).state_layout()


def final_state(out: Path, layout, step: int = STEPS):
    with Checkpointer(out / "checkpoints") as ck:
        return jax.device_get(ck.restore(layout, step=step).state)


def assert_identical(a, b) -> None:
    leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(leaves_a) == len(leaves_b)
    for x, y in zip(leaves_a, leaves_b):
        assert np.array_equal(np.asarray(x), np.asarray(y)), "restored / resumed values differ"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("reference")
    r = run(out)
    assert r.returncode == 0, r.stderr
    assert sorted(int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit()) == [10, 15, 20]
    return out


def test_exact_resume_after_sigkill(reference, layout, tmp_path):
    kill_at = random.Random().randint(EVERY + 1, 13)        # after the first checkpoint, before the last
    rc, text, _ = run_until(tmp_path, kill_at, signal.SIGKILL)
    assert rc == -signal.SIGKILL
    with Checkpointer(tmp_path / "checkpoints") as ck:
        resumed_from = ck.latest_step()
    assert resumed_from is not None and resumed_from % EVERY == 0 and EVERY <= resumed_from <= 15
    r = run(tmp_path, "--resume")
    assert r.returncode == 0, r.stderr
    assert f"resume   step {resumed_from} from {tmp_path / 'checkpoints' / str(resumed_from)}" in r.stdout
    ref, got = losses(reference), losses(tmp_path)
    assert sorted(got) == list(range(1, STEPS + 1))          # killed run's records after the checkpoint dropped
    for s in range(resumed_from + 1, STEPS + 1):
        assert got[s] == ref[s], f"step {s}: loss {got[s]!r} != uninterrupted {ref[s]!r} (killed at {kill_at})"
    assert_identical(final_state(tmp_path, layout), final_state(reference, layout))


def test_sigterm_saves_current_step_and_resume_continues(reference, layout, tmp_path):
    rc, text, err = run_until(tmp_path, random.Random().randint(6, 13), signal.SIGTERM)
    assert rc == 0, err
    stopped = max(r["step"] for r in records(tmp_path))
    assert f"stopped  by SIGTERM after step {stopped}; continue with --resume" in text
    assert stopped < STEPS
    with Checkpointer(tmp_path / "checkpoints") as ck:
        assert ck.latest_step() == stopped                   # a checkpoint of the very step it stopped at
    preempted = records(tmp_path, "preempted")                # with the run's goodput after the stop's save
    assert [{k: v for k, v in r.items() if not k.startswith("goodput/")} for r in preempted] == [
        {"kind": "preempted", "step": stopped, "signal": "SIGTERM", "checkpoint": True}]
    assert preempted[0]["goodput/checkpoint_save_s"] > 0
    r = run(tmp_path, "--resume")
    assert r.returncode == 0, r.stderr
    assert f"resume   step {stopped} from" in r.stdout
    ref, got = losses(reference), losses(tmp_path)
    assert [got[s] for s in range(stopped + 1, STEPS + 1)] == [ref[s] for s in range(stopped + 1, STEPS + 1)]
    assert_identical(final_state(tmp_path, layout), final_state(reference, layout))


def test_corrupt_latest_checkpoint_falls_back_with_warning(reference, layout, tmp_path):
    shutil.copytree(reference / "checkpoints", tmp_path / "checkpoints")
    data = max((tmp_path / "checkpoints" / "20" / "state" / "d").iterdir(), key=lambda f: f.stat().st_size)
    with open(data, "r+b") as f:
        f.truncate(f.seek(0, 2) // 2)
    r = run(tmp_path, "--resume")
    assert r.returncode == 0, r.stderr
    assert f"checkpoint step 20 in {tmp_path / 'checkpoints'} is unreadable, using step 15 instead" in r.stderr
    assert "resume   step 15 from" in r.stdout
    assert_identical(final_state(tmp_path, layout), final_state(reference, layout))   # step 20 rewritten


def test_resume_without_checkpoint_is_a_clear_error(tmp_path):
    r = run(tmp_path, "--resume")
    assert r.returncode == 2
    assert f"jaxpar train: error: no checkpoint to resume from in {tmp_path / 'checkpoints'}" in r.stderr
    assert "Traceback" not in r.stderr
