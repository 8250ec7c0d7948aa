"""The compatibility table in one place (:mod:`jaxpar.compat`): the library and the config layer
raise the same :class:`~jaxpar.compat.Problem`, rendered with two name maps.

* :func:`test_config_and_library_render_one_problem`: each rule the config layer used to restate
  under YAML names (PipeDream-2BW and weight stashing need a pipe axis, ``update_every`` divides the
  micro-batches, the noise scale needs a data axis, ``steps_per_call`` divides the loop's intervals)
  and each the library wrote out of the table (a codec needs a data axis, a sync kind its replicas
  and backup fewer spares than replicas) is now one problem of :func:`jaxpar.compat.needs`:
  the config's setting and the library's
  give the same Problem (features, fields, template, values, class), :func:`jaxpar.config.check`
  prints it with :data:`~jaxpar.config._checks.YAML_NAMES`, and :func:`~jaxpar.compat.raise_problems`
  raises it as its class with :data:`~jaxpar.compat.LIBRARY_NAMES`.
* :func:`test_a_yaml_router_bias_is_refused_with_the_yaml_names`: ``model.moe.bias_rate`` is the table's
  router bias (RB): its refused pairs are the library's problems, printed with the YAML keys.
* :func:`test_a_strategy_raises_the_table_rules_of_its_fields`: ``Strategy(...)`` raises the needs
  that read its fields alone (``local_clip`` without a codec, ``update_every`` / ``vertical_sync``
  without weight stashing) as the table's problem.
* :func:`test_requirements_list_every_need`: the needs that docs/strategies.md lists
  (:data:`jaxpar.compat._needs.REQUIREMENTS`) are the rules', one case each.
* :func:`test_init_train_state_raises_the_declared_class`: ``init_train_state`` raises the table's
  class (MoEError for experts under PipeDream-2BW, not a plain ValueError) and the table's message.
* :func:`test_commands_report_every_jaxpar_error`: the CLI's usage errors are :class:`~jaxpar.JaxparError`.
"""
from __future__ import annotations

import dataclasses
import re

import jax
import optax
import pytest
from flax import nnx

import jaxpar
from jaxpar.compat._needs import REQUIREMENTS
from jaxpar.compat import LIBRARY_NAMES, Setting, needs, problems, raise_problems
from jaxpar.config import build_strategy
from jaxpar.config._build import mesh_spec
from jaxpar.config import check
from jaxpar.config._checks import YAML_NAMES, table_setting
from jaxpar.parallel.compression import qsgd
from jaxpar.parallel.sync import backup, diloco, synchronous
from jaxpar.config import (CheckpointConfig, ConfigError, DataConfig, JobConfig, LoggingConfig, MeshConfig,
                           ModelConfig, ParallelConfig, TrainConfig)
from jaxpar.config._schema import NoiseScaleConfig

