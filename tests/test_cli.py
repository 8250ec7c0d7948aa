"""The config edge and the ``jaxpar`` CLI: loading, overrides, errors naming keys, an end-to-end run, schedules."""
import json
import re
import warnings
from pathlib import Path

import numpy as np
import pytest
import yaml

from jaxpar.cli import build_parser, main
from jaxpar.config import (ConfigError, build_data, build_lr_schedule, build_optimizer, check, load_config,
                           parse_overrides, resolve_import, to_yaml)
from jaxpar.data import _windows as D
from jaxpar.errors import ScheduleWarning

ROOT = Path(__file__).resolve().parents[1]
QUICK = str(ROOT / "configs" / "quickstart.yaml")
ALL_CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
TESTS = Path(__file__).resolve().parent
MLP = str(TESTS / "cli_mlp.yaml")        # a model of your own: jaxpar's MLP by import path + tests/cli_data.py


# ----------------------------------------------------------------------------- loading
def test_print_config_resolves_base_and_overrides(capsys):
    assert main(["train", str(ROOT / "configs" / "tp_sp.yaml"), "--print-config", "optimizer.lr=3e-4"]) == 0
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert cfg["name"] == "tp_sp" and cfg["train"]["out_dir"] == "runs/tp_sp"
    assert cfg["mesh"] == {"data": 2, "fsdp": 1, "tensor": 4, "pipe": 1, "replica": 1, "context": 1,
                           "expert": 1}   # tp.yaml, base
    assert cfg["parallel"]["sequence_parallel"] is True
    assert cfg["model"]["embed"] == 128                                     # quickstart.yaml, two levels up
    assert cfg["optimizer"]["lr"] == pytest.approx(3e-4)


@pytest.mark.parametrize("path", [*ALL_CONFIGS, Path(MLP)], ids=lambda p: p.stem)
def test_every_shipped_config_loads_and_round_trips(path, tmp_path):
    cfg = load_config(path)
    again = tmp_path / "again.yaml"
    again.write_text(to_yaml(cfg))
    assert load_config(again) == cfg


def test_override_parsing_and_types():
    assert parse_overrides(["mesh.tensor=2", "optimizer.lr=3e-4", "model.mlp=null"]) == {
        "mesh": {"tensor": 2}, "optimizer": {"lr": 3e-4}, "model": {"mlp": None}}
    cfg = load_config(QUICK, ["mesh.tensor=1", "mesh.data=4", "optimizer.lr=1e-3", "model.mlp=256",
                              "data.paths=[a.py,'src/**/*.py']", "optimizer.clip_norm=null"])
    assert (cfg.mesh.data, cfg.mesh.tensor, cfg.model.mlp) == (4, 1, 256)
    assert cfg.optimizer.lr == pytest.approx(1e-3) and cfg.optimizer.clip_norm is None
    assert cfg.data.paths == ("a.py", "src/**/*.py")
    for bad in (["mesh.tensor"], ["=3"], ["base=other.yaml"]):
        with pytest.raises(ConfigError, match="override"):
            parse_overrides(bad)


BAD = [  # (override, text the error must contain)
    ("model.embedd=64", "unknown key 'model.embedd'; allowed keys under 'model': name, target, kwargs, loss, vocab"),
    ("trainer.steps=3", "unknown key 'trainer'"),
    ("mesh.tensor=two", "'mesh.tensor'"),
    ("train.steps=1.5", "'train.steps'"),
    ("mesh=3", "'mesh' must be a mapping"),
    ("model.name=transformer", "model.name='transformer': unknown value; allowed: gpt"),
    ("optimizer.name=lion", "optimizer.name='lion': unknown value; allowed: adamw, adam, sgd"),
    ("parallel.compute_dtype=fp16", "parallel.compute_dtype='fp16'"),
    ("data.batch_size=30", "data.batch_size=30 is not divisible by mesh.data x mesh.fsdp x parallel.microbatches"),
    ("model.heads=1", "model.heads=1 is not divisible by mesh.tensor=2"),
    ("mesh.pipe=2", "mesh.pipe=2"),
    # the library's own checks (GPTConfig, Strategy, MeshSpec), relabelled with the YAML keys
    ("model.heads=3", "model.embed=128 is not divisible by model.heads=3"),
    ("model.vocab=0", "model.vocab=0: must be a positive int"),
    ("model.remat=some", "model.remat='some'"),
    ("parallel.zero=5", "parallel.zero=5"),
    ("parallel.microbatches=0", "parallel.microbatches=0"),
    ("parallel.virtual_stages=2", "parallel.virtual_stages=2 needs parallel.schedule='interleaved'"),
    ("parallel.schedule=pipedream-x", "parallel.schedule='pipedream-x': unknown schedule kind"),
    ("mesh.fsdp=0", "mesh.fsdp=0"),
    ("optimizer.schedule=constant", "'optimizer.schedule' was renamed to 'optimizer.lr_schedule'"),
    ("optimizer.lr_schedule=step", "optimizer.lr_schedule='step': unknown value"),
    ("model.loss=pkg:fn", "model.loss='pkg:fn': only used with model.target"),
    ("model.loss_chunks=4", "model.loss_chunks=4: the loss in pieces is model.hf's Decoder's"),
]


