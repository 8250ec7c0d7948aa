"""ZeRO / FSDP never leave a large leaf replicated silently (issue 76, item 3).

The newcomer's case: ``jaxpar inspect configs/quickstart.yaml model.embed=129 model.heads=3 mesh.fsdp=4
mesh.tensor=1`` (``data=2 x fsdp=4``, ``zero=0``) kept ``blocks/w1`` (``mlp`` 516 = 4 x 129) replicated: the
ZeRO dimension had to divide ``fsdp x data`` = 8 although at stage 0 ``data`` shards nothing. The dimension
now divides the ZeRO axes of the stage (:func:`jaxpar.parallel._zero.zero_divisor`), a dimension split only
over size-1 axes counts as free, and a large leaf that still fits nowhere warns
(:func:`jaxpar.parallel._zero.warn_replicated`, :class:`jaxpar.errors.ReplicatedLeafWarning`).
"""
import warnings

import jax
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import jaxpar
from jaxpar.analysis._sharding_table import sharding_table
from jaxpar.cost._memory import leaf_shard_counts, sizes_key
from jaxpar.cost._model import gpt
from jaxpar.errors import ReplicatedLeafWarning
from jaxpar.models import GPT, GPTConfig
from jaxpar.parallel import add_zero_axes, zero_dim
from jaxpar.parallel._data_parallel import manual_layout
from jaxpar.parallel._zero import REPLICATED_WARN_BYTES, warn_replicated

from conftest import need_devices

CFG = GPTConfig(vocab=64, seq_len=8, embed=129, heads=3, layers=2)      # mlp 516: a multiple of 4, not of 8
SIZES = {"data": 2, "fsdp": 4, "tensor": 1}


def _layout(zero):
    mesh = jaxpar.make_mesh(SIZES, devices=jax.devices()[:8])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ReplicatedLeafWarning)
        layout = jaxpar.state_layout(lambda: GPT(CFG, rngs=nnx.Rngs(0)), optax.adam(1e-3), mesh,
                                     jaxpar.Strategy(zero=zero))
    return layout, [str(w.message) for w in caught if w.category is ReplicatedLeafWarning]


def _shapes(**leaves):
    return {k: jax.ShapeDtypeStruct(s, "float32") for k, s in leaves.items()}


def _warned(shapes, sizes, stage=3, **split):
    specs = {k: split.get(k, P()) for k in shapes}
    logical = {k: (None,) * len(s.shape) for k, s in shapes.items()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ReplicatedLeafWarning)
        names = warn_replicated(shapes, specs, logical, sizes, stage)
    return names, [str(w.message) for w in caught if w.category is ReplicatedLeafWarning]


def test_a_dimension_split_only_over_size_1_axes_is_free():
    sizes = {"data": 1, "fsdp": 4, "tensor": 1}
    assert zero_dim((2, 129, 516), ("layers", "embed", "mlp"), P(None, None, "tensor"), sizes) == 2
    assert add_zero_axes(P(None, None, "tensor"), (2, 129, 516), ("layers", "embed", "mlp"), ("fsdp",),
                         sizes) == P(None, None, "fsdp")
    assert zero_dim((2, 129, 516), ("layers", "embed", "mlp"), P(None, None, "tensor"), {**sizes, "tensor": 2}) is None


def test_at_stage_0_the_dimension_need_not_divide_data():
    logical, spec = ("layers", "embed", "mlp"), P(None, None, "tensor")
    assert zero_dim((2, 129, 516), logical, spec, SIZES, stage=0) == 2
    for stage in (1, 2, 3):                         # the optimizer state is split over data x fsdp = 8
        assert zero_dim((2, 129, 516), logical, spec, SIZES, stage=stage) is None
    assert zero_dim((2, 129, 520), logical, spec, SIZES, stage=3) == 2


