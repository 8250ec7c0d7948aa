"""Muon (Jordan et al. 2024) on the matrices, AdamW on the rest: the parameters routed by their logical names
(:func:`muon_routes`), the two halves joined by ``optax.partition``, the matrices' Newton-Schulz placed on
the mesh (:mod:`jaxpar.parallel._muon_placement`; docs/muon.md).
"""
from __future__ import annotations

import math
import re
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec

from jaxpar.errors import MaskError, OptimizerError, check_int
from jaxpar.logical import FEATURES, PLACEMENTS, STACKS, matrix_sides
from jaxpar.mesh import CONTEXT, EXPERT, REPLICA, STANDARD_AXES
from jaxpar.optimizers._large_batch import logical_by_path, paths_matching
from jaxpar.optimizers._ranges import check_hyperparameters
from jaxpar.parallel._muon_placement import Chooser, MuonPlacement, place, placed_newton_schulz
from jaxpar.rules import path_str

#: Where Newton-Schulz runs on a sharded matrix (:func:`muon`'s ``placement``; docs/muon.md).
MUON_PLACEMENTS = PLACEMENTS
#: Which side of a weight comes first (:func:`muon_routes`' ``kernel_layout``): input (Flax) or output (PyTorch).
MUON_KERNEL_LAYOUTS = ("in_out", "out_in")
#: Mesh-axis names: an annotation that holds one is a mesh-axis ``PartitionSpec``, not logical names.
_MESH_NAMES = STANDARD_AXES + (REPLICA, CONTEXT, EXPERT)
#: The AdamW half's options (:func:`muon`'s ``adam=``) and their defaults (``lr`` None: Muon's).
MUON_ADAM_DEFAULTS = {"lr": None, "b1": 0.9, "b2": 0.95, "eps": 1e-8, "weight_decay": 0.0}


class MuonRoute(NamedTuple):
    """How :func:`muon` treats one parameter (a row of :func:`muon_routing_table`).

    Attributes:
      rule: ``"muon"`` or ``"adam"``.
      reduction: the axes of the matrix's input side (Muon only; ``()`` for Adam).
      output: the axes of its output side.
      batch: the stacked axes (one Newton-Schulz per index).
      why: the reason, in words.
    """

    rule: str
    reduction: tuple[int, ...]
    output: tuple[int, ...]
    batch: tuple[int, ...]
    why: str


def _forced_muon(path: str, names: tuple, ndim: int) -> MuonRoute:
    """``routing=`` says Muon: the two non-stacked axes (the last two without names) are the matrix."""
    if not any(n is not None for n in names):
        if ndim < 2:
            raise OptimizerError(f"muon(routing=...): parameter {path!r} has rank {ndim}; Muon needs a matrix. "
                                 "Route it to 'adam'.")
        return MuonRoute("muon", (ndim - 2,), (ndim - 1,), tuple(range(ndim - 2)), "routing=: the last two axes")
    free = [i for i, n in enumerate(names) if n not in STACKS]
    if len(free) != 2:
        raise OptimizerError(f"muon(routing=...): parameter {path!r} with logical names {names} has {len(free)} "
                             "non-stacked axes; Muon needs exactly two (a matrix). Route it to 'adam'.")
    return MuonRoute("muon", (free[0],), (free[1],), tuple(i for i in range(ndim) if i not in free),
                     "routing=: its two non-stacked axes")


def _forced(path: str, routing: dict[str, str]) -> str | None:
    hits = {rule for pattern, rule in routing.items() if re.search(pattern, path)}
    if len(hits) > 1:
        raise OptimizerError(f"muon(routing=...): parameter {path!r} matches patterns routing it to both 'muon' "
                             "and 'adam'; make the patterns disjoint.")
    return hits.pop() if hits else None