@pytest.mark.parametrize("override,message", BAD, ids=[b[0] for b in BAD])
def test_bad_config_names_the_key(override, message, capsys):
    with pytest.raises(ConfigError) as err:
        load_config(QUICK, [override])
    assert message in str(err.value)
    assert main(["train", QUICK, override, "train.out_dir=/nonexistent/jaxpar-test"]) == 2
    assert message in capsys.readouterr().err


def test_a_mesh_that_train_devices_cannot_hold_is_named_first():
    with pytest.raises(ConfigError) as err:
        load_config(QUICK, ["mesh.data=3"])             # 3 x 2 x 2 on train.devices=8; the batch then divides by 6
    first, second = str(err.value).splitlines()[1:3]
    assert "multiply to 12, but there are 8 devices" in first and "data.batch_size=32" in second, str(err.value)


PIPE = ["mesh.pipe=2", "mesh.data=1", "parallel.microbatches=4"]   # 2 x 1 x 2 x 2 = 8 devices
PIPE_BAD = [  # (overrides, text the error must contain): pipeline schedule and stage partition
    (["parallel.microbatches=1"], "parallel.schedule='1f1b' with mesh.pipe=2, parallel.microbatches=1"),
    (["parallel.schedule=interleaved", "parallel.virtual_stages=2", "parallel.microbatches=3", "model.layers=4",
      "data.batch_size=24"], "parallel.microbatches=3, parallel.virtual_stages=2: interleaved_1f1b needs m divisible"),
    (["parallel.schedule=interleaved"], "parallel.virtual_stages=1: interleaved_1f1b(v=1): must be an int >= 2"),
    (["model.layers=3"], "model.layers=3, mesh.pipe=2 x parallel.virtual_stages=1: 3 layers cannot be split evenly"),
    (["model.layers=3", "parallel.stage_layers=[1,1]"], "parallel.stage_layers=(1, 1) must be positive and sum"),
    (["parallel.sequence_parallel=true", "parallel.schedule=pipedream-2bw"],
     "parallel.sequence_parallel=true with parallel.schedule='pipedream-2bw' on mesh.pipe=2 is not supported"),
]


@pytest.mark.parametrize("overrides,message", PIPE_BAD, ids=[" ".join(b[0]) for b in PIPE_BAD])
def test_bad_pipeline_names_the_keys(overrides, message):
    load_config(QUICK, PIPE)
    with pytest.raises(ConfigError) as err:
        load_config(QUICK, [*PIPE, *overrides])
    assert message in str(err.value)


def test_mesh_product_must_match_device_count(capsys):
    cfg = load_config(QUICK, ["mesh.data=4"])            # 4 x 2 x 2 = 16: fine until the device count is known
    with pytest.raises(ConfigError, match=r"mesh\.data=4.*multiply to 16, but there are 8 devices"):
        check(cfg, num_devices=8)
    assert main(["train", QUICK, "mesh.data=4", "train.out_dir=/nonexistent/jaxpar-test"]) == 2
    err = capsys.readouterr().err
    assert "mesh.data=4" in err and "8 devices" in err
    check(load_config(QUICK, ["mesh.data=-1"]), num_devices=8)   # -1 fills the rest
    assert main(["train", QUICK, "train.devices=4", "mesh.data=1",      # backend is already up with 8
                 "train.out_dir=/nonexistent/jaxpar-test"]) == 2
    assert "train.devices=4" in capsys.readouterr().err


def test_base_inheritance_relative_paths_and_cycles(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "root.yaml").write_text(f"base: {QUICK}\nmodel: {{layers: 3}}\n")
    (tmp_path / "sub" / "child.yaml").write_text("base: ../root.yaml\nmodel: {embed: 64}\n")
    cfg = load_config(tmp_path / "sub" / "child.yaml")
    assert (cfg.model.layers, cfg.model.embed, cfg.mesh.tensor, cfg.name) == (3, 64, 2, "child")
    (tmp_path / "bad.yaml").write_text("base: root.yaml\noptimizer: {betas: 1}\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml: unknown key 'optimizer.betas'"):
        load_config(tmp_path / "bad.yaml")
    (tmp_path / "a.yaml").write_text("base: b.yaml\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\n")
    with pytest.raises(ConfigError, match="cycle"):
        load_config(tmp_path / "a.yaml")
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")


