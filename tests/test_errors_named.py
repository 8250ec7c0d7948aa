"""Every error a user's input can cause is a named :class:`jaxpar.errors.JaxparError`, and the library checks
its own inputs (the YAML layer renders the library's messages under its keys).

* No ``raise ValueError / TypeError / RuntimeError`` of the builtins in ``jaxpar/`` (an AST scan).
* ``make_train_step(clip_norm=...)`` refuses a norm that would freeze the model (0) or run gradient
  ascent (< 0), and its other options; the optimizers, ``Strategy``, ``Plan``, ``GPTConfig``, the
  schedule names and the batch check refuse what they cannot run. Nothing here compiles.
"""
import ast
import math
import re
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import jaxpar
from jaxpar import optimizers as O
from jaxpar.batch import check_batch
from jaxpar.config import ConfigError, load_config
from jaxpar.cost import Plan
from jaxpar.models import GPTConfig, MLPClassifier, classifier_loss
from jaxpar.parallel.pipeline._schedules import get_schedule
from jaxpar.strategy import Strategy

ROOT = Path(__file__).resolve().parents[1]
QUICK = str(ROOT / "configs" / "quickstart.yaml")
BUILTINS = {"ValueError", "TypeError", "RuntimeError"}



def bare_raises(path: Path) -> list[int]:
    """The lines of ``path`` that raise ``ValueError``, ``TypeError`` or ``RuntimeError`` themselves."""
    text, lines = path.read_text(), []
    if not re.search(r"\braise\b[\s(]*(ValueError|TypeError|RuntimeError)\b", text):
        return lines           # only files that name one after a raise are parsed
    for node in ast.walk(ast.parse(text, str(path))):
        if isinstance(node, ast.Raise) and node.exc is not None:
            target = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            if isinstance(target, ast.Name) and target.id in BUILTINS:
                lines.append(node.lineno)
    return lines


def test_jaxpar_raises_no_bare_builtin_errors():
    found = {str(p.relative_to(ROOT)): bare_raises(p) for p in sorted((ROOT / "jaxpar").rglob("*.py"))}
    over = {path: lines for path, lines in found.items() if lines}
    assert not over, ("raise a jaxpar.errors.JaxparError subclass naming the field, the value and the fix "
                      f"instead of a bare ValueError / TypeError / RuntimeError: {over}")