def _check_routing(routing: dict[str, str], paths: Sequence[str]) -> None:
    """Each rule is ``muon`` or ``adam`` and each pattern a regex; with ``paths``, each pattern matches one.

    A tree without leaves (optax's placeholder: ``optax.tree_map_params`` calls ``tx.init`` on it, as
    :func:`jaxpar.init_train_state` does for the state's specs) has nothing to match; the real parameters
    (``tx.init(params)``, ``jax.eval_shape(tx.init, shapes)``) are checked.
    """
    for pattern, rule in routing.items():
        if rule not in ("muon", "adam"):
            raise OptimizerError(f"muon(routing={{{pattern!r}: {rule!r}}}): a rule is 'muon' or 'adam'.")
        try:
            re.compile(pattern)
        except (re.error, TypeError) as e:
            raise OptimizerError(f"muon(routing={{{pattern!r}: {rule!r}}}): {pattern!r} is not a valid regular "
                                 f"expression ({e}).") from None
    if not paths:
        return
    try:
        paths_matching(list(routing), list(paths), "muon(routing=...)")
    except MaskError as e:
        raise OptimizerError(str(e)) from None


def _route_one(path: str, own: tuple, shape: tuple, routing: dict[str, str]) -> MuonRoute:
    """One parameter's route from its logical names ``own`` (``()``: none) and the ``routing`` overrides."""
    ndim = len(shape)
    forced = _forced(path, routing)
    if forced == "adam":
        return MuonRoute("adam", (), (), (), "routing=")
    if own and len(own) != ndim:
        raise OptimizerError(f"muon: parameter {path!r} of shape {tuple(shape)} has logical names {own}; give one "
                             "name per axis, or none.")
    own = own or (None,) * ndim
    if forced == "muon":
        return _forced_muon(path, own, ndim)
    if ndim < 2 and all(n is None for n in own):
        return MuonRoute("adam", (), (), (), f"no logical names, rank {ndim} (bias / scale)")
    unnamed = sum(n is None for n in own) >= 2 and all(n is None or n in STACKS for n in own)
    if unnamed or any(n in _MESH_NAMES for n in own):
        raise _unnamed_error(path, own, tuple(shape))
    reduction, output, batch, why = matrix_sides(own)      # the rule from the logical names alone
    return MuonRoute("muon" if reduction else "adam", reduction, output, batch, why)


def _routes(params: Any, logical: Any, routing: dict[str, str], kernel_layout: str) -> dict[str, MuonRoute]:
    names = logical_by_path(logical) if logical is not None else {}
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    missing = [path_str(p) for p, _ in flat if logical is not None and path_str(p) not in names]
    if missing:
        raise OptimizerError(f"muon(logical=...): no logical names for parameter {missing[0]!r}; give a tree of "
                             "logical names that mirrors the params (abstract_model(model_fn)[2] or StateLayout.logical).")
    routes = {path_str(p): _route_one(path_str(p), names.get(path_str(p), ()), leaf.shape, routing) for p, leaf in flat}
    if kernel_layout == "out_in":               # the first feature group is the output side
        routes = {k: r._replace(reduction=r.output, output=r.reduction) for k, r in routes.items()}
    return routes


def muon_routes(params: Any, logical: Any = None, *, routing: dict[str, str] | None = None,
                kernel_layout: str = "in_out") -> dict[str, MuonRoute]:
    """``{path: MuonRoute}``: each parameter's rule, matrix axes and batch axes (:func:`muon_routing`).

    A parameter without logical names (``P()`` in ``StateLayout.logical``: an ``nnx.Linear`` bias without
    ``nnx.with_partitioning``) of rank 0 or 1 goes to AdamW; one of rank >= 2 goes where ``routing`` says.

    Args:
      params: the parameters (arrays or ``ShapeDtypeStruct``s).
      logical: a mirroring tree of logical names (``StateLayout.logical``, ``abstract_model(model_fn)[2]``).
      routing: ``{path regex: "muon" | "adam"}`` overriding the names (searched in ``'blocks/wq'``).
      kernel_layout: which feature group comes first in a weight (:data:`MUON_KERNEL_LAYOUTS`): ``in_out``
        (Flax's kernels, jaxpar's GPT: the input side first) or ``out_in`` (PyTorch / Hugging Face weights,
        jaxpar's ``Decoder``). It sets the shape scaling's fan-in and fan-out.

    Returns:
      Parameter path -> :class:`MuonRoute`.

    Raises:
      OptimizerError: a parameter of rank >= 2 without logical feature names (or with mesh-axis names)
        that ``routing`` does not route (naming its path and shape), names of another length than its
        rank, or a ``routing`` pattern that matches no parameter (checked on a tree with leaves).
    """
    _check_kernel_layout(kernel_layout)
    routing = dict(routing or {})
    _check_routing(routing, [path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]])
    return _routes(params, logical, routing, kernel_layout)