# ----------------------------------------------------------------------------- builders and data
@pytest.mark.parametrize("name", ["adamw", "adam", "sgd"])
def test_build_optimizer(name):
    cfg = load_config(QUICK, [f"optimizer.name={name}", "optimizer.warmup_steps=10", "train.steps=100"])
    tx, schedule = build_optimizer(cfg.optimizer, cfg.train.steps)
    params = {"w": np.ones((3,), np.float32)}
    updates, _ = tx.update({"w": np.ones((3,), np.float32)}, tx.init(params), params)
    assert updates["w"].shape == (3,)
    lr = cfg.optimizer.lr
    assert float(schedule(0)) == 0.0 and float(schedule(10)) == pytest.approx(lr)
    assert float(schedule(100)) == pytest.approx(lr * cfg.optimizer.min_lr_ratio, rel=1e-4)
    flat = load_config(QUICK, ["optimizer.lr_schedule=constant", "optimizer.warmup_steps=0"]).optimizer
    const = build_lr_schedule(flat, 50)
    assert float(const(0)) == float(const(49)) == pytest.approx(lr)


def test_a_warm_up_as_long_as_the_run_is_warned():
    cfg = load_config(QUICK, ["optimizer.warmup_steps=20"]).optimizer
    with pytest.warns(ScheduleWarning, match=r"warmup_steps=20 is not below train.steps=10: .* 0.90 of"):
        schedule = build_lr_schedule(cfg, 10)
    assert float(schedule(9)) == pytest.approx(0.9 * cfg.lr)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        build_lr_schedule(cfg, 21)


def test_a_tilde_override_drops_a_key_so_its_default_holds(tmp_path):
    mine = tmp_path / "muon.yaml"
    mine.write_text(f"base: {QUICK}\noptimizer:\n  name: muon\n  muon: {{momentum: 0.9, ns_steps: 3}}\n")
    with pytest.raises(ConfigError, match=r"remove optimizer.muon \(the override ~optimizer.muon\)"):
        load_config(str(mine), ["optimizer.name=adamw"])
    cfg = load_config(str(mine), ["optimizer.name=adamw", "~optimizer.muon"])
    assert cfg.optimizer.name == "adamw" and cfg.optimizer.muon == type(cfg.optimizer.muon)()
    assert load_config(str(mine), ["~optimizer.muon.ns_steps"]).optimizer.muon.ns_steps == 5
    with pytest.raises(ConfigError, match=r"override ~optimizer.mun: unknown key"):
        load_config(str(mine), ["~optimizer.mun"])


def test_text_and_synthetic_batches_are_deterministic(tmp_path):
    corpus = D.load_bytes(max_bytes=100_000)
    assert corpus.dtype == np.uint8 and len(corpus) == 100_000
    train, held = D.split_holdout(corpus, 0.1)
    assert len(held) == 10_000 and np.array_equal(np.concatenate([train, held]), corpus)
    a = D.text_batch(train, 7, batch_size=4, seq_len=16, seed=1)
    assert np.array_equal(a["tokens"], D.text_batch(train, 7, batch_size=4, seq_len=16, seed=1)["tokens"])
    assert not np.array_equal(a["tokens"], D.text_batch(train, 8, batch_size=4, seq_len=16, seed=1)["tokens"])
    assert np.array_equal(a["tokens"][:, 1:], a["targets"][:, :-1]) and a["tokens"].dtype == np.int32
    s = D.synthetic_batch(3, batch_size=4, seq_len=8, vocab=50, seed=0)
    assert s["tokens"].max() < 50 and np.array_equal(s["tokens"][:, 1:], s["targets"][:, :-1])
    (tmp_path / "x.txt").write_bytes(b"hello world\n" * 100)
    fn, evals = build_data(load_config(QUICK, [f"data.paths=['{tmp_path}/*.txt']"]).data,
                           seq_len=8, vocab=256, eval_batches=1)
    assert bytes(fn(0)["tokens"][0].astype(np.uint8)) in (b"hello world\n" * 3)
    with pytest.raises(ConfigError, match="matches no file"):
        build_data(load_config(QUICK, [f"data.paths=['{tmp_path}/*.nope']"]).data, seq_len=8, vocab=256,
                   eval_batches=1)


