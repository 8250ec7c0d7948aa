"""The planner and the compatibility table agree: every ranked plan passes the table (three models on three
targets: the simulated CPU mesh, H100, TPU v5e); a candidate the table refuses is rejected with the table's
message; the top plan of a CPU-mesh case trains through ``jaxpar train``."""
import json
import types
from dataclasses import replace

import numpy as np
import pytest

from jaxpar import cost
from jaxpar.cli import main
from jaxpar.compat import LIBRARY_NAMES, problems
from jaxpar.config import load_config
from jaxpar.config._cost_model import cost_model
from jaxpar.plan import plan_overrides
from jaxpar.cost import Plan
from jaxpar.cost import PlanError
from jaxpar.cost._planner import REFUSED_PREFIX, plan_refusal, plan_setting
from jaxpar.parallel.compression import onebit as onebit_codec, topk
from jaxpar.strategy import Strategy

ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]
QUICK = str(ROOT / "configs" / "quickstart.yaml")

MODELS = {
    "small": cost.gpt(layers=2, hidden=128, heads=4, seq=64, vocab=256, batch=32),      # the quickstart GPT
    "gpt2-124m": cost.gpt(layers=12, hidden=768, heads=12, seq=1024, vocab=50304, batch=64),
    # 8k tokens: CP degrees and methods are searched; 8 experts: EP degrees too
    "moe-8k": cost.gpt(layers=4, hidden=256, heads=8, seq=8192, vocab=1024, batch=16, experts=8, top_k=2),
}
#: target -> (cluster preset, dtype, precision); 8 devices each
TARGETS = {"cpu_sim": ("cpu_sim", "float32", "fp32"), "h100": ("h100", "bfloat16", "mixed"),
           "tpu_v5e": ("tpu_v5e", "bfloat16", "mixed")}


def _plan(model, target, **kw):
    preset, dtype, precision = TARGETS[target]
    return cost.plan(model, cost.load_cluster(preset, num_devices=8), dtype=dtype, precision=precision, **kw), dtype


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("name", MODELS)
def test_every_ranked_plan_passes_the_table(name, target):
    result, dtype = _plan(MODELS[name], target)
    assert result.ranked
    for e in result.ranked:
        setting = plan_setting(e.plan, dtype=dtype)
        assert problems(setting) == [], e.plan.name()
        assert dict(setting.sizes) == e.plan.sizes and setting.strategy.compute_dtype == dtype
    # the search space holds only what the table composes (no-flush schedules are not searched)
    assert not [r for r in result.rejected if r.reason.startswith(REFUSED_PREFIX)]


def test_plan_setting_reads_what_the_rules_read():
    p = Plan(pipe=2, data=2, tensor=2,
             strategy=Strategy(zero=1, sequence_parallel=True, schedule="zb-h1", microbatches=4))
    codec = topk(0.01)
    s = plan_setting(p, dtype="float32", fixed={"compression": codec, "clip_norm": 1.0})
    assert s.strategy == Strategy(zero=1, sequence_parallel=True, schedule="zb-h1", microbatches=4,
                                  compute_dtype="float32", compression=codec)
    assert s.clip_norm == 1.0 and s.size("pipe") == 2 and s.size("replica") == 1
    with pytest.raises(ValueError, match="unknown key.*bogus"):
        plan_setting(p, fixed={"bogus": 1})


def test_sequence_parallel_with_a_no_flush_schedule_is_refused_by_the_table():
    """A plan record the planner's Plan cannot hold (its schedules are the flush ones): the table's refusal."""
    record = types.SimpleNamespace(strategy=Strategy(sequence_parallel=True, schedule="pipedream-2bw", microbatches=4),
                                   sizes={"pipe": 2, "data": 2, "tensor": 2})
    [problem] = problems(plan_setting(record))
    assert problem.features == ("SP", "2B")
    assert plan_refusal(record) == REFUSED_PREFIX + problem.render(LIBRARY_NAMES)
    assert "Strategy.sequence_parallel=True with schedule='pipedream-2bw' on pipe=2" in plan_refusal(record)
    flush = types.SimpleNamespace(strategy=replace(record.strategy, schedule="1f1b"), sizes=record.sizes)
    assert plan_refusal(flush) is None


