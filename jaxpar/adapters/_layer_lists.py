"""Layers kept as a Python list (``nnx.List``), stacked so that jaxpar can scan and pipeline them.

Flax's current examples keep a model's blocks in an ``nnx.List`` and run them with a Python
loop (``for block in self.blocks: x = block(x)``). :func:`stack_layers` replaces every such list
whose layers are *alike* (same structure, same settings, same parameter shapes, only
``nnx.Param`` state) by a :class:`StackedLayers` module: one copy of the layer whose parameters
have a leading ``layers`` axis (the logical name prepended to each parameter's annotation, as
``nnx.vmap(..., transform_metadata={nnx.PARTITION_NAME: "layers"})`` does). The model's own loop
runs unchanged: iterating a :class:`StackedLayers` yields one stand-in per layer, and the last
stand-in's call runs all the layers at once through :func:`jaxpar.scan_blocks`, so a pipeline can
cut the model there and a scan compiles one layer. The loop must be a chain: each layer called
once, in order, on the previous layer's output, with the same other arguments; anything else is
a :class:`LayerListError` that says what differed. Lists whose layers differ stay lists.

:func:`list_form` and :func:`stacked_form` convert a parameter tree (or any tree that mirrors it,
such as Adam's moments) between the two layouts, for export and checkpoints.

Example::

    >>> import jax, jax.numpy as jnp
    >>> from flax import nnx
    >>> class Net(nnx.Module):
    ...     def __init__(self, rngs):
    ...         self.blocks = nnx.List([nnx.Linear(4, 4, rngs=rngs) for _ in range(3)])
    ...     def __call__(self, x):
    ...         for block in self.blocks:
    ...             x = jnp.tanh(block(x))   # not a chain: the tanh sits between the layers
    ...         return x
    >>> class Chain(Net):
    ...     def __call__(self, x):
    ...         for block in self.blocks:
    ...             x = block(x)
    ...         return x
    >>> model = Chain(nnx.Rngs(0))
    >>> x = jnp.ones((2, 4))
    >>> want = model(x)
    >>> stacked = stack_layers(model)
    >>> stacked.blocks.count, nnx.state(stacked, nnx.Param)["blocks"]["layer"]["kernel"].shape
    (3, (3, 4, 4))
    >>> bool(jnp.allclose(stacked(x), want, atol=1e-6))
    True
    >>> params = nnx.to_pure_dict(nnx.state(stacked, nnx.Param))
    >>> sorted(list_form(params, {("blocks",): 3})["blocks"])         # the list's own paths again
    [0, 1, 2]
    >>> stack_layers(Net(nnx.Rngs(0)))(x)
    Traceback (most recent call last):
    ...
    jaxpar.errors.LayerListError: stacked layers at 'blocks': the output of layer 0 is used outside the chain x = block(x) (e.g. changed before the next layer, or kept for a skip connection); ...
"""

from __future__ import annotations

import enum
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar.adapters._blocks import LAYERS, scan_blocks
from jaxpar.errors import LayerListError


def _statics(module: nnx.Module) -> dict[str, Any]:
    """A module's static settings (numbers, strings, flags, enum members) by path."""
    out = {}
    for path, node in nnx.iter_graph(module):
        if isinstance(node, nnx.Module):
            for k, v in vars(node).items():
                if isinstance(v, (int, float, str, bool, type(None), enum.Enum)) and not k.startswith("_"):
                    out["/".join(map(str, (*path, k)))] = v
    return out