# ----------------------------------------------------------------------------- end to end
def test_train_end_to_end_in_process(tmp_path, capsys):
    out = tmp_path / "run"
    rc = main(["train", QUICK, "train.steps=3", "train.log_every=1", "train.eval_every=2", "train.eval_batches=1",
               f"train.out_dir={out}", "train.progress=lines", "model.embed=32", "model.layers=1",
               "model.seq_len=16", "data.batch_size=8", "data.max_bytes=200000", "optimizer.warmup_steps=0"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "mesh     pipe=1 x data=2 x fsdp=2 x tensor=2" in text and "strategy dp2-fsdp2-tp2" in text
    assert "parameters" in text and "per device" in text and "loss" in text
    assert f"wrote    {out / 'metrics.jsonl'}, {out / 'loss.png'}, {out / 'tb'}/ (tensorboard --logdir {out / 'tb'})" \
        in text, text
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["step"] for r in train] == [1, 2, 3] and [r["step"] for r in evals] == [2, 3]
    assert all(np.isfinite(r["loss"]) and r["step_time"] > 0 and r["tokens_per_s"] > 0 for r in train)
    assert set(train[0]) >= {"step", "loss", "grad_norm", "lr", "step_time", "tokens_per_s"}
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert load_config(out / "config.yaml").train.steps == 3
    assert json.loads((out / "summary.json").read_text())["end_step"] == 3


# ----------------------------------------------------------------------------- a model of your own
@pytest.mark.parametrize("overrides,strategy", [
    ([], "dp2-fsdp2-tp2"),
    (["mesh.data=8", "mesh.fsdp=1", "mesh.tensor=1", "parallel.zero=3", "parallel.microbatches=2"],
     "dp8-zero3-accum2"),
], ids=["dp-fsdp-tp", "zero3-accum"])
def test_user_model_trains_from_yaml(overrides, strategy, tmp_path, capsys):
    """tests/cli_mlp.yaml names jaxpar's MLP classifier, its loss and a batch function by import path."""
    out = tmp_path / "run"
    assert main(["train", MLP, f"train.out_dir={out}", *overrides]) == 0
    text = capsys.readouterr().out
    assert f"strategy {strategy}" in text
    assert "model    MLPClassifier (jaxpar.models._mlp:MLPClassifier): 9,060 parameters" in text
    assert "global batch 16 (['x']: float32[16, 16], ['y']: int32[16])" in text
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["step"] for r in train] == [1, 2, 4] and [r["step"] for r in evals] == [2, 4]
    assert train[-1]["loss"] < train[0]["loss"] and evals[-1]["eval_loss"] < evals[0]["eval_loss"]
    assert not train[0].get("tokens_per_s")                   # no tokens in a classification batch
    assert not (out / "samples.txt").exists()                  # text samples are the GPT's
    assert load_config(out / "config.yaml") == load_config(MLP, [f"train.out_dir={out}", *overrides])


BYO = str(ROOT / "configs" / "byo_model.yaml")    # examples/patch_attention.py by a relative file path
# ZeRO-3 (from the config) x a pipeline x tensor parallelism, with the user's own loss
BYO_PIPE = ["mesh.pipe=2", "mesh.data=2", "mesh.fsdp=1", "mesh.tensor=2", "parallel.microbatches=4"]


# the pipelined variant in the exhaustive tier: tests/test_byo_model.py runs the user's model pipelined in process
@pytest.mark.parametrize("overrides", [[], pytest.param(BYO_PIPE, marks=pytest.mark.exhaustive)],
                         ids=["dp2-zero3-fsdp2-tp2", "pipe2-dp2-tp2"])
def test_byo_model_config_trains(overrides, tmp_path):
    """configs/byo_model.yaml trains the example's own model with its own loss, also as a pipeline."""
    out = tmp_path / "run"
    assert main(["train", BYO, "train.steps=4", "train.log_every=1", "train.eval_batches=1", f"train.out_dir={out}",
                 "train.progress=none", "optimizer.warmup_steps=0", "checkpoint.enabled=false",
                 "logging.tensorboard=false", *overrides]) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if r["kind"] == "train"]
    assert len(losses) == 4 and np.isfinite(losses).all() and losses[-1] < losses[0], losses
    assert [r["step"] for r in records if r["kind"] == "eval"] == [4]


EXPLICIT = str(ROOT / "configs" / "explicit_model.yaml")   # examples/explicit_transformer.py: explicit sharding


def test_explicit_sharding_model_config_trains(tmp_path):
    """configs/explicit_model.yaml trains a model with mesh-axis specs, out_sharding= pins and nnx.List
    layers (DP2 x FSDP2 x TP2, ZeRO-3, two micro-batches), with no rules written for it."""
    out = tmp_path / "run"
    assert main(["train", EXPLICIT, "train.steps=4", "train.log_every=1", "train.eval_batches=1",
                 f"train.out_dir={out}", "train.progress=none", "optimizer.warmup_steps=0",
                 "checkpoint.enabled=false", "logging.tensorboard=false"]) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if r["kind"] == "train"]
    assert len(losses) == 4 and np.isfinite(losses).all() and losses[-1] < losses[0], losses
    assert [r["step"] for r in records if r["kind"] == "eval"] == [4]


