"""The compatibility table (:mod:`jaxpar.compat`) runs once per entry point, and the lower-level
checks that can be called without ``init_train_state`` / ``make_train_step`` raise its problem, not a
message of their own: the class the problem declares and its message with the library's names
(:data:`~jaxpar.compat.LIBRARY_NAMES`).

* :func:`test_the_table_runs_once_per_entry_point`: ``init_train_state`` and ``make_train_step`` run
  the table exactly once each, with PipeDream-2BW, weight stashing, DiLoCo and a codec (nothing they
  call runs it again);
* :func:`~jaxpar.compat.raise_problems` for PipeDream-2BW and weight stashing: sequence parallelism
  (the SP x 2B / SP x ST pairs), a ``pipe`` axis, 2BW's micro-batches, ``update_every``;
* :func:`~jaxpar.parallel.compression.exchange_plan`: a codec needs a data axis; 1-bit Adam with
  gradients sharded over it (the Z x 1A pair);
* ``state_layout(parts=[router_bias(...)])`` (and ``with_router_bias``): a router bias with weight
  stashing or replicas (the ST x RB / RS x RB pairs).
"""
from __future__ import annotations

import jax
import optax
import pytest
from flax import nnx

import jaxpar
from jaxpar.compat import LIBRARY_NAMES, Setting, needs, problems, raise_problems
from jaxpar.parallel.compression import exchange_plan, qsgd, topk
from jaxpar.parallel.sync import diloco, synchronous

S = jaxpar.Strategy
SP_2B = S(schedule="pipedream-2bw", microbatches=2, sequence_parallel=True)
SP_ST = S(schedule="pipedream", microbatches=2, sequence_parallel=True)


ONEBIT_ADAM = topk(0.1, optimizer_momentum=0.9, start_step=5)


def _plan(codec, sizes):
    return exchange_plan(codec, [(4,)], dims=[None], grad_axes=[()], stacked=[False], mesh_sizes=sizes)


#: name: (the call, the setting it checks, the class).
SITES = {
    "piped-SP-2B": (lambda: raise_problems(Setting(SP_2B, {"pipe": 2, "tensor": 2})),
                    Setting(SP_2B, {"pipe": 2, "tensor": 2}), jaxpar.AsyncPipelineError),
    "piped-SP-ST": (lambda: raise_problems(Setting(SP_ST, {"pipe": 2, "tensor": 2})),
                    Setting(SP_ST, {"pipe": 2, "tensor": 2}), jaxpar.StashingError),
    "two_bw-needs-pipe": (lambda: raise_problems(Setting(S(schedule="pipedream-2bw", microbatches=2), {"data": 2})),
                          Setting(S(schedule="pipedream-2bw", microbatches=2), {"data": 2}),
                          jaxpar.AsyncPipelineError),
    "two_bw-microbatches": (lambda: raise_problems(Setting(S(schedule="pipedream-2bw", microbatches=2), {"pipe": 4})),
                            Setting(S(schedule="pipedream-2bw", microbatches=2), {"pipe": 4}),
                            jaxpar.AsyncPipelineError),
    "stash-needs-pipe": (lambda: raise_problems(Setting(S(schedule="pipedream", microbatches=2), {"data": 2})),
                         Setting(S(schedule="pipedream", microbatches=2), {"data": 2}), jaxpar.StashingError),
    "stash-update-every": (lambda: raise_problems(Setting(S(schedule="pipedream", microbatches=4, update_every=3),
                                                          {"pipe": 2})),
                           Setting(S(schedule="pipedream", microbatches=4, update_every=3), {"pipe": 2}),
                           jaxpar.StashingError),
    "codec-needs-data": (lambda: _plan(qsgd(), {"data": 1, "tensor": 8}),
                         Setting(S(compression=qsgd()), {"data": 1, "tensor": 8}), jaxpar.CompressionError),
    "onebit-adam-sharded": (lambda: exchange_plan(ONEBIT_ADAM, [(8, 4)], dims=[0], grad_axes=[("data",)],
                                                  stacked=[False], mesh_sizes={"data": 4}, zero=3),
                            Setting(S(compression=ONEBIT_ADAM, zero=3), {"data": 4}), jaxpar.CompressionError),
    "router-bias-ST": (lambda: _bias_layout({"pipe": 2}, S(schedule="pipedream", microbatches=2)),
                       Setting(S(schedule="pipedream", microbatches=2), {"pipe": 2}, router_bias_rate=0.01),
                       jaxpar.MoEError),
    "router-bias-RS": (lambda: _bias_layout({"replica": 2}, S(sync=synchronous())),
                       Setting(S(sync=synchronous()), {"replica": 2}, router_bias_rate=0.01), jaxpar.MoEError),
}