#: name: (the config, the library's setting of the same run minus the strategy and mesh, the class).
CASES = {
    "2B-needs-pipe": (JobConfig(mesh=MeshConfig(data=8), parallel=ParallelConfig(schedule="pipedream-2bw",
                                                                                microbatches=2)),
                      {}, jaxpar.AsyncPipelineError),
    "2B-microbatches": (JobConfig(mesh=MeshConfig(pipe=4, data=2), parallel=ParallelConfig(schedule="pipedream-2bw",
                                                                                          microbatches=2)),
                        {}, jaxpar.AsyncPipelineError),
    "ST-needs-pipe": (JobConfig(mesh=MeshConfig(data=8), parallel=ParallelConfig(schedule="pipedream",
                                                                                microbatches=2)),
                      {}, jaxpar.StashingError),
    "ST-update-every": (JobConfig(mesh=MeshConfig(pipe=2, data=4),
                                  parallel=ParallelConfig(schedule="pipedream", microbatches=4, update_every=3)),
                        {}, jaxpar.StashingError),
    "NS-needs-data": (JobConfig(mesh=MeshConfig(tensor=8),
                                logging=LoggingConfig(noise_scale=NoiseScaleConfig(every=10))),
                      {"noise_scale_every": 10}, jaxpar.NoiseScaleError),
    "CP-needs-data": (JobConfig(mesh=MeshConfig(tensor=8), parallel=ParallelConfig(compression={"kind": "qsgd"})),
                      {}, jaxpar.CompressionError),
    "RS-needs-replicas": (JobConfig(mesh=MeshConfig(data=8),
                                    parallel=ParallelConfig(sync={"kind": "diloco", "every": 5})),
                          {}, jaxpar.SyncError),
    "RS-backups": (JobConfig(mesh=MeshConfig(replica=4, data=2),
                             parallel=ParallelConfig(sync={"kind": "backup", "backups": 4})),
                   {}, jaxpar.SyncError),
    "K-intervals": (JobConfig(parallel=ParallelConfig(steps_per_call=4), mesh=MeshConfig(data=8),
                              train=TrainConfig(steps=8, log_every=6), checkpoint=CheckpointConfig(every=8)),
                    {"steps_per_call": 4, "intervals": (("steps", 8), ("log_every", 6))}, jaxpar.LoopError),
    "BR-needs-NS": (JobConfig(mesh=MeshConfig(data=8),
                              data=DataConfig(batch_ramp={"sizes": [32, 64], "adaptive": True, "every": 4})),
                    {"ramp": "adaptive"}, jaxpar.RampError),
}


def _unchecked_strategy(**fields) -> jaxpar.Strategy:
    """A :class:`~jaxpar.Strategy` with ``fields`` set, built without its checks (to hand the table a
    strategy that ``Strategy(...)`` refuses)."""
    strategy = object.__new__(jaxpar.Strategy)
    for f in dataclasses.fields(jaxpar.Strategy):
        object.__setattr__(strategy, f.name, fields.get(f.name, f.default))
    return strategy


#: name: the fields of a strategy that ``Strategy(...)`` refuses by a need of the table.
STRATEGY_CASES = {"LC-needs-CP": dict(local_clip=1.0), "update_every-needs-ST": dict(microbatches=4, update_every=2),
                  "vertical_sync-needs-ST": dict(schedule="pipedream-2bw", microbatches=2, vertical_sync=True)}


@pytest.mark.parametrize("name", list(STRATEGY_CASES))
def test_a_strategy_raises_the_table_rules_of_its_fields(name):
    """``Strategy(...)`` raises the table's need of its fields alone (:func:`~jaxpar.compat._needs.strategy_needs`),
    as StrategyError with the library's names; the table holds it among its needs."""
    fields = STRATEGY_CASES[name]
    found = needs(Setting(_unchecked_strategy(**fields), {"pipe": 2, "data": 2}))
    assert len(found) == 1 and found[0].error is jaxpar.StrategyError, found
    with pytest.raises(jaxpar.JaxparError) as raised:
        jaxpar.Strategy(**fields)
    assert type(raised.value) is jaxpar.StrategyError and str(raised.value) == found[0].render(LIBRARY_NAMES)


@pytest.mark.parametrize("name", list(CASES))
def test_config_and_library_render_one_problem(name):
    cfg, options, error = CASES[name]
    strategy, sizes = build_strategy(cfg.parallel), mesh_spec(cfg.mesh).sizes(8)
    library = needs(Setting(strategy, sizes, **options))
    config = needs(table_setting(cfg, strategy, sizes))
    assert len(library) == 1 and library == config, (library, config)
    problem = library[0]
    assert problem.error is error and len(problem.features) == 1
    with pytest.raises(ConfigError) as err:
        check(cfg, num_devices=8)
    assert problem.render(YAML_NAMES) in str(err.value)
    with pytest.raises(error) as raised:
        raise_problems(Setting(strategy, sizes, **options))
    assert type(raised.value) is error and str(raised.value) == problem.render(LIBRARY_NAMES)
    assert problem.render(YAML_NAMES) != problem.render(LIBRARY_NAMES)      # the names differ, not the rule
    for text in (problem.render(YAML_NAMES), problem.render(LIBRARY_NAMES)):
        assert "{" not in text and "}" not in text, text


