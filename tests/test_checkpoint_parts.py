"""The optional parts of a train state as one protocol (:mod:`jaxpar.run._state_parts`): every optional
field of ``TrainState`` has exactly one restore policy, the step's (``jaxpar.step.RESTORE_POLICIES``); on real
small states (a tiny MLP with a codec,
relaxed synchronisation or the noise scale; a two-stage GPT with weight stashing), each part's plan
gives each of its four actions, its record is what a checkpoint writes, and ``fresh`` starts it as a
restore does."""
from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import jaxpar
from jaxpar.errors import CheckpointMismatchError
from jaxpar.models import GPT, GPTConfig
from jaxpar.models import MLPClassifier
from jaxpar.parallel.compression import topk
from jaxpar.parallel.sync import stale
from jaxpar.run._state_parts import plan_parts, record_layouts, record_shapes
from jaxpar.step import RESTORE_POLICIES, PartPlan, RestorePolicy, shapes_of
from jaxpar.step import with_noise_scale
from jaxpar.step import StateLayout, TrainState

from conftest import need_devices

TX = optax.adamw(1e-2)
PART = {part.name: part for part in RESTORE_POLICIES}


def _mlp(axes: dict, **strategy):
    model_fn = lambda: MLPClassifier(features=4, embed=8, mlp=8, classes=3, depth=1, rngs=nnx.Rngs(0))  # noqa: E731
    return jaxpar.init_train_state(model_fn, TX, jaxpar.make_mesh(axes), jaxpar.Strategy(**strategy))


def _gpt(**strategy):
    model_fn = lambda: GPT(GPTConfig(vocab=64, seq_len=16, embed=32, heads=4, layers=2), rngs=nnx.Rngs(0))  # noqa: E731
    return jaxpar.init_train_state(model_fn, TX, jaxpar.make_mesh({"pipe": 2, "data": 4}),
                                   jaxpar.Strategy(microbatches=2, **strategy))


#: (the state with the part, one without): ``(state, layout)`` pairs.
BUILD = {"codec": lambda: (_mlp({"data": 8}, compression=topk(0.25)), _mlp({"data": 8})),
         "sync": lambda: (_mlp({"replica": 4, "data": 2}, sync=stale(2)), _mlp({"data": 8})),
         "stats": lambda: (with_noise_scale(*_mlp({"data": 8}), every=1), _mlp({"data": 8})),
         "versions": lambda: (_gpt(schedule="pipedream"), _gpt())}


@functools.cache
def _states(name: str):
    return BUILD[name]()


def _record(state, layout) -> dict:
    """What a checkpoint of ``state`` saved with its layout records of the parts."""
    return {**record_shapes(state), **record_layouts(layout, state)}


def test_every_optional_field_of_the_train_state_has_exactly_one_part():
    optional = [f for f in TrainState._fields if f in TrainState._field_defaults]
    names = [part.name for part in RESTORE_POLICIES]
    assert names == optional and len(set(names)) == len(names), (names, optional)
    assert set(BUILD) == set(names)
    assert all(isinstance(part, RestorePolicy) for part in RESTORE_POLICIES)
    assert StateLayout.__dataclass_fields__["parts"].default_factory() == {}      # each layout part: StateLayout.part


@need_devices(8)
@pytest.mark.parametrize("name", list(BUILD))
def test_each_part_plans_each_action(name):
    """restore (saved with it, restored with it), empty (neither), drop (saved with it, restored
    without), fresh (saved without, restored with it), each drop and fresh with a warning."""
    (on, on_layout), (off, off_layout) = _states(name)
    part = PART[name]
    assert jax.tree.leaves(getattr(on, name)) and not jax.tree.leaves(getattr(off, name))
    with_part, without = _record(on, on_layout), _record(off, off_layout)

    def plan(record: dict, layout) -> PartPlan:
        got = part.plan(record, getattr(layout.abstract_state(), name), layout, "checkpoint 7")
        assert got.part is part and got.part.name == name
        plans = plan_parts(record, layout.abstract_state(), layout, "checkpoint 7")
        assert [p for p in plans if p.part.name == name] == [got]
        return got

    restore, empty = plan(with_part, on_layout), plan(without, off_layout)
    drop, fresh = plan(with_part, off_layout), plan(without, on_layout)
    assert (restore.action, restore.message, empty.action, empty.message) == ("restore", None, "empty", None)
    assert drop.action == "drop" and drop.message.startswith(f"checkpoint 7: {part.what} saved with it")
    assert "dropped" in drop.message and "Parameters and optimizer state are restored." in drop.message
    assert fresh.action == "fresh" and fresh.message.startswith("checkpoint 7: "), fresh.message
    # other shapes of the part: started afresh too
    bigger = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape + (2,), a.dtype), getattr(on, name))
    other = {**with_part, f"{name}_shapes": shapes_of(bigger)}
    assert plan(other, on_layout).action == "fresh"


