"""Logical axis rules: logical names -> mesh axes -> ``PartitionSpec`` pytrees.

Models name their dimensions with *logical* names (``batch``, ``embed``, ``mlp``,
``heads`` ...) or with the mesh's own axis names (``P("fsdp", "tensor")``, the style of JAX's
and Flax's sharding guides), or mix both. Rules are an ordered tuple of ``(logical, mesh_axis |
tuple_of_axes | None)`` pairs. A dimension's name is resolved in this order:

1. **A rule for the name.** The first rule that fits (its mesh axes are not already used by the
   spec and divide the dimension) wins; later rules for the same name are fallbacks. A user's
   rule (``Strategy.extra_rules``) therefore also overrides a mesh-axis name.
2. **A mesh axis.** A name no rule maps that is an axis of the mesh (or a tuple of mesh axes,
   ``("data", "fsdp")``) means that axis, as in a ``PartitionSpec``.
3. Otherwise it is an error: nothing is silently replicated.

Example::

    >>> import jax, jaxpar
    >>> rules = (("batch", ("data", "fsdp")), ("embed", None), ("mlp", "tensor"))
    >>> mesh = jax.sharding.AbstractMesh((2, 2, 2), ("data", "fsdp", "tensor"))
    >>> jaxpar.logical_to_spec(("embed", "mlp"), rules, mesh, shape=(16, 64))
    P(None, 'tensor')
    >>> jaxpar.logical_to_spec(("fsdp", "tensor"), rules, mesh, shape=(16, 64))   # mesh axes
    P('fsdp', 'tensor')
    >>> jaxpar.logical_to_spec((("data", "fsdp"), None), rules, mesh, shape=(16, 64))
    P(('data', 'fsdp'), None)
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from typing import Any, ContextManager, Iterator, Sequence

import jax
from jax.sharding import NamedSharding, PartitionSpec
from jaxpar.errors import RulesError

__all__ = ["LogicalRules", "RulesError", "logical_to_spec", "resolve", "named_shardings", "use_rules",
           "without_rules", "current_rules", "constrain", "path_str", "drop_axes", "axes_of", "spec_without",
           "manual_axes", "shard_map_mesh"]

LogicalRules = Sequence[tuple[str, "str | tuple[str, ...] | None"]]


def path_str(path: Sequence[Any]) -> str:
    """``jax.tree_util`` key path -> ``'blocks/attn/wq'``.

    Args:
      path: a key path.

    Returns:
      The path joined with ``/``.
    """
    return jax.tree_util.keystr(tuple(path), simple=True, separator="/")


def axes_of(entry) -> tuple[str, ...]:
    """One rule target or ``PartitionSpec`` entry (``None``, ``"data"``, ``("data", "fsdp")``) as a
    tuple of mesh axis names.

    Args:
      entry: a rule target or ``PartitionSpec`` entry.

    Returns:
      The mesh axis names.

    >>> axes_of(None), axes_of("data"), axes_of(["fsdp", "data"])
    ((), ('data',), ('fsdp', 'data'))
    """
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _targets(rules: LogicalRules, name: Any, sizes: dict[str, int]) -> tuple[list[tuple[str, ...]], bool]:
    """The candidate mesh axes of a dimension named ``name``, and whether they are the name's own
    mesh axes (no rule maps it)."""
    ruled = [axes_of(target) for logical, target in rules if logical == name]
    if ruled:
        return ruled, False
    axes = axes_of(name) if isinstance(name, (str, tuple, list)) else ()
    if axes and all(isinstance(a, str) and a in sizes for a in axes):
        return [axes], True
    return [], False


def logical_to_spec(logical: Sequence[str | None], rules: LogicalRules, mesh, *,
                    shape: Sequence[int] | None = None, what: str = "array") -> PartitionSpec:
    """Map one tuple of logical names to a ``PartitionSpec`` over ``mesh``.

    Args:
      logical: one logical name (or ``None``) per dimension.
      rules: the logical rules.
      mesh: the mesh (its axis sizes).
      shape: the array's shape, for the divisibility check (optional).
      what: the array's name in error messages (e.g. the parameter path).

    Returns:
      The ``PartitionSpec``.
    """
    sizes = dict(mesh.shape)
    logical = tuple(logical)
    if shape is not None and len(shape) != len(logical):
        raise RulesError(f"{what}: {len(logical)} logical names {logical} for an array of rank "
                         f"{len(shape)} (shape {tuple(shape)}); give one name (or None) per dimension.")
    used: dict[str, int] = {}
    out: list[Any] = []
    for dim, name in enumerate(logical):
        if name is None:
            out.append(None)
            continue
        candidates, own = _targets(rules, name, sizes)
        if not candidates:
            known = sorted({r[0] for r in rules}, key=str)
            raise RulesError(
                f"{what}: dimension {dim} has logical name {name!r}, which no rule maps and which is not "
                f"a mesh axis. Known logical names: {known}; mesh axes: {tuple(sizes)}. Add a rule such as "
                f"({name!r}, None) to replicate it or ({name!r}, 'tensor') to shard it.")
        if own:
            out.append(_own_axes(name, candidates[0], dim, used, sizes, shape, what))
            continue
        out.append(_first_fitting(name, candidates, dim, used, sizes, shape, what))
    return PartitionSpec(*out)


def _first_fitting(name: Any, candidates: list, dim: int, used: dict[str, int], sizes: dict[str, int],
                   shape: Sequence[int] | None, what: str) -> Any:
    """The first rule target of ``name`` that fits dimension ``dim`` (its axes recorded in ``used``),
    or an error that lists why none does."""
    problems = []
    for axes in candidates:
        unknown = [a for a in axes if a not in sizes]
        if unknown:
            raise RulesError(f"{what}: rule ({name!r}, {axes}) names mesh axes {unknown} that the mesh "
                             f"does not have; mesh axes are {tuple(sizes)}.")
        clash = [a for a in axes if a in used]
        if clash:
            problems.append(f"rule ({name!r}, {axes}) reuses mesh axis {clash[0]!r}, already used by "
                            f"dimension {used[clash[0]]}")
            continue
        total = math.prod(sizes[a] for a in axes)
        if shape is not None and shape[dim] % total:
            problems.append(f"rule ({name!r}, {axes}): dimension {dim} of size {shape[dim]} is not "
                            f"divisible by the mesh axes' total size {total} "
                            f"({', '.join(f'{a}={sizes[a]}' for a in axes)})")
            continue
        for a in axes:
            used[a] = dim
        return None if not axes else axes[0] if len(axes) == 1 else axes
    shape_txt = f" of shape {tuple(shape)}" if shape is not None else ""
    raise RulesError(
        f"{what}{shape_txt}: no rule fits logical name {name!r} (dimension {dim}): "
        + "; ".join(problems)
        + f". Fix: change the size to a multiple of the mesh axes, change the mesh, or add a "
          f"fallback rule after it such as ({name!r}, None).")


def _own_axes(name: Any, axes: tuple[str, ...], dim: int, used: dict[str, int], sizes: dict[str, int],
              shape: Sequence[int] | None, what: str) -> Any:
    """A dimension named by mesh axes: those axes, or an error that names the spec and the fix."""
    clash = [a for a in axes if a in used]
    if clash:
        raise RulesError(f"{what}: dimension {dim} names mesh axis {clash[0]!r}, which dimension "
                         f"{used[clash[0]]} already uses: a PartitionSpec may use a mesh axis once. Fix the "
                         "model's spec.")
    total = math.prod(sizes[a] for a in axes)
    if shape is not None and shape[dim] % total:
        raise RulesError(
            f"{what} of shape {tuple(shape)}: dimension {dim} is pinned to mesh axes {axes} "
            f"({', '.join(f'{a}={sizes[a]}' for a in axes)}), whose total size {total} does not divide "
            f"its size {shape[dim]}. Fix: a mesh whose {'/'.join(axes)} size divides {shape[dim]}, or a rule "
            f"(Strategy.extra_rules) such as ({name!r}, None) that overrides the model's spec.")
    for a in axes:
        used[a] = dim
    return axes[0] if len(axes) == 1 else axes


def _is_spec(x) -> bool:
    return isinstance(x, (PartitionSpec, tuple)) or x is None


def resolve(logical_tree: Any, rules: LogicalRules, mesh, shapes: Any = None) -> Any:
    """Resolve a pytree of logical specs (tuples or ``PartitionSpec`` of logical
    names) into a mirroring pytree of mesh ``PartitionSpec``s.

    ``shapes`` is an optional mirroring pytree of arrays / ``ShapeDtypeStruct``s
    used for divisibility checks and error messages.

    Args:
      logical_tree: a pytree of logical specs.
      rules: the logical rules.
      mesh: the mesh.
      shapes: a mirroring pytree of arrays or ``ShapeDtypeStruct``s, or ``None``.

    Returns:
      The mirroring pytree of ``PartitionSpec``s.
    """
    flat, treedef = jax.tree_util.tree_flatten_with_path(logical_tree, is_leaf=_is_spec)
    shape_leaves = [None] * len(flat) if shapes is None else treedef.flatten_up_to(shapes)
    specs = []
    for (path, logical), leaf in zip(flat, shape_leaves):
        logical = () if logical is None else tuple(logical)
        shape = getattr(leaf, "shape", None)
        if shape is not None and not logical:
            logical = (None,) * len(shape)
        specs.append(logical_to_spec(logical, rules, mesh, shape=shape, what=f"parameter {path_str(path)!r}"))
    return jax.tree_util.tree_unflatten(treedef, specs)


def named_shardings(spec_tree: Any, mesh) -> Any:
    """A pytree of ``PartitionSpec`` -> the same tree of ``NamedSharding`` on ``mesh``.

    Args:
      spec_tree: a pytree of ``PartitionSpec``s.
      mesh: the mesh.

    Returns:
      The mirroring pytree of ``NamedSharding``s.
    """
    return jax.tree.map(lambda s: NamedSharding(mesh, s), spec_tree,
                        is_leaf=lambda x: isinstance(x, PartitionSpec))


@contextlib.contextmanager
def scoped_kernel(var: contextvars.ContextVar, value: Any) -> Iterator[Any]:
    """:func:`scoped` for a setting that changes what a function traces to (a kernel's choice): JAX's caches are
    cleared on the way in and out when ``value`` is not the current one, so a traced program does not keep the
    other setting's kernel.

    Args:
      var: the context variable to set.
      value: its value inside the block.

    Yields:
      ``value``.
    """
    changed = value != var.get()
    if changed:
        jax.clear_caches()
    try:
        with scoped(var, value):
            yield value
    finally:
        if changed:
            jax.clear_caches()


@contextlib.contextmanager
def scoped(var: contextvars.ContextVar, value: Any) -> Iterator[Any]:
    """Set the context variable ``var`` to ``value`` inside the block, and back to what it was after.

    Args:
      var: the context variable to set.
      value: its value inside the block.

    Yields:
      ``value``.
    """
    token = var.set(value)
    try:
        yield value
    finally:
        var.reset(token)


_RULES: contextvars.ContextVar = contextvars.ContextVar("jaxpar_rules", default=None)


def use_rules(mesh, rules: LogicalRules) -> ContextManager[None]:
    """Make ``(mesh, rules)`` the context for :func:`constrain` (activation sharding).

    Args:
      mesh: the mesh.
      rules: the logical rules.

    Returns:
      A context manager.

    >>> import jax, jax.numpy as jnp, jaxpar
    >>> mesh = jaxpar.make_mesh({"data": 2}, devices=jax.devices()[:2])
    >>> rules = (("batch", "data"), ("embed", None))
    >>> with use_rules(mesh, rules):
    ...     y = jax.jit(lambda x: constrain(2 * x, ("batch", "embed")))(jnp.ones((4, 3)))
    >>> y.sharding.spec                         # the batch split over ``data``
    P('data',)
    >>> current_rules() is None                 # only inside the ``with`` block
    True
    """
    return scoped(_RULES, (mesh, tuple(rules)))


def without_rules() -> ContextManager[None]:
    """No rules in this context: :func:`constrain` leaves activations alone (e.g. to compile
    one layer on its own, away from the mesh).

    >>> with without_rules():
    ...     current_rules() is None
    True
    """
    return scoped(_RULES, None)


def current_rules():
    """The ``(mesh, rules)`` pair set by :func:`use_rules`, or ``None``."""
    return _RULES.get()


def constrain(x: jax.Array, logical: Sequence[str | None]) -> jax.Array:
    """Constrain an activation's sharding by logical names.

    Outside :func:`use_rules` this returns ``x`` unchanged, deliberately (like Flax's
    ``nn.with_logical_constraint`` without rules): the same model code runs on one
    device, in a notebook or under any jaxpar strategy, which installs the rules.

    Args:
      x: the activation.
      logical: one logical name (or ``None``) per dimension of ``x``.

    Returns:
      ``x`` with a sharding constraint (or ``x`` itself, outside :func:`use_rules`).

    >>> import jax.numpy as jnp
    >>> constrain(jnp.ones((2, 3)), ("batch", "embed")).shape
    (2, 3)
    """
    ctx = _RULES.get()
    if ctx is None:
        return x
    mesh, rules = ctx
    return constrain_spec(x, logical_to_spec(logical, rules, mesh, shape=x.shape, what=f"activation {tuple(logical)}"))


def constrain_spec(x: jax.Array, spec: PartitionSpec) -> jax.Array:
    """Constrain ``x`` to ``spec`` over the mesh of :func:`use_rules` (inside a ``shard_map``: its
    mesh, less the axes it made manual).

    Args:
      x: the array.
      spec: its ``PartitionSpec``.

    Returns:
      ``x`` with a sharding constraint.
    """
    mesh = _RULES.get()[0]
    inner = jax.sharding.get_abstract_mesh()      # inside a shard_map: its mesh, with the manual axes
    if not inner.manual_axes:
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
    # a mesh-axis name of a manual axis: that axis is split already
    return jax.lax.with_sharding_constraint(x, NamedSharding(inner, spec_without(spec, inner.manual_axes)))


def spec_without(spec: PartitionSpec, axes) -> PartitionSpec:
    """``spec`` with the mesh axes ``axes`` removed from every entry.

    Args:
      spec: the ``PartitionSpec``.
      axes: the mesh axes to remove.

    Returns:
      The ``PartitionSpec``, one entry per entry of ``spec``.

    >>> spec_without(PartitionSpec(("data", "fsdp"), "pipe", None), {"fsdp", "pipe"})
    P('data', None, None)
    """
    kept = [tuple(a for a in axes_of(e) if a not in axes) for e in spec]
    return PartitionSpec(*(None if not k else k[0] if len(k) == 1 else k for k in kept))


def drop_axes(rules: LogicalRules, axes: Sequence[str]) -> tuple:
    """The same rules with ``axes`` removed from every target (for code that runs
    manual over those axes inside ``shard_map``).

    Args:
      rules: the logical rules.
      axes: the mesh axes to remove.

    Returns:
      The rules, as a tuple of pairs.
    """
    out = []
    for logical, target in rules:
        t = tuple(a for a in axes_of(target) if a not in axes)
        out.append((logical, t if len(t) > 1 else t[0] if t else None))
    return tuple(out)


def manual_axes() -> set:
    """The mesh axes a ``shard_map`` around the current trace has made manual (none outside one).

    >>> manual_axes()
    set()
    """
    return set(jax.sharding.get_abstract_mesh().manual_axes)


def shard_map_mesh(mesh):
    """The mesh a ``shard_map`` opened here takes: ``mesh``, or, nested in another ``shard_map``
    (a pipeline stage), that region's abstract mesh with its manual axes.

    Args:
      mesh: the concrete mesh.

    Returns:
      The mesh (concrete or abstract) to pass to ``shard_map``.
    """
    inner = jax.sharding.get_abstract_mesh()
    return inner if inner.manual_axes else mesh