def test_refused_candidates_move_to_rejected_with_the_tables_message():
    """A codec (fixed for the search) cannot run with a context or expert axis: those candidates are rejected
    with the table's message; the plans without them still rank."""
    codec = topk(0.01)
    result, _ = _plan(MODELS["moe-8k"], "h100", fixed={"compression": codec})
    refused = [r for r in result.rejected if r.reason.startswith(REFUSED_PREFIX)]
    assert refused and result.ranked
    assert all(e.plan.context == 1 and e.plan.expert == 1 for e in result.ranked)
    for r in refused:
        assert r.plan.context > 1 or r.plan.expert > 1, r.plan.name()
        assert r.reason == plan_refusal(r.plan, fixed={"compression": codec})
    cp = next(r for r in refused if r.plan.context > 1 and r.plan.expert == 1)
    assert cp.reason == (REFUSED_PREFIX + f"Strategy.compression with context={cp.plan.context}: a codec's exchange "
                         "runs the loss per replica inside a shard_map over the data axes and reduces the gradients "
                         "over them only, not over context. Drop one of the two.")
    # without the codec the same search ranks CP plans (on TPU v5e, whose attention keeps its scores in memory,
    # first; on the H100 a flash kernel holds no [S, S] scores and plain ZeRO-2 wins)
    assert any(e.plan.context > 1 for e in _plan(MODELS["moe-8k"], "h100")[0].ranked)
    assert _plan(MODELS["moe-8k"], "tpu_v5e")[0].best.plan.context > 1


def test_one_bit_adam_rejects_zero_2_3_and_fsdp():
    onebit = onebit_codec(optimizer_momentum=0.9, start_step=20)
    result, _ = _plan(MODELS["gpt2-124m"], "h100", fixed={"compression": onebit})
    assert all(e.plan.strategy.zero <= 1 and e.plan.fsdp == 1 for e in result.ranked)
    refused = [r for r in result.rejected if r.reason.startswith(REFUSED_PREFIX)]
    assert refused and all(r.plan.strategy.zero >= 2 or r.plan.fsdp > 1 for r in refused)
    assert "1-bit Adam needs the whole exchanged moment on every replica" in refused[0].reason
    with pytest.raises(PlanError, match="refused by the compatibility table.*clip_norm=1.0"):
        _plan(MODELS["gpt2-124m"], "h100", fixed={"compression": onebit, "clip_norm": 1.0})
    with pytest.raises(PlanError, match="unknown key"):
        _plan(MODELS["small"], "h100", fixed={"codec": onebit})


# the quickstart config, smaller (as tests/test_cli.py's end-to-end run)
SMALL = ["model.embed=32", "model.layers=2", "model.seq_len=16", "data.batch_size=16", "data.max_bytes=200000",
         "optimizer.warmup_steps=0"]


def _train(plan, tmp_path, capsys):
    out = tmp_path / "run"
    rc = main(["train", QUICK, *SMALL, *plan_overrides(plan), "train.steps=3", "train.log_every=1",
               "train.eval_every=3", "train.eval_batches=1", "checkpoint.enabled=false", "logging.samples=0",
               "logging.tensorboard=false", f"train.out_dir={out}", "train.progress=lines"])
    text = capsys.readouterr().out
    assert rc == 0, text
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3] and all(np.isfinite(r["loss"]) for r in train)
    return text


def test_top_plan_of_a_cpu_mesh_case_trains(tmp_path, capsys):
    model = cost_model(load_config(QUICK, SMALL))
    result = cost.plan(model, cost.load_cluster("cpu_sim"), dtype="float32", precision="fp32")
    best = result.best.plan
    assert problems(plan_setting(best, dtype="float32")) == []
    text = _train(best, tmp_path, capsys)
    assert f"strategy {best.name()}" in text


PICKS = {"pipe": lambda p: p.pipe > 1, "sp": lambda p: p.strategy.sequence_parallel,
         "pipe-sp": lambda p: p.pipe > 1 and p.strategy.sequence_parallel}


@pytest.mark.exhaustive
@pytest.mark.parametrize("pick", PICKS)
def test_best_pipelined_and_sequence_parallel_plans_train(pick, tmp_path, capsys):
    """The best plan of the same case with a pipeline, with SP, and with both, trains too."""
    model = cost_model(load_config(QUICK, SMALL))
    result = cost.plan(model, cost.load_cluster("cpu_sim"), dtype="float32", precision="fp32")
    best = next(e.plan for e in result.ranked if PICKS[pick](e.plan))
    assert f"strategy {best.name()}" in _train(best, tmp_path, capsys)