def _check_kernel_layout(kernel_layout: str) -> None:
    if kernel_layout not in MUON_KERNEL_LAYOUTS:
        raise OptimizerError(f"muon(kernel_layout={kernel_layout!r}): choose one of {', '.join(MUON_KERNEL_LAYOUTS)} "
                             "(in_out: Flax kernels [in, out]; out_in: PyTorch / Hugging Face weights [out, in]).")


def _unnamed_error(path: str, names: tuple, shape: tuple) -> OptimizerError:
    mesh = [n for n in names if n in _MESH_NAMES]
    what = f"mesh-axis names {mesh}, not logical names" if mesh else \
        "no logical names" if all(n is None for n in names) else f"logical names {names} without a feature name"
    return OptimizerError(
        f"muon: parameter {path!r} of shape {shape} has {what}; without feature names ({', '.join(FEATURES)}) "
        "whether it is a matrix is unknown (Muon never guesses from shapes). Annotate the model with logical names "
        "(nnx.with_partitioning(init, ('embed', 'mlp'))) and pass logical=abstract_model(model_fn)[2], or route it "
        "explicitly: muon(..., routing={'<path regex>': 'muon' | 'adam'}).")


def muon_routing(params: Any, logical: Any = None, *, routing: dict[str, str] | None = None) -> dict[str, str]:
    """``{path: "muon" | "adam"}``: which half of :func:`muon` updates each parameter.

    A parameter is a matrix (Muon) when its feature axes (:data:`FEATURES`) form exactly two groups
    and every other axis is stacked (:data:`STACKS`: ``layers``, ``experts``, unnamed sub-layer axes):
    ``wq [layers, embed, heads, kv]`` is ``embed x heads*kv``, one Newton-Schulz per layer. The embedding
    and head (``vocab``), norms, biases and the router (one feature axis) go to AdamW.

    Args:
      params: the parameters (arrays or ``ShapeDtypeStruct``s).
      logical: a mirroring tree of logical names.
      routing: ``{path regex: "muon" | "adam"}`` overriding the names.

    Returns:
      Parameter path -> rule.

    >>> import jax.numpy as jnp
    >>> p = {"wte": jnp.ones((64, 8)), "wq": jnp.ones((2, 8, 2, 4)), "ln": jnp.ones((2, 8))}
    >>> muon_routing(p, {"wte": ("vocab", "embed"), "wq": ("layers", "embed", "heads", "kv"), "ln": ("layers", "embed")})
    {'ln': 'adam', 'wq': 'muon', 'wte': 'adam'}
    """
    return {path: r.rule for path, r in muon_routes(params, logical, routing=routing).items()}


def muon_routing_table(params: Any, logical: Any = None, *, routing: dict[str, str] | None = None,
                       kernel_layout: str = "in_out") -> str:
    """:func:`muon_routing` as text, one line per parameter: rule, matrix (input x output) and batch dims.

    Args:
      params: the parameters (arrays or ``ShapeDtypeStruct``s).
      logical: a mirroring tree of logical names.
      routing: ``{path regex: "muon" | "adam"}`` overriding the names.
      kernel_layout: ``in_out`` or ``out_in`` (:func:`muon_routes`).

    Returns:
      The table.

    >>> import jax.numpy as jnp
    >>> print(muon_routing_table({"wq": jnp.ones((2, 8, 2, 4))}, {"wq": ("layers", "embed", "heads", "kv")}))
    wq  muon  embed(8) x heads*kv(8)  batch layers(2)  matrix
    """
    names = logical_by_path(logical) if logical is not None else {}
    shapes = {path_str(p): leaf.shape for p, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}
    routes = muon_routes(params, logical, routing=routing, kernel_layout=kernel_layout)
    width = max(map(len, routes), default=0)

    def side(path, axes):
        own = names.get(path) or (None,) * len(shapes[path])
        label = "*".join(str(own[i]) if own[i] is not None else f"axis{i}" for i in axes)
        return f"{label}({math.prod(shapes[path][i] for i in axes)})"

    lines = []
    for path, r in routes.items():
        matrix = f"{side(path, r.reduction)} x {side(path, r.output)}" if r.rule == "muon" else "-"
        batch = " ".join(side(path, (i,)) for i in r.batch) if r.rule == "muon" and r.batch else "-"
        lines.append(f"{path:<{width}}  {r.rule}  {matrix}  batch {batch}  {r.why}")
    return "\n".join(lines)