@need_devices(8)
@pytest.mark.parametrize("name", list(BUILD))
def test_each_part_records_its_shapes_and_layout(name):
    """The record keys of a checkpoint (format 2): ``<name>_shapes`` for the part kept (``stats`` and
    ``versions`` always), ``<name>_layout`` for the parts with a layout record."""
    (on, on_layout), (off, off_layout) = _states(name)
    part = PART[name]
    record = part.record(on_layout)
    expected = {"stats_shapes", "versions_shapes", f"{name}_shapes"} | ({f"{name}_layout"} if record else set())
    assert set(_record(on, on_layout)) == expected
    assert set(_record(off, off_layout)) == {"stats_shapes", "versions_shapes"}
    assert _record(on, on_layout)[f"{name}_shapes"] == shapes_of(getattr(on, name))
    assert (record is None) == (name == "stats"), record
    assert _record(on, None) == record_shapes(on)                     # no layout: shapes only
    assert part.record(off_layout) is None and part.describe(None) == "an unrecorded layout"
    if record is not None:
        assert _record(on, on_layout)[f"{name}_layout"] == record
        assert part.same_layout(record, part.record(on_layout)) and part.describe(record) != part.describe(None)


def _host(tree):
    return [np.asarray(a) for a in jax.tree.leaves(jax.device_get(tree))]


@need_devices(8)
@pytest.mark.parametrize("name", list(BUILD))
def test_each_part_starts_afresh(name):
    """``fresh``: the codec's and the replicas' from the layout's init (which a bare abstract target
    has not: a named error), zero measurements, the older weight versions equal to the parameters."""
    (on, on_layout), _ = _states(name)
    part, abstract = PART[name], on_layout.abstract_state()
    params = jax.tree.map(lambda a: a + 1, on.params)
    got = part.fresh(abstract, params, on_layout, "checkpoint 7")
    assert jax.tree.structure(got) == jax.tree.structure(getattr(abstract, name))
    for value, want in zip(jax.tree.leaves(got), jax.tree.leaves(getattr(abstract, name))):
        assert (value.shape, value.dtype, value.sharding) == (want.shape, want.dtype, want.sharding)
    if name in ("codec", "sync"):
        expected = on_layout.parts[name].init(params)
    elif name == "stats":
        expected = jax.tree.map(np.zeros_like, jax.device_get(on.stats))
    else:
        expected = tuple(params for _ in on.versions)
    for value, want in zip(_host(got), _host(expected), strict=True):
        np.testing.assert_array_equal(value, want)
    if name in ("codec", "sync"):
        with pytest.raises(CheckpointMismatchError, match=r"checkpoint 7: .*call restore\(layout\)"):
            part.fresh(abstract, params, abstract, "checkpoint 7")


def test_the_layout_holds_parts_and_the_local_kinds_have_no_jit_of_their_own():
    """Issue 54 item 4: :class:`~jaxpar.step.StateLayout` keeps its optional parts in ``parts``, no field
    per feature; DiLoCo / local SGD / EASGD's programs are ``jit_program``'s, no ``jax.jit`` of their own."""
    import ast
    import dataclasses
    import inspect

    from jaxpar.step import StateLayout
    from jaxpar.step import _local_steps

    fields = [f.name for f in dataclasses.fields(StateLayout)]
    assert fields == ["mesh", "rules", "graphdef", "shapes", "logical", "params", "grads", "opt_param_specs",
                      "strategy", "layer_lists", "kernel_layout", "model_fn",      # ParamLayout's
                      "opt_state", "opt_shapes", "parts"]
    features = ("codec", "sync", "stats", "versions", "noise", "bias", "part_options")
    assert [f for f in fields if f.startswith(features)] == []
    tree = ast.parse(inspect.getsource(_local_steps))
    jits = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Attribute) and node.attr == "jit"]
    assert jits == [] and "from jax import jit" not in inspect.getsource(_local_steps)