def test_requirements_list_every_need():
    """docs/strategies.md's list of needs (:data:`jaxpar.compat._needs.REQUIREMENTS`) is the rules': one
    case of :data:`STRATEGY_CASES` and :data:`CASES` per line, of that feature and class, in the rules' order."""
    got = [(p.features[0], p.error) for fields in list(STRATEGY_CASES.values())[:2]
           for p in needs(Setting(_unchecked_strategy(**fields), {"pipe": 2, "data": 2}))]
    for cfg, options, _ in CASES.values():
        strategy, sizes = build_strategy(cfg.parallel), mesh_spec(cfg.mesh).sizes(8)
        got += [(p.features[0], p.error) for p in needs(Setting(strategy, sizes, **options))]
    assert got == [(code, error) for code, _, error in REQUIREMENTS]


def test_every_yaml_name_has_a_library_name():
    """The two name maps cover the same fields (a field missing from one would print its bare key)."""
    assert set(YAML_NAMES) <= set(LIBRARY_NAMES), sorted(set(YAML_NAMES) - set(LIBRARY_NAMES))
    missing = set(LIBRARY_NAMES) - set(YAML_NAMES)
    assert missing == {"start", "stop_check_every"}, sorted(missing)    # loop arguments without a YAML key


@pytest.mark.parametrize("parallel, mesh, code", [
    (ParallelConfig(schedule="pipedream", microbatches=2), MeshConfig(pipe=2, data=4), "ST"),
    (ParallelConfig(schedule="pipedream-2bw", microbatches=2), MeshConfig(pipe=2, data=4), "2B"),
    (ParallelConfig(sync={"kind": "diloco", "every": 5}), MeshConfig(replica=2, data=4), "RS"),
], ids=["ST", "2B", "RS"])
def test_a_yaml_router_bias_is_refused_with_the_yaml_names(parallel, mesh, code):
    """``model.moe.bias_rate`` (the job adds a router bias) is the table's RB: a config with a no-flush
    schedule or replicas gets the library's Problem (class MoEError), printed with the YAML keys; a
    rate of 0 adds no bias and is not refused."""
    moe = {"experts": 4, "top_k": 2, "bias_rate": 0.001}
    cfg = JobConfig(model=ModelConfig(moe=moe), mesh=mesh, parallel=parallel)
    strategy, sizes = build_strategy(cfg.parallel), mesh_spec(cfg.mesh).sizes(8)
    library = problems(Setting(strategy, sizes, router_bias_rate=0.001))
    assert [p for p in problems(table_setting(cfg, strategy, sizes)) if "RB" in p.features] == library
    assert [set(p.features) for p in library] == [{code, "RB"}] and library[0].error is jaxpar.MoEError
    text = library[0].render(YAML_NAMES)
    assert text.startswith("model.moe.bias_rate=0.001 with ") and "model.moe.aux_weight" in text, text
    with pytest.raises(ConfigError) as err:
        check(cfg, num_devices=8)
    assert text in str(err.value)
    off = JobConfig(model=ModelConfig(moe={**moe, "bias_rate": 0.0}), mesh=mesh, parallel=parallel)
    assert table_setting(off, strategy, sizes).router_bias_rate is None
    assert not [p for p in problems(table_setting(off, strategy, sizes)) if "RB" in p.features]


def _init(sizes, strategy):
    from jaxpar.models import GPT, GPTConfig

    cfg = GPTConfig(vocab=32, seq_len=8, embed=16, heads=2, layers=2)
    n = 1
    for v in sizes.values():
        n *= v
    mesh = jaxpar.make_mesh(sizes, devices=jax.devices()[:n])
    return jaxpar.init_train_state(lambda: GPT(cfg, rngs=nnx.Rngs(0)), optax.sgd(0.1), mesh, strategy)


