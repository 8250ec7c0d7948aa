"""A model's parameter shapes and logical annotations, traced without allocating anything."""
from __future__ import annotations

from typing import Callable

import jax
from flax import nnx

from jaxpar.errors import ModelStateError


def abstract_model(model_fn: Callable[[], nnx.Module]):
    """The model's structure, parameter shapes and logical annotations, without allocating it.

    Args:
      model_fn: builds the NNX model (every variable an ``nnx.Param``); it is only traced.

    Returns:
      ``(graphdef, shapes, logical)``: the ``nnx`` graph definition, a pure dict of
      ``ShapeDtypeStruct`` and one of ``PartitionSpec`` over logical names.

    Raises:
      ValueError: state that is not an ``nnx.Param``.

    Example:
      >>> from flax import nnx
      >>> from jaxpar.models._mlp import MLPClassifier
      >>> _, shapes, logical = abstract_model(lambda: MLPClassifier(4, 8, 8, 3, depth=1, rngs=nnx.Rngs(0)))
      >>> shapes["inp"]["kernel"].shape, logical["inp"]["kernel"]
      ((4, 8), P(None, 'embed'))
    """
    with nnx.use_eager_sharding(False):
        abs_model = nnx.eval_shape(model_fn)
    graphdef, abs_params, rest = nnx.split(abs_model, nnx.Param, ...)
    kinds = sorted({type(v).__name__ for v in jax.tree.leaves(rest, is_leaf=lambda x: isinstance(x, nnx.Variable))})
    if kinds:
        raise ModelStateError(f"init_train_state: the model has non-Param state ({kinds}); jaxpar trains models whose "
                              "state is all nnx.Param. Keep RNG streams and counters outside the module.")
    logical = nnx.to_pure_dict(nnx.get_partition_spec(abs_params))
    shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), nnx.to_pure_dict(abs_params))
    return graphdef, shapes, logical