def test_the_scan_finds_a_bare_raise(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("def f(x):\n    if x:\n        raise ValueError('x')\n    raise jaxpar.StepError('y')\n")
    assert bare_raises(path) == [3]


@pytest.fixture(scope="module")
def layout():
    """A one-device MLP's layout, traced only (nothing compiles)."""
    mesh = jaxpar.make_mesh({"data": 1}, devices=jax.devices()[:1])
    model_fn = lambda: MLPClassifier(features=2, embed=4, mlp=4, classes=2, depth=1, rngs=nnx.Rngs(0))  # noqa: E731
    return jaxpar.state_layout(model_fn, optax.sgd(0.1), mesh)


@pytest.mark.parametrize("clip_norm", [-1.0, 0, 0.0, math.nan, math.inf, True, "1.0"])
def test_make_train_step_refuses_a_clip_norm_that_does_not_clip(layout, clip_norm):
    with pytest.raises(jaxpar.StepError, match=re.escape(f"make_train_step(clip_norm={clip_norm!r}): must be a "
                                                         "finite number > 0")):
        jaxpar.make_train_step(classifier_loss, optax.sgd(0.1), layout, clip_norm=clip_norm)


def test_make_train_step_takes_a_positive_clip_norm_or_none(layout):
    for clip_norm in (1.0, 2, None):
        assert "step" in jaxpar.make_train_step(classifier_loss, optax.sgd(0.1), layout, clip_norm=clip_norm).programs


@pytest.mark.parametrize("options,message", [
    ({"loss_fn": None}, "make_train_step(loss_fn=None): must be a function"),
    ({"donate": "yes"}, "make_train_step(donate='yes'): must be True or False"),
    ({"skip_nonfinite": 1}, "make_train_step(skip_nonfinite=1): must be True or False"),
    ({"explicit_dp": "auto"}, "make_train_step(explicit_dp='auto'): must be True or False or None"),
])
def test_make_train_step_names_its_other_options(layout, options, message):
    args = {"loss_fn": classifier_loss, **options}
    with pytest.raises(jaxpar.StepError, match=re.escape(message)):
        jaxpar.make_train_step(args.pop("loss_fn"), optax.sgd(0.1), layout, **args)


@pytest.mark.parametrize("build,message", [
    (lambda: O.lars(-0.1), "lars(learning_rate=-0.1): must be a finite number > 0"),
    (lambda: O.lars(0.1, momentum=1.0), "lars(momentum=1.0): must be a decay in [0, 1)"),
    (lambda: O.lars(0.1, trust_coefficient=0.0), "lars(trust_coefficient=0.0): must be a finite number > 0"),
    (lambda: O.lamb(0.1, b1=1.0), "lamb(b1=1.0): must be a decay in [0, 1)"),
    (lambda: O.lamb(0.1, b2=math.nan), "lamb(b2=nan): must be a decay in [0, 1)"),
    (lambda: O.lamb(0.1, eps=-1e-8), "lamb(eps=-1e-08): must be a finite number >= 0"),
    (lambda: O.lamb(0.1, weight_decay=True), "lamb(weight_decay=True): must be a finite number >= 0"),
    (lambda: O.adamw_frozen_variance(0.1, 10, weight_decay=-0.1), "adamw_frozen_variance(weight_decay=-0.1)"),
    (lambda: O.scale_by_adam_frozen_variance(10, b2=1.5), "scale_by_adam_frozen_variance(b2=1.5)"),
    (lambda: O.scale_by_layer_trust_ratio(eps=math.inf), "scale_by_layer_trust_ratio(eps=inf)"),
    (lambda: O.scaled_lr(math.nan, 64, 32), "scaled_lr(lr=nan): must be a finite number > 0"),
])
def test_optimizers_refuse_hyperparameters_out_of_range(build, message):
    with pytest.raises(jaxpar.OptimizerError, match=re.escape(message)):
        build()


def test_optimizers_take_schedules_and_plain_values():
    O.lamb(optax.constant_schedule(0.1), b1=0.0, eps=0.0, weight_decay=np.float32(0.01))
    O.lars(0.1, momentum=0.0, weight_decay=optax.constant_schedule(0.1))


@pytest.mark.parametrize("build,error,message", [
    (lambda: jaxpar.Strategy(zero=True), jaxpar.StrategyError, "Strategy.zero=True"),
    (lambda: jaxpar.Strategy(microbatches=True), jaxpar.StrategyError, "Strategy.microbatches=True"),
    (lambda: jaxpar.Strategy(virtual_stages=True), jaxpar.StrategyError, "Strategy.virtual_stages=True"),
    (lambda: jaxpar.Strategy(sequence_parallel=1), jaxpar.StrategyError, "Strategy.sequence_parallel=1"),
    (lambda: jaxpar.Strategy(stage_layers=4), jaxpar.StrategyError, "Strategy.stage_layers=4: give one positive int"),
    (lambda: jaxpar.Strategy(stage_layers=(2, 0)), jaxpar.StrategyError, "Strategy.stage_layers=(2, 0)"),
    (lambda: jaxpar.Strategy(schedule="1f2b"), jaxpar.ScheduleError, "unknown schedule kind '1f2b'"),
    (lambda: get_schedule("zb-h2", 2, 2), jaxpar.ScheduleError, "unknown schedule kind 'zb-h2'"),
    (lambda: get_schedule("1f1b", 2, True), jaxpar.ScheduleError, "one_f_one_b(m=True): must be an int >= 1"),
    (lambda: Plan(strategy={"zero": 1}), jaxpar.PlanError, "Plan.strategy={'zero': 1}: give a jaxpar.Strategy"),
    (lambda: Plan(pipe=2, strategy=Strategy(schedule="pipedream")), jaxpar.PlanError,
     "Plan.strategy.schedule='pipedream': the cost model knows"),
    (lambda: Plan(data=0), jaxpar.PlanError, "Plan(data=0): must be an int >= 1"),
    (lambda: GPTConfig(mlp=0), jaxpar.ModelConfigError, "GPTConfig.mlp=0: must be a positive int (or None"),
    (lambda: GPTConfig(vocab=True), jaxpar.ModelConfigError, "GPTConfig.vocab=True: must be a positive int"),
    (lambda: GPTConfig(init_std=math.nan), jaxpar.ModelConfigError, "GPTConfig.init_std=nan"),
    (lambda: GPTConfig(scan_layers=1), jaxpar.ModelConfigError, "GPTConfig.scan_layers=1"),
    (lambda: jaxpar.run.LogOptions(peak_flops=math.nan), jaxpar.LoopError, "LogOptions(peak_flops=nan)"),
    (lambda: jaxpar.run.LogOptions(flops_per_token=-1), jaxpar.LoopError, "LogOptions(flops_per_token=-1)"),
])
def test_library_objects_refuse_what_they_cannot_run(build, error, message):
    with pytest.raises(error, match=re.escape(message)):
        build()


def test_the_batch_check_names_the_leaf_and_the_fix():
    mesh = jaxpar.make_mesh({"data": 2}, devices=jax.devices()[:2])
    with pytest.raises(jaxpar.BatchError, match=re.escape("batch leaf 'x': global batch size 3 is not divisible")):
        check_batch({"x": np.zeros((3, 2))}, mesh, 1)
    with pytest.raises(jaxpar.BatchError, match="'x' is a scalar"):
        check_batch({"x": np.float32(1)}, mesh, 1)
    with pytest.raises(jaxpar.BatchError, match="holds no arrays"):
        check_batch({}, mesh, 1)
    assert check_batch({"x": np.zeros((4, 2)), "y": np.zeros(4)}, mesh, 2) == 4


@pytest.mark.parametrize("override,message", [
    ("optimizer.clip_norm=-1.0", "optimizer.clip_norm=-1.0: must be a finite number > 0 (the global gradient "
                                 "norm to clip to, e.g. 1.0), or null for no clipping."),
    ("optimizer.clip_norm=0", "optimizer.clip_norm=0.0: must be a finite number > 0"),
    ("optimizer.lr=.nan", "optimizer.lr=nan: must be a finite number > 0."),
    ("optimizer.b2=1.0", "optimizer.b2=1.0: must be a decay in [0, 1)."),
    ("optimizer.eps=-1.0", "optimizer.eps=-1.0: must be a finite number >= 0."),
    ("optimizer.weight_decay=-0.1", "optimizer.weight_decay=-0.1: must be a finite number >= 0"),
    ("model.mlp=0", "model.mlp=0: must be a positive int (or None: 4 x embed)."),
])
def test_the_yaml_renders_the_librarys_checks_under_its_keys(override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(QUICK, [override])