@pytest.mark.parametrize("sizes,strategy,error", [
    ({"pipe": 2, "expert": 2}, jaxpar.Strategy(schedule="pipedream-2bw", microbatches=2), jaxpar.MoEError),
    ({"pipe": 2, "context": 2}, jaxpar.Strategy(schedule="pipedream", microbatches=2), jaxpar.ContextParallelError),
    ({"data": 2}, jaxpar.Strategy(schedule="pipedream-2bw", microbatches=2), jaxpar.AsyncPipelineError),
    ({"tensor": 2}, jaxpar.Strategy(compression=qsgd()), jaxpar.CompressionError),
    ({"data": 2}, jaxpar.Strategy(sync=diloco(2)), jaxpar.SyncError),
    ({"replica": 2, "data": 2}, jaxpar.Strategy(sync=backup(2)), jaxpar.SyncError),
    ({"pipe": 2, "replica": 2}, jaxpar.Strategy(microbatches=2, sync=synchronous()), jaxpar.SyncError),
], ids=["2B-EP", "ST-CX", "2B-needs-pipe", "CP-needs-data", "RS-needs-replicas", "RS-backups", "RS-PP"])
def test_init_train_state_raises_the_declared_class(sizes, strategy, error):
    found = (problems(Setting(strategy, sizes)) + needs(Setting(strategy, sizes)))[0]
    assert found.error is error
    with pytest.raises(error, match=re.escape(found.render(LIBRARY_NAMES))) as raised:
        _init(sizes, strategy)
    assert type(raised.value) is error


def test_commands_report_every_jaxpar_error():
    for name in jaxpar.errors.__all__:
        cls = getattr(jaxpar.errors, name)
        if issubclass(cls, Exception) and not issubclass(cls, Warning):
            assert issubclass(cls, jaxpar.errors.JaxparError), name


def test_train_refuses_an_adaptive_ramp_without_the_noise_scale():
    """``train(ramp=AdaptiveRamp(...))`` raises the table's BR need (RampError, the library's names)
    when the state measures no noise scale, and takes the same ramp when it measures one."""
    import jax.numpy as jnp

    from jaxpar.run import AdaptiveRamp, train
    from jaxpar.run._loop import _checked_train_args
    from jaxpar.step import TrainState

    ramp = AdaptiveRamp((8, 16), every=4)
    found = needs(Setting(jaxpar.Strategy(), {}, ramp="adaptive"))
    assert [(p.features, p.error) for p in found] == [(("BR",), jaxpar.RampError)]
    mesh = jaxpar.make_mesh({"data": 2}, devices=jax.devices()[:2])
    plain = TrainState(jnp.int32(0), jnp.zeros(2), ())
    with pytest.raises(jaxpar.RampError) as raised:
        train(lambda s, b: (s, {}), plain, lambda i: None, mesh=mesh, steps=4, ramp=ramp, progress="none")
    assert str(raised.value) == found[0].render(LIBRARY_NAMES)
    from jaxpar.step._noise_scale import init_state

    _checked_train_args(plain._replace(stats={"noise_scale": init_state()}), jaxpar.run.LogOptions(), steps=4,
                        start_step=None, eval_every=0, max_inflight=2, stop_check_every=None, on_nonfinite="stop",
                        ramp=ramp, steps_per_call=1, checkpointer=None)


@pytest.mark.parametrize("sizes, strategy, on", [
    ({"data": 8}, jaxpar.Strategy(), set()),
    ({"data": 4, "tensor": 2}, jaxpar.Strategy(compute_dtype="bfloat16"), {"TP", "BF"}),
    ({"fsdp": 2, "expert": 4}, jaxpar.Strategy(), {"Z", "EP"}),
    ({"data": 2, "context": 4}, jaxpar.Strategy(zero=1, microbatches=2), {"Z", "MB", "CX"}),
], ids=["none", "TP-BF", "Z-EP", "Z-MB-CX"])
def test_each_feature_is_on_for_the_setting_that_asks_for_it(sizes, strategy, on):
    assert {f.code for f in jaxpar.compat.FEATURES if f.on(Setting(strategy, sizes))} == on