def _checked_options(learning_rate, momentum, weight_decay, ns_steps, consistent_rms, adam) -> dict:
    """:func:`muon`'s options checked by name; the AdamW half's options."""
    check_hyperparameters("muon", learning_rate=learning_rate, momentum=momentum, weight_decay=weight_decay)
    check_int("muon", "ns_steps", ns_steps, 1, OptimizerError)
    if consistent_rms is not None:
        check_hyperparameters("muon(consistent_rms=...)", learning_rate=consistent_rms)
    options = {**MUON_ADAM_DEFAULTS, **(adam or {})}
    if unknown := sorted(set(options) - set(MUON_ADAM_DEFAULTS)):
        raise OptimizerError(f"muon(adam={{{unknown[0]!r}: ...}}): unknown option; the AdamW half takes "
                             f"{', '.join(MUON_ADAM_DEFAULTS)}.")
    options["lr"] = learning_rate if options["lr"] is None else options["lr"]
    check_hyperparameters("muon(adam=...)", learning_rate=options["lr"],
                          **{k: options[k] for k in ("b1", "b2", "eps", "weight_decay")})
    return options


def _spec_by_path(specs: Any) -> dict[str, PartitionSpec]:
    flat = jax.tree_util.tree_flatten_with_path(specs, is_leaf=lambda x: isinstance(x, PartitionSpec) or x is None)[0]
    return {path_str(p): (PartitionSpec() if s is None else s) for p, s in flat}


def _placements(tree: Any, routes: dict[str, MuonRoute], specs: dict[str, PartitionSpec], sizes: dict,
                options: tuple) -> dict[str, MuonPlacement]:
    """Each Muon-routed leaf's placement; ``options``: ``(placement, ns_steps, chooser)``."""
    shapes = {path_str(p): x.shape for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}
    missing = [k for k, r in routes.items() if r.rule == "muon" and k not in specs]
    if missing:
        raise OptimizerError(f"muon(specs=...): no PartitionSpec for the Muon-routed parameter {missing[0]!r}; give "
                             "a params-shaped tree of the momentum's specs (StateLayout.opt_param_specs).")
    return {k: place(k, shapes[k], r.reduction, r.output, specs[k], sizes, *options)
            for k, r in routes.items() if r.rule == "muon"}


def _check_placement(placement: str, mesh, specs) -> None:
    if placement not in MUON_PLACEMENTS:
        raise OptimizerError(f"muon(placement={placement!r}): choose one of {', '.join(MUON_PLACEMENTS)}.")
    if (mesh is None) != (specs is None):
        raise OptimizerError("muon(mesh=..., specs=...): give both, the mesh and the momentum's PartitionSpecs "
                             "(StateLayout.opt_param_specs), or neither (one device, or XLA's placement).")
    if mesh is None and placement != "auto":
        raise OptimizerError(f"muon(placement={placement!r}) places Newton-Schulz on the mesh: give mesh= and specs= "
                             "(the momentum's PartitionSpecs, StateLayout.opt_param_specs).")