def _bias_layout(sizes, strategy):
    """A layout of ``strategy`` with a router bias part (traced only)."""
    from jaxpar.step import router_bias

    return _layout(sizes, strategy, parts=[router_bias((2, 4), rate=0.01)])


def _check(call, setting, error):
    found = problems(setting) + needs(setting)
    assert found and found[0].error is error, [(p.features, p.error) for p in found]
    with pytest.raises(jaxpar.JaxparError) as raised:
        call()
    assert type(raised.value) is error
    assert str(raised.value) == found[0].render(LIBRARY_NAMES)


@pytest.mark.parametrize("name", list(SITES))
def test_lower_level_checks_raise_the_table_problem(name):
    _check(*SITES[name])


def test_exchange_plan_unchecked_leaves_the_table_to_its_caller():
    """``exchange_plan(..., checked=False)`` (the table has run for the strategy) does not check the
    codec's rules again: the 1-bit Adam plan over gradients sharded by ZeRO-3 is made."""
    plan = exchange_plan(ONEBIT_ADAM, [(8, 4)], dims=[0], grad_axes=[("data",)], stacked=[False],
                         mesh_sizes={"data": 4}, zero=3, checked=False)
    assert plan.axes == ("data",) and plan.scattered == (True,)


def _layout(sizes, strategy=S(microbatches=2), parts=()):
    from jaxpar.models import GPT, GPTConfig

    cfg = GPTConfig(vocab=32, seq_len=8, embed=16, heads=2, layers=2)
    n = 1
    for v in sizes.values():
        n *= v
    mesh = jaxpar.make_mesh(sizes, devices=jax.devices()[:n])
    return jaxpar.state_layout(lambda: GPT(cfg, rngs=nnx.Rngs(0)), optax.sgd(0.1), mesh, strategy, parts=parts)


#: One strategy of each kind whose layout or step calls the lower-level checks: ``(mesh sizes, strategy)``.
RUNS = {
    "2BW": ({"pipe": 2}, S(schedule="pipedream-2bw", microbatches=2)),
    "stashing": ({"pipe": 2}, S(schedule="pipedream", microbatches=2)),
    "DiLoCo": ({"replica": 2}, S(sync=diloco(2))),
    "codec": ({"data": 2}, S(compression=qsgd())),
}


@pytest.mark.parametrize("name", list(RUNS))
def test_the_table_runs_once_per_entry_point(name, monkeypatch):
    """``init_train_state`` runs the table once (not again in the schedule's, the replicas' or the
    codec's layout), and ``make_train_step`` once (not again for the state's versions or the codec's
    plan). Counted at :func:`jaxpar.compat.problems`, which every run of the table
    (:func:`jaxpar.compat.raise_problems`) calls."""
    from jaxpar.compat import _table
    from jaxpar.models import MLPClassifier, classifier_loss

    runs, real = [], _table.problems
    monkeypatch.setattr(_table, "problems", lambda setting: runs.append(setting) or real(setting))
    sizes, strategy = RUNS[name]
    mesh = jaxpar.make_mesh(sizes, devices=jax.devices()[:2])
    model_fn = lambda: MLPClassifier(features=4, embed=8, mlp=8, classes=3, depth=2, rngs=nnx.Rngs(0))  # noqa: E731
    _, layout = jaxpar.init_train_state(model_fn, optax.sgd(0.1), mesh, strategy)
    assert len(runs) == 1, runs
    jaxpar.make_train_step(classifier_loss, optax.sgd(0.1), layout)
    assert len(runs) == 2, runs[1:]
