"""``jaxpar profile`` and ``train.profile`` (docs/profiling.md): a step's time by compute and collective from a
``jax.profiler`` trace, beside the cost model; and ``jaxpar calibrate``.

* the trace reader on a hand-written trace: every row, the rendezvous waits, the counts, the bytes;
* acceptance (issue 56, item 1), on a small DP2 x FSDP2 x TP2 quickstart and (slow) a 1F1B pipeline: the rows sum
  to the step time on the loop's own clock within 5%, each collective row's count per device equals the compiled
  HLO's, the table shows the cost model's terms, and the trace file parses;
* ``train.profile`` in a ``jaxpar train`` run, and the options' errors;
* (slow) ``jaxpar calibrate`` writes a cluster the cost model loads.
"""
from __future__ import annotations

import gzip
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from jaxpar.analysis import find_trace, read_trace, step_profiles
from jaxpar.analysis._trace import COMPUTE, DATA, DISPATCH, IDLE, STEP_EVENT, TRANSFER
from jaxpar.cli import main
from jaxpar.config import ConfigError
from jaxpar.commands._common import parse_steps, profile_steps
from jaxpar.errors import LoopError

ROOT = Path(__file__).resolve().parents[1]
TINY = ["model.layers=1", "model.embed=32", "model.seq_len=16", "train.devices=8", "data.max_bytes=200000"]


def _x(name, ts, dur, tid=1, **args):
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid, "args": args}


def _op(name, ts, dur, device, tid):
    return _x(name, ts, dur, tid, hlo_op=name, hlo_module="jit_step", device_ordinal=str(device))


def test_the_rows_of_a_hand_written_trace(tmp_path):
    """One step of 100 us: the batch 0-20 (a copy 5-10), then per device compute, an all-reduce with a wait
    inside it, and nothing at the end; device 1 starts later (dispatch) and runs a compute op inside a
    while loop, which counts once."""
    events = [_x(STEP_EVENT, 0, 100, step_num="7"), _x("jaxpar.data", 0, 20), _x("shard_args", 5, 5),
              _op("fusion.1", 20, 30, 0, 10), _op("all-reduce.3", 50, 40, 0, 10), _x("Wait: pending", 60, 25, 10),
              _op("while.2", 30, 40, 1, 11), _op("fusion.1", 35, 20, 1, 11), _op("all-reduce.3", 70, 20, 1, 12),
              {"ph": "M", "name": "thread_name", "pid": 1, "tid": 10, "args": {"name": "x"}}]
    path = tmp_path / "plugins" / "profile" / "run" / "perfetto_trace.json.gz"
    path.parent.mkdir(parents=True)
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    ar = SimpleNamespace(kind="all-reduce", axes=("data",), bytes=1024)
    [p] = step_profiles(read_trace(find_trace(tmp_path)), {"jit_step": {"all-reduce.3": ar}})
    us = {k: round(v * 1e6, 6) for k, v in p.rows.items()}
    assert p.step == 7 and round(p.wall * 1e6, 6) == 100
    # device 0: data 15, transfer 5, compute 30, all-reduce 40, idle 10; device 1: data 15, transfer 5,
    # dispatch 10 (20-30), compute 40 (the while loop 30-70), all-reduce 20, idle 10
    assert us == {COMPUTE: 35, ("all-reduce", ("data",)): 30, TRANSFER: 5, DATA: 15, DISPATCH: 5, IDLE: 10}
    assert list(p.rows) == [COMPUTE, ("all-reduce", ("data",)), TRANSFER, DATA, DISPATCH, IDLE]
    assert round(p.waiting[("all-reduce", ("data",))] * 1e6, 6) == 12.5          # 25 us on device 0, none on 1
    assert p.counts == {("all-reduce", ("data",)): {0: 1, 1: 1}} and p.bytes[("all-reduce", ("data",))] == 1024


def test_a_gpu_trace_names_its_device_by_process(tmp_path):
    """XLA:GPU's kernels carry no device_ordinal: the process ``/device:GPU:1`` is the device; its host to
    device copy is a host transfer."""
    events = [{"ph": "M", "name": "process_name", "pid": 3, "args": {"name": "/device:GPU:1"}},
              _x(STEP_EVENT, 0, 50, step_num="0"), _x("MemcpyH2D", 5, 5, tid=2) | {"pid": 3},
              _x("gemm_fusion.1", 20, 20, tid=2, hlo_op="gemm_fusion.1", hlo_module="jit_f") | {"pid": 3}]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": events}))
    [p] = step_profiles(read_trace(path), {})
    assert list(p.per_device) == [1]
    assert {k: round(v * 1e6, 6) for k, v in p.rows.items()} == {COMPUTE: 20, TRANSFER: 5, DISPATCH: 5, IDLE: 20}


