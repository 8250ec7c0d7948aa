"""A ``tensor`` axis of size > 1 that no parameter is split over warns
(:func:`jaxpar.parallel._tensor.warn_unsplit_tensor_axis`, :class:`jaxpar.errors.UnusedAxisWarning`).

A model without tensor-parallel annotations (plain ``nnx.Linear``) on ``data=2 x fsdp=2 x tensor=2``
trains as ``dp2-fsdp2-tp2`` with every device of a ``tensor`` pair holding the same parameters."""
import warnings

import jax
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import jaxpar
from jaxpar.errors import UnusedAxisWarning
from jaxpar.models import MLPClassifier
from jaxpar.parallel._tensor import warn_unsplit_tensor_axis

from conftest import need_devices


class Plain(nnx.Module):
    """No logical names: nothing for tensor_rules to split."""

    def __init__(self, rngs):
        self.up = nnx.Linear(8, 16, rngs=rngs)
        self.down = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
        return self.down(nnx.relu(self.up(x)))


def _mesh(**sizes):
    n = 1
    for v in sizes.values():
        n *= v
    return jaxpar.make_mesh(sizes, devices=jax.devices()[:n])


def _quiet(fn, *args):
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnusedAxisWarning)
        return fn(*args)


@need_devices(8)
def test_unannotated_model_on_a_tensor_axis_warns_with_axis_size_and_fix():
    mesh = _mesh(data=2, fsdp=2, tensor=2)
    layout = jaxpar.state_layout(lambda: Plain(nnx.Rngs(0)), optax.sgd(0.1), mesh)
    assert jaxpar.Strategy().name(dict(mesh.shape)) == "dp2-fsdp2-tp2"      # what the run is called
    with pytest.warns(UnusedAxisWarning) as caught:
        assert warn_unsplit_tensor_axis(layout.params, mesh) is True
    text = str(caught[0].message)
    assert "mesh axis 'tensor' has size 2, but no parameter is split over it" in text
    assert "tensor_rules()" in text and "nnx.with_partitioning" in text and "mesh.tensor=1" in text


@need_devices(8)
def test_annotated_model_or_a_tensor_axis_of_one_is_quiet():
    mlp = lambda: MLPClassifier(features=4, embed=8, mlp=8, classes=3, depth=1, rngs=nnx.Rngs(0))  # noqa: E731
    mesh = _mesh(data=2, fsdp=2, tensor=2)
    layout = jaxpar.state_layout(mlp, optax.sgd(0.1), mesh)
    assert _quiet(warn_unsplit_tensor_axis, layout.params, mesh) is False
    no_tp = _mesh(data=4, fsdp=2)
    plain = jaxpar.state_layout(lambda: Plain(nnx.Rngs(0)), optax.sgd(0.1), no_tp)
    assert _quiet(warn_unsplit_tensor_axis, plain.params, no_tp) is False


@need_devices(4)
def test_spec_trees_and_entries():
    mesh = _mesh(data=2, tensor=2)
    assert _quiet(warn_unsplit_tensor_axis, {"a": P(("fsdp", "tensor"), None)}, mesh) is False   # a tuple entry
    assert _quiet(warn_unsplit_tensor_axis, [{"a": P()}, (P(None, "tensor"),)], mesh) is False
    with pytest.warns(UnusedAxisWarning, match="mesh axis 'tensor' has size 2"):
        warn_unsplit_tensor_axis({"a": P("data"), "b": P(), "c": None}, mesh)