@pytest.mark.exhaustive      # the context-parallel paths train in tests/test_context_train.py's default cases
def test_long_context_config_trains_over_a_context_axis(tmp_path):
    """configs/long_context.yaml trains the GPT on 1,024-token windows with the sequence split over
    context=4 (ring, balanced) and data=2; a method the context axis cannot run is named by its key."""
    out = tmp_path / "run"
    config = str(Path(EXPLICIT).parent / "long_context.yaml")
    assert main(["train", config, "train.steps=3", "train.log_every=1", "train.eval_batches=1",
                 f"train.out_dir={out}", "train.progress=none", "optimizer.warmup_steps=0", "train.eval_every=0",
                 "checkpoint.enabled=false", "logging.tensorboard=false"]) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if r["kind"] == "train"]
    assert len(losses) == 3 and np.isfinite(losses).all(), losses
    with pytest.raises(ConfigError, match=r"parallel.context.method='rings' is not a context-parallel method"):
        check(load_config(config, ["parallel.context.method=rings"]), 8)


def test_megatron_config_trains_with_sequence_parallelism_inside_the_pipeline(tmp_path):
    """configs/megatron.yaml: bf16, pipe2 x data2 x tensor2, sequence parallelism inside 1F1B stages (a
    lockstep program), remat keeping the matmuls; the loss goes down over 4 steps."""
    out = tmp_path / "run"
    config = str(Path(EXPLICIT).parent / "megatron.yaml")
    assert main(["train", config, "train.steps=4", "train.log_every=1", f"train.out_dir={out}", "train.progress=none",
                 "optimizer.warmup_steps=0", "train.eval_every=0", "checkpoint.enabled=false",
                 "logging.tensorboard=false"]) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if r["kind"] == "train"]
    assert len(losses) == 4 and np.isfinite(losses).all() and losses[-1] < losses[0], losses


@pytest.mark.exhaustive
def test_megatron_config_compiles_for_h100(capsys):
    """The same layout on 16 H100s (pipe2 x data2 x tensor4), compiled deviceless: SP's all-gathers and
    reduce-scatters over tensor, the stages' sends over pipe, and the cost model's table beside it."""
    config = str(Path(EXPLICIT).parent / "megatron.yaml")
    assert main(["inspect", config, "--target", "h100:2x8", "mesh.tensor=4", "train.devices=16"]) == 0
    out = capsys.readouterr().out
    for kind, axes in (("all-gather", "tensor"), ("reduce-scatter", "tensor"), ("collective-permute", "pipe")):
        assert re.search(rf"^{kind}\s+\| {axes}\s+\|", out, re.M), (kind, axes, out)
    assert "bytes over tensor per step" in out and "fits" in out


@pytest.mark.exhaustive      # the expert-parallel paths train in tests/test_moe_train.py's default cases
def test_moe_config_trains_over_an_expert_axis(tmp_path):
    """configs/moe.yaml trains the GPT with 8 experts top-2 split over expert=4 x data=2; bad MoE
    settings and an expert axis that does not divide the experts are named by their keys."""
    out = tmp_path / "run"
    config = str(Path(EXPLICIT).parent / "moe.yaml")
    assert main(["train", config, "train.steps=3", "train.log_every=1", "train.eval_batches=1",
                 f"train.out_dir={out}", "train.progress=none", "optimizer.warmup_steps=0", "train.eval_every=0",
                 "checkpoint.enabled=false", "logging.tensorboard=false"]) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert len(train) == 3 and np.isfinite([r["loss"] for r in train]).all(), train
    for r in train:             # the step's MoE metrics, logged every step
        assert 0 <= r["moe/drop_rate"] < 1 and r["moe/load_min"] <= 1 <= r["moe/load_max"] and r["moe/entropy"] > 0
    with pytest.raises(ConfigError, match=r"model.moe: top_k=9 must be an int in \[1, experts=8\]"):
        check(load_config(config, ["model.moe.top_k=9"]), 8)
    with pytest.raises(ConfigError, match=r"model.moe=.*unknown keys \['expert'\]"):
        check(load_config(config, ["model.moe.expert=8"]), 8)