def _check_profile(out: Path, text: str, devices: int = 8) -> dict:
    """The acceptance checks of one ``jaxpar profile`` run; returns its profile.json."""
    record = json.loads((out / "profile.json").read_text())
    assert record["model"] is not None and "cost model ms" in text and "(cpu_sim)" in text
    assert record["model"]["collectives"] and record["model"]["compute_s"] > 0
    for step in record["steps"]:
        rows = sum(step["rows_s"].values())
        assert abs(rows - step["wall_s"]) < 1e-9                        # the rows tile the trace's window
        assert abs(rows - step["loop_clock_s"]) < 0.05 * step["loop_clock_s"], step   # the loop's own clock
        assert step["counts"], "no collective in the trace"
        for row, per_device in step["counts"].items():
            assert len(per_device) == devices and per_device == step["hlo_counts"][row], row
        assert all(v > 0 for k, v in step["rows_s"].items() if k in ("compute", "data wait", "dispatch"))
    trace = read_trace(record["trace"])                                 # the trace file parses
    assert {op.device for op in trace.ops} == set(range(devices))
    assert sum(s.name == STEP_EVENT for s in trace.host) == len(record["steps"])
    return record


def test_profile_quickstart(tmp_path, capsys):
    out = tmp_path / "run" / "profile"
    assert main(["profile", str(ROOT / "configs" / "quickstart.yaml"), *TINY, f"train.out_dir={tmp_path / 'run'}",
                 "--steps", "1:2"]) == 0
    text = capsys.readouterr().out
    record = _check_profile(out, text)
    assert [s["step"] for s in record["steps"]] == [1]
    assert {"all-reduce over tensor", "all-gather over fsdp"} <= set(record["steps"][0]["counts"])
    assert "step 1:" in text and "all-gather over fsdp" in text and "pipeline bubble" not in text
    assert list(out.glob("trace/plugins/profile/*/*.xplane.pb"))      # TensorBoard's profile plugin reads it


@pytest.mark.slow
def test_profile_pipeline(tmp_path, capsys):
    out = tmp_path / "run" / "profile"
    assert main(["profile", str(ROOT / "configs" / "pp_1f1b.yaml"), *TINY, "model.layers=2",
                 f"train.out_dir={tmp_path / 'run'}", "--steps", "1:2"]) == 0
    text = capsys.readouterr().out
    record = _check_profile(out, text)
    step = record["steps"][0]
    assert "collective-permute over pipe" in step["counts"]
    assert step["bubble"].startswith("pipeline bubble: measured") and "schedule 1f1b p=2 m=4" in step["bubble"]
    assert "pipeline bubble" in text


@pytest.mark.slow
def test_train_profile_in_a_run(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", str(ROOT / "configs" / "quickstart.yaml"), *TINY, "train.steps=2", "train.eval_batches=0",
                 "checkpoint.enabled=false", "logging.samples=0", "logging.tensorboard=false", "train.progress=none",
                 f"train.out_dir={run}", "train.profile.steps=[1,2]"]) == 0
    assert f"traced -> {run / 'trace'}" in capsys.readouterr().out
    assert [s for s, _ in json.loads((run / "trace" / "steps.json").read_text())["steps"]] == [1]
    [p] = step_profiles(read_trace(find_trace(run / "trace")), {})
    assert p.step == 1 and p.rows[COMPUTE] > 0 and len(p.per_device) == 8


def test_the_options_errors(capsys):
    assert parse_steps("3:5") == (3, 5) and profile_steps({"steps": [0, 1]}) == (0, 1) and profile_steps({}) is None
    for bad in ({"steps": [2, 2]}, {"steps": [1]}, {"step": [1, 2]}, {"steps": [1.0, 2]}):
        with pytest.raises(ConfigError, match=r"train\.profile=.*0 <= A < B"):
            profile_steps(bad)
    with pytest.raises(ConfigError, match="expected A:B"):
        parse_steps("3")
    assert main(["train", str(ROOT / "configs" / "quickstart.yaml"), *TINY, "train.profile.steps=[3,1]"]) == 2
    assert "train.profile=" in capsys.readouterr().err
    from jaxpar.run import LogOptions
    from jaxpar.run._loop import _checked_train_args

    state = SimpleNamespace(step=0, stats=None)
    with pytest.raises(LoopError, match="give out_dir"):
        _checked_train_args(state, LogOptions(profile=(1, 2)), steps=2, start_step=0, eval_every=0, max_inflight=2,
                            stop_check_every=None, on_nonfinite="stop", ramp=None, steps_per_call=1, checkpointer=None)


@pytest.mark.slow
def test_calibrate_writes_a_cluster_the_cost_model_loads(tmp_path):
    from jaxpar import cost, devices

    out = tmp_path / "cpu_sim.yaml"
    result = devices.calibrate(out, reps=1, sizes=(1024, 65536), say=lambda _: None)
    c = cost.cluster_from_dict(yaml.safe_load(out.read_text()), "cpu_sim")
    assert c.name == "cpu_sim" and c.devices_per_node == 8 and c.intra.alpha > 0 and c.peak("float32") > 0
    assert set(result["measured_s"]) == set(cost.COLLECTIVE_KINDS)
    assert all(t > 0 for rows in result["measured_s"].values() for _, t in rows)
    assert c.intra.alpha == pytest.approx(result["link"]["alpha"], rel=1e-3)