@need_devices(8)
def test_the_newcomer_case_splits_the_mlp_over_fsdp_everywhere():
    layout, caught = _layout(zero=0)
    blocks = lambda tree: tree["blocks"]  # noqa: E731
    for tree in (layout.params, layout.grads, layout.opt_param_specs):
        assert blocks(tree)["w1"] == P(None, None, "fsdp") and blocks(tree)["w2"] == P(None, "fsdp", None)
    table = sharding_table(layout)
    w1_row = next(line for line in table.splitlines() if line.startswith("blocks/w1 "))
    assert "(-, -, fsdp)" in w1_row and "tensor" not in w1_row        # a size-1 axis shows as '-'
    # the explicit data-parallel layout and the cost model split the same dimension
    lay = manual_layout(layout.logical, layout.shapes, layout.mesh, layout.rules, 0)
    assert blocks(lay)["w1"] == (2, ("fsdp",), ("fsdp",))
    w1 = gpt(layers=2, hidden=129, heads=3, seq=8, vocab=64, batch=8).leaf("blocks/w1")
    assert leaf_shard_counts(w1, sizes_key(SIZES), 0).params == 4
    assert leaf_shard_counts(w1, sizes_key(SIZES), 1).params == 1
    # the attention weights (129, 3, 43: none a multiple of 4) stay replicated, and say so
    assert len(caught) == 1 and "blocks/wq: 2x129x3x43 float32, 130.0 KiB per device" in caught[0]
    assert "blocks/w1" not in caught[0] and "replicated over fsdp=4:" in caught[0]
    assert "blocks/b2" not in caught[0] and "lnf_bias" not in caught[0]     # 1 KiB, 516 B: under the threshold


@need_devices(8)
def test_the_newcomer_case_at_zero_1_warns_with_the_name_bytes_and_the_fix():
    layout, caught = _layout(zero=1)
    assert layout.opt_param_specs["blocks"]["w1"] == P(None, None, "tensor")     # tensor=1: nothing split
    assert len(caught) == 1
    text = caught[0]
    assert "(zero=1)" in text and "replicated over fsdp=4 x data=2" in text
    assert "blocks/w1: 2x129x516 float32, 520.0 KiB per device" in text
    assert "(516, 129) is a multiple of 8 (e.g. 516 -> 520)" in text
    assert "Fix:" in text and "REPLICATED_WARN_BYTES" in text


@need_devices(8)
def test_init_train_state_shards_the_mlp_over_fsdp():
    mesh = jaxpar.make_mesh(SIZES, devices=jax.devices()[:8])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ReplicatedLeafWarning)
        state, _ = jaxpar.init_train_state(lambda: GPT(CFG, rngs=nnx.Rngs(0)), optax.sgd(0.1), mesh,
                                           jaxpar.Strategy(zero=0))
    w1 = state.params["blocks"]["w1"]
    assert w1.sharding.spec == P(None, None, "fsdp")
    assert {s.data.shape for s in w1.addressable_shards} == {(2, 129, 129)}


def test_a_leaf_warns_from_the_bytes_threshold_on():
    sizes, split = {"data": 2, "fsdp": 4}, P(("fsdp", "data"))
    assert 127 * 129 * 4 < REPLICATED_WARN_BYTES <= 129 * 129 * 4
    names, caught = _warned(_shapes(big=(8192, 4096), odd=(129, 129), b=(515,)), sizes, big=split)
    assert names == ["odd"] and len(caught) == 1
    assert "odd: 129x129 float32, 65.0 KiB per device" in caught[0] and "(e.g. 129 -> 136)" in caught[0]
    assert _warned(_shapes(big=(8192, 4096), odd=(127, 129)), sizes, big=split) == ([], [])   # just under


def test_a_tensor_split_counts_the_bytes_per_device():
    shapes, sizes = _shapes(w=(129, 254)), {"fsdp": 4, "tensor": 2}       # 128 KiB, 64 KiB - 4 B per device
    assert _warned(shapes, sizes, stage=0, w=P(None, "tensor")) == ([], [])
    assert _warned(shapes, sizes, stage=0)[0] == ["w"]


def test_a_long_list_is_cut_after_ten_leaves():
    names, caught = _warned(_shapes(**{f"w{i:02d}": (129, 129) for i in range(12)}), {"fsdp": 8})
    assert len(names) == 12 and "leave 12 parameter(s)" in caught[0]
    assert "w09:" in caught[0] and "w10:" not in caught[0] and "  ... and 2 more" in caught[0]


def test_no_warning_where_zero_shards_nothing_or_the_leaf_is_split():
    shapes = _shapes(w=(129, 515))
    assert _warned(shapes, {"data": 8}, stage=0) == ([], [])        # plain data parallelism: no ZeRO axis
    with warnings.catch_warnings():
        warnings.simplefilter("error", ReplicatedLeafWarning)
        assert warn_replicated(shapes, {"w": P("fsdp")}, {"w": (None, None)}, {"data": 2, "fsdp": 4}, 3) == []


def test_every_state_named_that_zero_shards():
    _, caught = _warned(_shapes(w=(129, 515)), {"data": 8}, stage=1)      # ZeRO-1: the optimizer state only
    assert "replicated over data=8: each device of that group holds their whole optimizer state." in caught[0]
    _, caught = _warned(_shapes(w=(129, 515)), {"fsdp": 8}, stage=0)
    assert "their whole parameters, gradients and optimizer state." in caught[0]