USER_BAD = [  # (overrides on tests/cli_mlp.yaml, text the error must contain)
    ("model.target=jaxpar.models._mlp:MLPClassifer", "model.target='jaxpar.models._mlp:MLPClassifer': "
     "'jaxpar.models._mlp' has no attribute 'MLPClassifer'; did you mean 'MLPClassifier'"),
    ("model.target=no_such_pkg.models:Net", "model.target='no_such_pkg.models:Net': module 'no_such_pkg.models' "
     "not found"),
    ("model.target=jaxpar.models._mlp", "model.target='jaxpar.models._mlp': expected 'package.module:attribute'"),
    ("model.target=jaxpar.models._mlp:__doc__", "'__doc__' is not callable (it is of type str)"),
    (f"model.target={TESTS}/no_such_file.py:Net", "no_such_file.py' not found"),
    ("model.kwargs.width=3", "model.kwargs={'features': 16, 'embed': 32, 'mlp': 64, 'classes': 4, 'depth': 2, "
     "'width': 3}: model.target='jaxpar.models._mlp:MLPClassifier' is called as target(**model.kwargs, "
     "rngs=nnx.Rngs(train.seed)), which does not fit it: got an unexpected keyword argument 'width'"),
    ("model.loss=jaxpar.models._mlp:classifier_los", "model.loss='jaxpar.models._mlp:classifier_los': "
     "'jaxpar.models._mlp' has no attribute 'classifier_los'; did you mean 'classifier_loss'"),
    ("model.loss=null", "model.loss: missing"),
    ("model.loss=jaxpar.models._mlp:MLPClassifier", "model.loss='jaxpar.models._mlp:MLPClassifier': is called as "
     "loss(model, batch) -> scalar, which does not fit it"),
    ("model.layers=4", "overrides: model.layers: keys of the built-in GPT, but model.target="),
    ("data.kind=text", "data.kind='text' makes token windows of model.seq_len for the built-in GPT"),
    (f"data.target={TESTS}/cli_data.py:NOT_CALLABLE", f"data.target='{TESTS}/cli_data.py:NOT_CALLABLE': "
     "'NOT_CALLABLE' is not callable"),
    (f"data.target={TESTS}/cli_data.py:clases", "has no attribute 'clases'; did you mean 'classes'"),
    ("data.target=null", "data.target: missing"),
    ("data.kwargs.seed=3", "data.kwargs.seed: reserved (set data.seed instead)"),
    ("data.kwargs.colour=red", "is called as batches(step, batch_size=data.batch_size, seed=data.seed, "
     "**data.kwargs), which does not fit it: got an unexpected keyword argument 'colour'"),
]


@pytest.mark.parametrize("override,message", USER_BAD, ids=[b[0].replace(str(TESTS), "tests") for b in USER_BAD])
def test_bad_user_model_names_the_key(override, message, capsys):
    with pytest.raises(ConfigError) as err:
        load_config(MLP, [override])
    assert message in str(err.value)
    assert main(["train", MLP, override, "train.out_dir=/nonexistent/jaxpar-test"]) == 2
    assert message in capsys.readouterr().err


def test_train_checks_its_config_once(tmp_path, monkeypatch):
    """``jaxpar train`` builds and checks the config once (``check``), its device-dependent part once
    (``check_on_devices``), and hands what it built to the job; no check is kept on the config object."""
    from jaxpar.config import _checks

    calls = {"build": 0, "devices": 0}
    build, on_devices = _checks._build, _checks.check_on_devices

    def counted_build(cfg):
        calls["build"] += 1
        return build(cfg)

    def counted_on_devices(*args):
        calls["devices"] += 1
        return on_devices(*args)

    monkeypatch.setattr(_checks, "_build", counted_build)
    monkeypatch.setattr("jaxpar.commands._train_command.check_on_devices", counted_on_devices)
    assert main(["train", QUICK, "train.steps=1", "model.embed=32", "model.layers=1", "model.seq_len=16",
                 "data.batch_size=8", "data.max_bytes=100000", "train.eval_batches=0", "logging.samples=0",
                 "logging.tensorboard=false", "checkpoint.enabled=false", "optimizer.warmup_steps=0",
                 f"train.out_dir={tmp_path / 'run'}"]) == 0
    assert calls == {"build": 1, "devices": 1}, calls


def test_bad_batch_is_caught_at_start(capsys):
    """The batch function runs once for step 0 before the model is built; its batch is checked."""
    assert main(["train", MLP, f"data.target={TESTS}/cli_data.py:wrong_rows", "train.out_dir=unused"]) == 2
    err = capsys.readouterr().err
    assert f"data.target='{TESTS}/cli_data.py:wrong_rows' (step 0): batch['x'] has shape (15, 16); every leaf" in err
    assert "data.batch_size=16" in err