def layer_differences(layers: list) -> list[str]:
    """How each layer differs from the first, in words (empty: they are alike and can be stacked).

    Args:
      layers: the modules of an ``nnx.List``.

    Returns:
      One line per differing layer: its first differing setting (``attn/window: 4 vs None``), or
      ``other parameter shapes``, ``other structure`` or ``non-Param state``.

    >>> layer_differences([nnx.Linear(4, 4, rngs=nnx.Rngs(0)), nnx.Linear(4, 8, rngs=nnx.Rngs(0))])
    ['layer 1: out_features: 8 vs 4']
    """
    first, differ = layers[0], []
    shapes = jax.tree.map(jnp.shape, nnx.state(first, nnx.Param))
    for i, layer in enumerate(layers):
        a, b = _statics(first), _statics(layer)
        keys = [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
        if keys:
            differ.append(f"layer {i}: {keys[0]}: {b.get(keys[0])!r} vs {a.get(keys[0])!r}")
        elif jax.tree.leaves(nnx.state(layer, nnx.Not(nnx.Param))):
            differ.append(f"layer {i}: non-Param state")
        elif i and nnx.graphdef(layer) != nnx.graphdef(first):
            differ.append(f"layer {i}: other structure")
        elif i and jax.tree.map(jnp.shape, nnx.state(layer, nnx.Param)) != shapes:
            differ.append(f"layer {i}: other parameter shapes")
    return differ


def _stack_states(layers: list) -> nnx.Module:
    """One layer whose parameters are the layers' parameters stacked on a new ``layers`` axis 0."""
    graphdef = nnx.graphdef(layers[0])
    states = [nnx.state(layer, nnx.Param) for layer in layers]
    stacked = jax.tree.map(lambda *vs: jnp.stack(vs), *states)

    def annotate(v):
        spec = v.get_metadata().get("out_sharding")
        v.set_metadata(out_sharding=(LAYERS, *(spec if spec else (None,) * (v.ndim - 1))))
        return v

    stacked = jax.tree.map(annotate, stacked, is_leaf=lambda v: isinstance(v, nnx.Variable))
    return nnx.merge(graphdef, stacked)


class _Pending:
    """What a stand-in returns for the layers before the last: the chain's place holder. Any use of it
    (arithmetic, a ``jnp`` function, an attribute) raises a :class:`LayerListError`."""

    __slots__ = ("_where", "_index")

    def __init__(self, where: str, index: int):
        self._where, self._index = where, index

    def _misuse(self, *_) -> LayerListError:
        raise LayerListError(
            f"stacked layers at {self._where!r}: the output of layer {self._index} is used outside the chain "
            "x = block(x) (e.g. changed before the next layer, or kept for a skip connection); jaxpar computes "
            "stacked layers' outputs only at the end of the chain. Do that work inside the layer, or keep the list "
            "unstacked (do not call jaxpar.stack_layers, and use no 'pipe' axis).")

    def __getattr__(self, name):
        self._misuse()

    def __repr__(self) -> str:
        return f"<output of stacked layer {self._index} at {self._where!r}>"


for _op in ("add", "radd", "sub", "rsub", "mul", "rmul", "truediv", "rtruediv", "matmul", "rmatmul", "pow", "neg",
            "getitem", "iter", "len", "bool", "float", "int", "index", "array", "abs", "lt", "le", "gt", "ge"):
    setattr(_Pending, f"__{_op}__", _Pending._misuse)


class _Chain:
    """One pass of the model's loop over a :class:`StackedLayers`: checks it is a chain, then scans."""

    def __init__(self, stack: "StackedLayers"):
        self.stack, self.next, self.pending = stack, 0, None
        self.first: tuple | None = None

    def _fail(self, what: str) -> LayerListError:
        return LayerListError(
            f"stacked layers at {self.stack.where!r}: {what}; jaxpar runs stacked layers as a chain x = block(x). "
            "Do that work inside the layer, or keep the list unstacked (do not call jaxpar.stack_layers, and use "
            "no 'pipe' axis).")

    def call(self, index: int, x: Any, args: tuple, kwargs: dict) -> Any:
        if index != self.next:
            raise self._fail(f"layer {index} is called after layer {self.next - 1} (each layer once, in order)")
        if index == 0:
            self.first = (x, args, kwargs)
        elif x is not self.pending:
            raise self._fail(f"layer {index}'s input is not layer {index - 1}'s output (the model changes it "
                             "between layers, e.g. x = f(block(x)))")
        elif not _same_arguments((args, kwargs), self.first[1:]):
            raise self._fail(f"layer {index} gets other arguments besides x than layer 0 (per-layer arguments)")
        self.next += 1
        if index < self.stack.count - 1:
            self.pending = _Pending(self.stack.where, index)
            return self.pending
        x0, args, kwargs = self.first
        return scan_blocks(self.stack.layer, x0, layer_args=args, layer_kwargs=kwargs)


def _same_arguments(a: Any, b: Any) -> bool:
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    plain = (int, float, str, bool, type(None))
    return ta == tb and all(x is y or (isinstance(x, plain) and type(x) is type(y) and x == y) for x, y in zip(la, lb))


class _Layer:
    """The stand-in for one layer of a :class:`StackedLayers` during one pass of the model's loop."""

    def __init__(self, chain: _Chain, index: int):
        self._chain, self._index = chain, index

    def __call__(self, x, *args, **kwargs):
        return self._chain.call(self._index, x, args, kwargs)


class StackedLayers(nnx.Module):
    """An ``nnx.List`` of alike layers, stacked (see the module docstring).

    Args:
      layer: one layer whose parameters have the leading ``layers`` axis.
      count: the number of layers.
      where: the list's path in the model, for messages.
    """

    def __init__(self, layer: nnx.Module, count: int, where: str):
        self.layer, self.count, self.where = layer, count, where

    def __len__(self) -> int:
        return self.count

    def __iter__(self):
        chain = _Chain(self)
        return iter([_Layer(chain, i) for i in range(self.count)])

    def __getitem__(self, index):
        raise LayerListError(
            f"stacked layers at {self.where!r}: the model indexes the list ([{index!r}]); stacked layers are run "
            "only by a loop over all of them (for block in self.blocks: x = block(x)). Keep the list unstacked for "
            "such a model (no jaxpar.stack_layers, no 'pipe' axis).")


def stacked_lists(model: nnx.Module) -> dict[tuple, int]:
    """The ``nnx.List`` s of alike layers that :func:`stack_layers` would stack: ``{path: count}``.

    Args:
      model: an NNX model.

    Returns:
      Each stackable list's path and length.

    >>> class Net(nnx.Module):
    ...     def __init__(self, rngs):
    ...         self.blocks = nnx.List([nnx.Linear(2, 2, rngs=rngs) for _ in range(4)])
    >>> stacked_lists(Net(nnx.Rngs(0)))
    {('blocks',): 4}
    """
    return {tuple(path): len(node) for path, node in nnx.iter_graph(model)
            if isinstance(node, nnx.List) and len(node) > 1 and all(isinstance(m, nnx.Module) for m in node)
            and not layer_differences(list(node))}


def stack_layers(model: nnx.Module) -> nnx.Module:
    """Replace each ``nnx.List`` of alike layers in ``model`` by a :class:`StackedLayers` (in place).

    Args:
      model: an NNX model (concrete, or under ``nnx.eval_shape``).

    Returns:
      The same model object, its alike lists stacked; lists whose layers differ are left as they are.
    """
    for path, count in stacked_lists(model).items():
        parent = model
        for key in path[:-1]:
            parent = parent[key] if isinstance(parent, nnx.List) else getattr(parent, key)
        layers = list(parent[path[-1]] if isinstance(parent, nnx.List) else getattr(parent, path[-1]))
        stacked = StackedLayers(_stack_states(layers), count, "/".join(map(str, path)))
        if isinstance(parent, nnx.List):
            parent[path[-1]] = stacked
        else:
            setattr(parent, path[-1], stacked)
    return model


def stacked_counts(model_fn: Callable[[], nnx.Module]) -> dict[tuple, int]:
    """``{path: count}`` of the :class:`StackedLayers` in the model ``model_fn()`` builds (traced only).

    Args:
      model_fn: builds the model (an abstract model, ``nnx.eval_shape``'s, is read as it is).

    Returns:
      Each stacked list's path and layer count.

    >>> class Net(nnx.Module):
    ...     def __init__(self, rngs):
    ...         self.blocks = nnx.List([nnx.Linear(2, 2, rngs=rngs) for _ in range(4)])
    >>> stacked_counts(lambda: stack_layers(Net(nnx.Rngs(0))))
    {('blocks',): 4}
    """
    model = model_fn
    if not isinstance(model_fn, nnx.Module):
        with nnx.use_eager_sharding(False):
            model = nnx.eval_shape(model_fn)
    return {tuple(path): node.count for path, node in nnx.iter_graph(model) if isinstance(node, StackedLayers)}


def _convert(tree: Any, lists: dict[tuple, int], convert: Callable[[Any, int], Any], key) -> Any:
    """``tree`` with the subtree at each list path (wherever it sits, e.g. under Adam's ``mu``) converted."""
    def walk(node, path):
        if isinstance(node, dict):
            if path in lists and key(node):
                return convert(node, lists[path])
            return {k: walk(v, path + (k,)) for k, v in node.items()}
        if isinstance(node, (list, tuple)):            # optax states are (named) tuples: paths start again below
            items = [walk(v, ()) for v in node]
            return type(node)(*items) if hasattr(node, "_fields") else type(node)(items)
        return node
    return walk(tree, ())


def _respec(sharding: Any, spec: Callable[[tuple], tuple]) -> Any:
    """A ``NamedSharding`` with its spec's entries changed by ``spec`` (any other sharding as it is)."""
    if isinstance(sharding, NamedSharding):
        return NamedSharding(sharding.mesh, PartitionSpec(*spec(tuple(sharding.spec))))
    return sharding


def _layer(a: Any, i: int) -> Any:
    """Layer ``i`` of a stacked leaf (an array, or a ``ShapeDtypeStruct`` whose sharding drops axis 0)."""
    if isinstance(a, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(a.shape[1:], a.dtype, sharding=_respec(a.sharding, lambda spec: spec[1:]))
    return a[i]


def _stack(*leaves: Any) -> Any:
    """The layers' leaves stacked on a new axis 0 (``ShapeDtypeStruct`` s: that axis unsharded)."""
    a = leaves[0]
    if isinstance(a, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct((len(leaves), *a.shape), a.dtype,
                                    sharding=_respec(a.sharding, lambda spec: (None, *spec)))
    return jnp.stack(leaves)


def list_form(tree: Any, lists: dict[tuple, int]) -> Any:
    """``tree`` with each stacked list ``{"layer": {...}}`` (leading axis ``count``) back as ``{0: ..., 1: ...}``.

    Args:
      tree: a pure-dict parameter tree of a stacked model, or a tree holding such trees (optimizer
        state); arrays, or ``ShapeDtypeStruct`` s (their shardings lose the ``layers`` entry).
      lists: ``{path: count}`` of the stacked lists (``StateLayout.layer_lists``).

    Returns:
      The same tree in the list's own layout.
    """
    return _convert(tree, lists, lambda node, n: {i: jax.tree.map(lambda a: _layer(a, i), node["layer"])
                                                  for i in range(n)},
                    key=lambda node: set(node) == {"layer"})


def stacked_form(tree: Any, lists: dict[tuple, int]) -> Any:
    """Inverse of :func:`list_form`: ``{0: ..., 1: ...}`` stacked into ``{"layer": {...}}``.

    Args:
      tree: a pure-dict parameter tree (or a tree holding such trees) with the lists as lists.
      lists: ``{path: count}`` of the lists to stack.

    Returns:
      The tree with those lists stacked.

    >>> stacked_form({"blocks": {0: {"w": jnp.zeros(2)}, 1: {"w": jnp.ones(2)}}}, {("blocks",): 2})["blocks"]["layer"]["w"].shape
    (2, 2)
    """
    return _convert(tree, lists, lambda node, n: {"layer": jax.tree.map(_stack, *[node[i] for i in range(n)])},
                    key=lambda node: set(node) == set(range(len(node))) and len(node) > 0)


def change_form(tree: Any, have: dict[tuple, int], want: dict[tuple, int]) -> Any:
    """``tree`` with the lists stacked in ``have`` made lists again and those in ``want`` stacked.

    Args:
      tree: a pure-dict parameter tree (or a tree holding such trees).
      have: ``{path: count}`` of the lists stacked in ``tree``.
      want: ``{path: count}`` of the lists to have stacked.

    Returns:
      The tree in the ``want`` form.

    >>> tree = {"blocks": {"layer": {"w": jnp.zeros((3, 2))}}}
    >>> sorted(change_form(tree, {("blocks",): 3}, {})["blocks"])
    [0, 1, 2]
    """
    return stacked_form(list_form(tree, {p: n for p, n in have.items() if p not in want}),
                        {p: n for p, n in want.items() if p not in have})
