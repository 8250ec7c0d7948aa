"""Where every parameter lives: one table row per parameter of a train state's layout, with the
mesh axes of its dimensions for the parameters, the gradients and the optimizer moments, and its
bytes on one device (``jaxpar inspect`` prints it).

Example::

    >>> import jax, optax
    >>> from flax import nnx
    >>> from jaxpar import Strategy, make_mesh, state_layout
    >>> from jaxpar.models._mlp import MLPClassifier
    >>> mesh = make_mesh({"data": 2, "tensor": 2}, devices=jax.devices()[:4])
    >>> model_fn = lambda: MLPClassifier(features=4, embed=8, mlp=8, classes=3, depth=1, rngs=nnx.Rngs(0))
    >>> layout = state_layout(model_fn, optax.adam(1e-3), mesh, Strategy(zero=1))
    >>> print(sharding_table(layout))
    parameter     | shape | logical          | params      | grads       | opt moments    | bytes/device
    --------------+-------+------------------+-------------+-------------+----------------+-------------
    down/0/bias   | 8     | (embed)          | (-)         | (-)         | (data)         |         32 B
    down/0/kernel | 8x8   | (mlp, embed)     | (tensor, -) | (tensor, -) | (tensor, data) |        128 B
    inp/bias      | 8     | (embed)          | (-)         | (-)         | (data)         |         32 B
    inp/kernel    | 4x8   | (-, embed)       | (-, -)      | (-, -)      | (-, data)      |        128 B
    out/bias      | 3     | (classes)        | (-)         | (-)         | (-)            |         12 B
    out/kernel    | 8x3   | (embed, classes) | (-, -)      | (-, -)      | (data, -)      |         96 B
    up/0/bias     | 8     | (mlp)            | (tensor)    | (tensor)    | (tensor)       |         16 B
    up/0/kernel   | 8x8   | (embed, mlp)     | (-, tensor) | (-, tensor) | (data, tensor) |        128 B
"""

from __future__ import annotations

import math
from typing import Any

import jax
from jax.sharding import PartitionSpec

from jaxpar.rules import path_str
from jaxpar._text import format_bytes, render_table


def spec_str(spec: Any, sizes: dict[str, int] | None = None) -> str:
    """A partition spec as ``(axis, axis, ...)``: ``-`` for a replicated dimension, ``a x b`` joined by ``x``.

    Args:
      spec: a ``PartitionSpec`` (or a tuple of its entries: ``None``, a name, or a tuple of names).
      sizes: mesh axis name -> size; given, axes of size 1 are left out (they split nothing), so a
        dimension split only over them shows ``-``.

    Returns:
      The text, e.g. ``(-, fsdp, tensor)`` or ``(dataxfsdp, -)``.

    Example:
      >>> spec_str(PartitionSpec(None, ("data", "fsdp"), "tensor"))
      '(-, dataxfsdp, tensor)'
      >>> spec_str(PartitionSpec(None, ("data", "fsdp"), "tensor"), {"data": 2, "fsdp": 1, "tensor": 1})
      '(-, data, -)'
    """
    def entry(d):
        axes = () if d is None else (d,) if isinstance(d, str) else tuple(d)
        axes = tuple(a for a in axes if sizes is None or sizes.get(a, 1) > 1)
        return "x".join(axes) or "-"
    return "(" + ", ".join(entry(d) for d in spec) + ")"


def sharding_table(layout: Any) -> str:
    """Per-parameter table: shape, logical names, mesh axes of parameters / gradients / optimizer
    moments (axes of size 1 left out: they split nothing), and the parameter's bytes on one device.

    Args:
      layout: a :class:`~jaxpar.StateLayout` (``jaxpar.state_layout`` or ``init_train_state``).

    Returns:
      The table as text (:func:`jaxpar.analysis._compiled_memory.render_table`), one row per parameter.
    """
    is_spec = lambda x: isinstance(x, PartitionSpec) or x is None   # noqa: E731
    flat = lambda t: [(path_str(p), v) for p, v in jax.tree_util.tree_flatten_with_path(t, is_leaf=is_spec)[0]]  # noqa: E731
    sizes = dict(layout.mesh.shape)
    logical, params = dict(flat(layout.logical)), dict(flat(layout.params))
    grads, opt = dict(flat(layout.grads)), dict(flat(layout.opt_param_specs))
    rows = []
    for name, a in flat(layout.shapes):
        spec = params.get(name) or PartitionSpec()
        pieces = math.prod(sizes[ax] for d in spec if d is not None for ax in ((d,) if isinstance(d, str) else d))
        rows.append([name, "x".join(map(str, a.shape)) or "()", spec_str(logical.get(name) or ()),
                     spec_str(spec, sizes), spec_str(grads.get(name) or (), sizes),
                     spec_str(opt.get(name) or (), sizes),
                     format_bytes(a.size * a.dtype.itemsize / pieces)])
    return render_table(["parameter", "shape", "logical", "params", "grads", "opt moments", "bytes/device"], rows,
                        right=[False] * 6 + [True])