def test_user_model_layers_and_import_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)            # a .py path in a YAML file is relative to that file, not the cwd
    cfg = load_config(MLP)
    assert cfg.data.target == f"{TESTS / 'cli_data.py'}:classes" and cfg.model.name == "MLPClassifier"
    assert resolve_import(cfg.data.target, "data.target") is resolve_import(cfg.data.target, "data.target")
    # GPT keys of the base (quickstart.yaml) do not carry over under model.target; a child merges kwargs
    (tmp_path / "child.yaml").write_text(f"base: {MLP}\nmodel: {{kwargs: {{depth: 3}}, name: mlp3}}\n")
    child = load_config(tmp_path / "child.yaml")
    assert child.model.kwargs == {**cfg.model.kwargs, "depth": 3} and child.model.name == "mlp3"
    (tmp_path / "gpt_keys.yaml").write_text(f"base: {MLP}\nmodel: {{embed: 64, heads: 2}}\n")
    with pytest.raises(ConfigError, match=r"gpt_keys\.yaml: model\.embed, model\.heads: keys of the built-in GPT"):
        load_config(tmp_path / "gpt_keys.yaml")
    # an override's .py path is relative to the working directory; the resolved config holds it absolute
    (tmp_path / "mine.py").write_text("def batches(step, *, batch_size, seed):\n    return {}\n")
    over = load_config(MLP, ["data.target=mine.py:batches"])
    assert over.data.target == f"{tmp_path / 'mine.py'}:batches"
    with pytest.raises(ConfigError, match=r"mine\.py:batches' \(step 0\) returned an empty dict"):
        build_data(over.data, eval_batches=0)
    # back to the GPT: a layer that sets model.target (null too) starts the model section afresh
    gpt = load_config(MLP, ["model.target=null", "data.kind=synthetic"])
    assert gpt.model.name == "gpt" and gpt.model.embed == 64        # GPTConfig defaults, not quickstart's 128


def test_import_data_eval_batches():
    cfg = load_config(MLP).data
    batch_fn, evals = build_data(cfg, eval_batches=2)
    assert len(evals) == 2 and not np.array_equal(evals[0]["x"], evals[1]["x"])
    assert not np.array_equal(evals[0]["x"], batch_fn(0)["x"])               # eval=True: another stream
    assert np.array_equal(batch_fn(3)["x"], batch_fn(3)["x"]) and batch_fn(3)["x"].shape == (16, 16)
    no_eval = load_config(MLP, [f"data.target={TESTS}/cli_data.py:no_eval"]).data   # drops the file's kwargs
    assert build_data(no_eval, eval_batches=2)[1] == []                     # no `eval` keyword: no evaluation


# ----------------------------------------------------------------------------- one job for train and inspect
def _step_arguments(monkeypatch, argv):
    """What ``main(argv)`` passes to ``make_train_step`` (stopped right there: nothing compiles or runs)."""
    import jaxpar.step._compose as step_module

    class Stop(Exception):
        pass

    calls = []

    def record(loss_fn, tx, layout, strategy=None, **options):
        calls.append((loss_fn, layout, strategy, options))
        raise Stop

    monkeypatch.setattr(step_module, "make_train_step", record)
    with pytest.raises(Stop):
        main(argv)
    monkeypatch.undo()
    assert len(calls) == 1
    return calls[0]


def test_inspect_builds_the_step_that_train_runs(monkeypatch, tmp_path):
    """``jaxpar inspect`` used to build its own, one-step program: no noise scale, no steps_per_call,
    the schedule passed as the removed ``lr_schedule=``. Now both commands build the step from one job."""
    over = ["model.layers=1", "model.embed=32", "model.seq_len=16", "data.batch_size=8", "data.max_bytes=200000",
            "logging.noise_scale.every=4", "logging.noise_scale.ema=0.9", "optimizer.clip_norm=0.5",
            f"train.out_dir={tmp_path}"]
    t_loss, t_layout, t_strategy, t_options = _step_arguments(monkeypatch, ["train", QUICK, *over])
    i_loss, i_layout, i_strategy, i_options = _step_arguments(monkeypatch, ["inspect", QUICK, *over])
    assert t_layout.parts["noise_scale"].options == i_layout.parts["noise_scale"].options == (4, 0.9)
    assert t_options["clip_norm"] == 0.5 and t_options["skip_nonfinite"] is True and "lr_schedule" not in t_options
    assert i_options == t_options
    assert i_loss is t_loss and i_strategy == t_strategy
    assert sorted(i_layout.parts) == sorted(t_layout.parts) == ["noise_scale"]      # the measured state is there


PIPE_2BW = ["mesh.pipe=2", "mesh.data=2", "mesh.fsdp=1", "mesh.tensor=2", "model.layers=4", "model.embed=32",
            "model.seq_len=16", "data.batch_size=8", "parallel.schedule=pipedream-2bw", "parallel.microbatches=2",
            "train.log_every=2", "train.eval_every=0", "checkpoint.every=0"]