def muon_placements(params: Any, logical: Any = None, *, mesh, specs: Any, placement: str = "auto",
                    ns_steps: int = 5, chooser: Chooser | None = None, routing: dict[str, str] | None = None
                    ) -> dict[str, MuonPlacement]:
    """``{path: MuonPlacement}``: where :func:`muon` runs each matrix group's Newton-Schulz on ``mesh``.

    Args:
      params: the parameters (arrays or ``ShapeDtypeStruct``s).
      logical: their logical names (:func:`muon_routing`).
      mesh: the device mesh.
      specs: the momentum's ``PartitionSpec`` tree (``StateLayout.opt_param_specs``).
      placement: one of :data:`MUON_PLACEMENTS`.
      ns_steps: Newton-Schulz iterations.
      chooser: ``auto``'s chooser, ``(group, sizes, ns_steps) -> "gather" | "owner"`` (None: the size rule,
        :func:`jaxpar.parallel._muon_placement.by_size`; the cost model's: :func:`jaxpar.cost.placement_chooser`).
      routing: ``{path regex: "muon" | "adam"}`` overriding the names.

    Returns:
      Muon-routed parameter path -> :class:`MuonPlacement`.
    """
    _check_placement(placement, mesh, specs)
    routes = muon_routes(params, logical, routing=routing)
    return _placements(params, routes, _spec_by_path(specs), dict(mesh.shape), (placement, ns_steps, chooser))


def scale_by_placed_muon(routes_of, *, momentum: float = 0.95, nesterov: bool = True, ns_steps: int = 5,
                         consistent_rms: float | None = None, where: tuple | None = None
                         ) -> optax.GradientTransformation:
    """``optax.contrib.scale_by_muon`` (its state, momentum and Newton-Schulz) with each matrix orthogonalised
    where its placement says, then optax's shape scaling. optax's update calls its Newton-Schulz inside and takes
    no orthogonalisation of ours, so its momentum step is restated here around :func:`placed_newton_schulz`.

    Args:
      routes_of: ``tree -> {path: MuonRoute}`` of the Muon-routed leaves.
      momentum: the momentum decay.
      nesterov: Nesterov momentum.
      ns_steps: Newton-Schulz iterations.
      consistent_rms: optax's RMS matching, or None for its width scaling.
      where: ``(mesh, specs by path, (placement, ns_steps, chooser))``, or None (XLA places it).

    Returns:
      The ``optax.GradientTransformation``; its state is ``optax.contrib.MuonState``.
    """
    def direction(x, route, placed, mesh):
        out = placed_newton_schulz(x, route.reduction, route.output, placed, mesh, ns_steps)
        fan_in = math.prod(x.shape[i] for i in route.reduction)
        fan_out = math.prod(x.shape[i] for i in route.output)
        scale = math.sqrt(max(1, fan_out / fan_in)) if consistent_rms is None else \
            consistent_rms * math.sqrt(max(fan_in, fan_out))
        return out * jnp.asarray(scale, out.dtype)

    def update_fn(updates, state, params=None):
        routes, mesh = routes_of(updates), None if where is None else where[0]
        places = {} if where is None else _placements(updates, routes, where[1], dict(mesh.shape), where[2])
        mu = optax.tree.update_moment(updates, state.mu, momentum, 1)
        count = optax.safe_increment(state.count)
        hat = optax.tree.bias_correction(mu, momentum, optax.safe_increment(count) if nesterov else count)
        if nesterov:
            hat = jax.tree.map(lambda m, g: momentum * m + (1 - momentum) * g, hat,
                               optax.tree.bias_correction(updates, momentum, count))
        out = jax.tree_util.tree_map_with_path(
            lambda p, x: direction(x, routes[path_str(p)], places.get(path_str(p)), mesh), hat)
        return out, state._replace(count=count, mu=mu)

    init = optax.contrib.scale_by_muon(ns_steps=ns_steps, beta=momentum, nesterov=nesterov).init
    return optax.GradientTransformation(init, update_fn)


