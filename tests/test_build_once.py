"""A config is built once: ``check`` and ``build_job`` build each library object once, and ``jaxpar train``
with Muon traces the model once for its layout (the optimizer, the state's layout and the routing lines read it)."""
from pathlib import Path

import pytest

from jaxpar.cli import main
from jaxpar.config import build_job, check, load_config

QUICK = str(Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml")
SMALL = ["model.embed=32", "model.layers=1", "model.seq_len=16", "data.batch_size=8", "data.max_bytes=200000",
         "optimizer.warmup_steps=0", "checkpoint.enabled=false", "train.eval_every=0", "logging.samples=0"]


def _count(monkeypatch, cls, name: str = "__post_init__") -> list:
    """Count the calls of ``cls.<name>`` (its constructions, for a dataclass's ``__post_init__``)."""
    calls, own = [], getattr(cls, name)

    def counted(self, *args, **kwargs):
        calls.append(1)
        return own(self, *args, **kwargs)

    monkeypatch.setattr(cls, name, counted)
    return calls


def test_check_and_build_job_build_each_object_once(monkeypatch):
    """``jaxpar train``'s order: the config loaded unchecked, checked once on the devices, and what the check
    built handed to build_job: one Strategy, one GPTConfig and one batch ramp (the job's ramp is its own copy
    of the checked one). Nothing is kept on the config: a second check builds them again."""
    from jaxpar.models._gpt import GPTConfig
    from jaxpar.run._ramp import BatchRamp
    from jaxpar.strategy import Strategy

    counts = {cls.__name__: _count(monkeypatch, cls) for cls in (Strategy, GPTConfig, BatchRamp)}
    cfg = load_config(QUICK, [*SMALL, "data.batch_ramp={sizes: [8, 16], steps: [0, 2]}"], checked=False)
    made = check(cfg, num_devices=8)
    job = build_job(cfg, data=True, made=made)
    assert {k: len(v) for k, v in counts.items()} == {"Strategy": 1, "GPTConfig": 1, "BatchRamp": 1}
    assert job.ramp is not made.ramp and job.ramp == made.ramp
    assert job.strategy is made.strategy
    assert check(cfg).strategy is not made.strategy and "_built" not in vars(cfg)


def test_train_with_muon_traces_the_model_once(tmp_path, monkeypatch, capsys):
    """The GPT is built twice in all: once traced for the parameters' layout (shapes, logical names, specs,
    kernel layout: Muon's routing and placement, the state's layout and the routing lines read it) and once
    inside the jitted init that creates the arrays."""
    from jaxpar.models._gpt import GPT

    calls = _count(monkeypatch, GPT, "__init__")
    assert main(["train", QUICK, *SMALL, "optimizer.name=muon", "train.steps=1", "train.progress=none",
                 f"train.out_dir={tmp_path / 'run'}"]) == 0
    assert "muon routing (parameter, rule" in capsys.readouterr().out      # the routing lines read the layout
    assert len(calls) == 2


def test_the_mesh_section_has_a_key_for_each_mesh_axis():
    """MeshConfig's keys (in their YAML order) are jaxpar.logical.AXES, the one list of the mesh axes."""
    import dataclasses

    from jaxpar.logical import AXES
    from jaxpar.config._schema import MeshConfig

    assert sorted(f.name for f in dataclasses.fields(MeshConfig)) == sorted(AXES)


def test_the_yaml_sections_take_the_library_defaults():
    """A YAML key that an object of the library takes has that object's default, for every such key: the
    model's (GPTConfig), the strategy's (Strategy), Muon's (muon), the checkpointer's and the noise scale's."""
    import dataclasses
    import inspect

    from jaxpar import Strategy
    from jaxpar.config._schema import (CheckpointConfig, ModelConfig, MuonConfig, NoiseScaleConfig,
                                       ParallelConfig)
    from jaxpar.models import GPTConfig
    from jaxpar.optimizers import muon
    from jaxpar.run import Checkpointer
    from jaxpar.step import noise_scale

    def defaults(cls):
        return {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}

    def keywords(fn):
        return {k: p.default for k, p in inspect.signature(fn).parameters.items() if p.default is not p.empty}

    pairs = [(ModelConfig, defaults(GPTConfig), 9), (ParallelConfig, defaults(Strategy), 9),
             (MuonConfig, keywords(muon), 5), (CheckpointConfig, keywords(Checkpointer), 3),
             (NoiseScaleConfig, keywords(noise_scale), 1)]
    for section, library, count in pairs:
        shared = {k: v for k, v in defaults(section).items() if k in library}
        assert len(shared) == count and shared == {k: library[k] for k in shared}, (section, shared)