def test_inspect_compiles_the_programs_that_train_runs(capsys):
    """``steps_per_call=K``: inspect compiles the K-step program on K stacked batches; with the noise
    scale, also the program that measures it (train runs both)."""
    assert main(["inspect", QUICK, *PIPE_2BW, "parallel.steps_per_call=2"]) == 0
    out = capsys.readouterr().out
    assert ("program  step (2 optimizer steps per call): batch ['targets']: int32[2, 8, 16], "
            "['tokens']: int32[2, 8, 16]") in out
    assert "time     not predicted: the cost model knows the pipeline schedules" in out
    assert main(["inspect", QUICK, "model.layers=1", "model.embed=32", "model.seq_len=16", "data.batch_size=8",
                 "logging.noise_scale.every=4"]) == 0
    out = capsys.readouterr().out
    programs = [line for line in out.splitlines() if line.startswith("program  ")]
    assert programs == ["program  step (every step): batch ['targets']: int32[8, 16], ['tokens']: int32[8, 16]",
                        "program  measure (every 4 steps: also measures the noise scale): batch ['targets']: "
                        "int32[8, 16], ['tokens']: int32[8, 16]"]
    assert "collectives of the compiled step" in out and "collectives of the compiled measure program" in out


def test_weight_stashing_schedule_reads_the_resolved_mesh():
    """``mesh.pipe: -1`` resolves to a pipeline here: PipeDream weight stashing updates m / k = 4 times
    per step, so the optimizer's schedule reads ``count // 4`` and every update of step ``t`` uses
    ``lr(t)``, which its state holds (and the step logs). It used to read the raw ``mesh.pipe`` (-1 > 1 is false): one update per step."""
    import jax.numpy as jnp

    from jaxpar.config import build_job
    from jaxpar.optimizers import learning_rate

    cfg = load_config(QUICK, ["mesh.pipe=-1", "mesh.data=4", "mesh.fsdp=1", "mesh.tensor=1", "model.layers=4",
                              "parallel.schedule=pipedream", "parallel.microbatches=4", "parallel.update_every=1",
                              "optimizer.name=sgd", "optimizer.momentum=0", "optimizer.weight_decay=0",
                              "optimizer.warmup_steps=5", "optimizer.clip_norm=null", "train.steps=20"])
    job = build_job(cfg, data=False)
    assert dict(job.mesh.shape)["pipe"] == 2 and job.updates_per_step == 4
    params = {"w": jnp.zeros(())}
    state, lrs, held = job.tx.init(params), [], []
    for _ in range(12):                    # 3 steps of 4 updates each
        updates, state = job.tx.update({"w": jnp.ones(())}, state, params)
        lrs.append(-float(updates["w"]))
        held.append(float(learning_rate(state)))
    expected = [float(job.run.lr_schedule(t)) for t in range(3) for _ in range(4)]
    np.testing.assert_allclose(lrs, expected, rtol=1e-6)
    np.testing.assert_allclose(held, expected, rtol=1e-6)


# ----------------------------------------------------------------------------- schedule
def test_schedule_prints_table_and_png(tmp_path, capsys):
    png = tmp_path / "s.png"
    assert main(["schedule", "--kind", "1f1b", "--stages", "4", "--microbatches", "8", "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("1f1b p=4 m=8 v=1 ticks=22") and "s3 |" in out and "bubble fraction 0.2727" in out
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert main(["schedule", "--kind", "interleaved", "--stages", "2", "--microbatches", "4", "--virtual", "2"]) == 0
    assert main(["schedule", "--kind", "pipedream-x", "--stages", "2", "--microbatches", "4"]) == 2
    assert "unknown schedule kind 'pipedream-x'" in capsys.readouterr().err


def test_a_bad_config_is_named_before_the_run_directory_is_touched(tmp_path, capsys):
    """A directory holding an earlier run and a mesh that does not fit the devices: the error names the mesh
    (not the earlier run), and --overwrite moves nothing aside."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.yaml").write_text("earlier: run\n")
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    for extra in ([], ["--overwrite"]):
        assert main(["train", QUICK, f"train.out_dir={out}", "mesh.data=4", *extra]) == 2
        err = capsys.readouterr().err
        assert "mesh.data=4" in err and "earlier run" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    assert (out / "config.yaml").read_text() == "earlier: run\n"


def test_plan_takes_overrides_of_its_config(capsys):
    assert main(["plan", "--config", str(QUICK), "--top", "1", "data.batch_size=64", "model.layers=3"]) == 0
    assert "model    quickstart: " in (out := capsys.readouterr().out) and "batch 64 x 64" in out
    assert main(["plan", "--config", str(QUICK), "--top", "1", "optimizer.lr=-1"]) == 2
    assert "optimizer.lr=-1.0: must be a finite number > 0" in capsys.readouterr().err
    assert main(["plan", "--layers", "2", "data.batch_size=64"]) == 2
    assert "jaxpar plan: error: the overrides data.batch_size=64 need --config CONFIG" in capsys.readouterr().err
    help_text = build_parser()._subparsers._group_actions[0].choices["plan"].format_help()
    assert help_text.count("--batch also overrides") == 0 and "key=value overrides of it may follow" in help_text