def muon(learning_rate: optax.ScalarOrSchedule, *, logical: Any = None, routing: dict[str, str] | None = None,
         momentum: float = 0.95, nesterov: bool = True, ns_steps: int = 5, weight_decay: float = 0.0,
         consistent_rms: float | None = None, adam: dict | None = None, placement: str = "auto", mesh=None,
         specs: Any = None, chooser: Chooser | None = None, kernel_layout: str = "in_out"
         ) -> optax.GradientTransformation:
    """Muon (Jordan et al. 2024) on the matrices, AdamW on the rest, routed by logical names (:func:`muon_routing`).

    ``optax.partition`` of the matrices' optax Muon (:func:`scale_by_placed_muon`, decoupled ``weight_decay``,
    the learning rate) and ``optax.adamw`` with ``adam``'s options. With ``mesh`` and ``specs`` each matrix group's
    Newton-Schulz runs where ``placement`` says (:func:`muon_placements`, docs/muon.md; ``gather`` and ``owner`` are
    exact, ``local`` approximates); without them XLA partitions it.

    Args:
      learning_rate: Muon's learning rate (a scalar or an optax schedule).
      logical: the params' logical names (``abstract_model(model_fn)[2]``, ``StateLayout.logical``).
      routing: ``{path regex: "muon" | "adam"}`` overriding the names (needed for a matrix without them); each
        pattern must match a parameter of ``tx.init(params)``.
      momentum: Muon's momentum decay.
      nesterov: Nesterov momentum.
      ns_steps: Newton-Schulz iterations.
      weight_decay: the matrices' decoupled weight decay (times ``learning_rate``, as optax's).
      consistent_rms: optax's RMS matching (e.g. 0.2), or None for the width scaling.
      adam: the AdamW half's options: ``lr`` (default: ``learning_rate``), ``b1``, ``b2``, ``eps``, ``weight_decay``.
      placement: one of :data:`MUON_PLACEMENTS`.
      mesh: the device mesh the update runs on (with ``specs``).
      specs: the momentum's ``PartitionSpec`` tree (``StateLayout.opt_param_specs``; with ``mesh``).
      chooser: ``auto``'s choice per matrix group (:func:`muon_placements`; None: the size rule
        :func:`jaxpar.parallel._muon_placement.by_size`; ``jaxpar train`` passes the cost model's).
      kernel_layout: ``in_out`` (Flax kernels, the default) or ``out_in`` (PyTorch / Hugging Face weights, jaxpar's
        ``Decoder``): which side of a weight is its input, for the shape scaling (:func:`muon_routes`).

    Returns:
      The ``optax.GradientTransformation`` (``optax.partition``'s state; the matrices' ``optax.contrib.MuonState``).

    >>> import jax.numpy as jnp
    >>> p = {"w": jnp.ones((4, 8)), "b": jnp.ones(8)}
    >>> g = {"w": jnp.arange(32.0).reshape(4, 8) % 5, "b": jnp.ones(8)}
    >>> tx = muon(0.1, logical={"w": ("embed", "mlp"), "b": ("mlp",)})
    >>> ours = tx.update(g, tx.init(p), p)[0]
    >>> mu, aw = optax.contrib.muon(0.1), optax.adamw(0.1, b2=0.95, weight_decay=0.0)
    >>> theirs = {"w": mu.update(g, mu.init(p), p)[0]["w"], "b": aw.update(g, aw.init(p), p)[0]["b"]}
    >>> [bool(jnp.allclose(ours[k], theirs[k], atol=1e-6)) for k in ("w", "b")]   # the matrix: Muon; the bias: AdamW
    [True, True]
    """
    a = _checked_options(learning_rate, momentum, weight_decay, ns_steps, consistent_rms, adam)
    _check_placement(placement, mesh, specs)
    _check_kernel_layout(kernel_layout)
    _check_routing(dict(routing or {}), ())        # the rules and regexes now; the matches at tx.init(params)

    def labels(params):
        rules = {k: r.rule for k, r in muon_routes(params, logical, routing=routing).items()}
        return jax.tree_util.tree_map_with_path(lambda p, _: rules[path_str(p)], params)

    routes_of = lambda tree: _routes(tree, logical, dict(routing or {}), kernel_layout)   # noqa: E731
    where = None if mesh is None else (mesh, _spec_by_path(specs), (placement, ns_steps, chooser))
    matrices = optax.chain(scale_by_placed_muon(routes_of, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps,
                                                consistent_rms=consistent_rms, where=where),
                           optax.add_decayed_weights(weight_decay), optax.scale_by_learning_rate(learning_rate))
    rest = optax.adamw(a["lr"], b1=a["b1"], b2=a["b2"], eps=a["eps"], weight_decay=a["weight_decay"])
    return optax.partition({"muon": matrices, "adam": rest}, labels)
