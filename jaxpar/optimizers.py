"""jaxpar's optimizers: large-batch ones (learning-rate scaling rules, LARS / LAMB with masks), 1-bit Adam's,
and Muon routed by logical names.

* :func:`scaled_lr`: the peak learning rate for a global batch, scaled from ``base_batch``
  (``linear``, ``sqrt`` or ``none``).
* :func:`lars` and :func:`lamb`: built like ``optax.lars`` / ``optax.lamb``, but the weight decay
  **and** the trust ratio are masked off for biases and norm scales (:func:`trust_mask`), and the
  trust ratio of stacked blocks is per layer (docs/large_batch.md).
* :func:`adamw_frozen_variance`: AdamW whose second moment freezes, the optimizer of 1-bit Adam
  (docs/compression.md).
* :func:`muon`: Muon on the matrices and AdamW on the rest, routed by the parameters' logical names
  (:func:`muon_routing`, :func:`muon_routing_table`), its Newton-Schulz placed on the mesh
  (:func:`muon_placements`; docs/muon.md).
* :func:`hyperparameter_problem` / :func:`check_hyperparameters`: the range of each option
  (:data:`HYPERPARAMETERS`).

Example::

    >>> import jax, jax.numpy as jnp
    >>> scaled_lr(0.1, batch=1024, base_batch=256, rule="linear"), scaled_lr(0.1, 1024, 256, "sqrt")
    (0.4, 0.2)
    >>> params = {"w": jnp.ones((4, 3)), "b": jnp.ones((3,))}
    >>> trust_mask(params)                                   # 1-D leaves: no decay, no trust ratio
    {'b': False, 'w': True}
    >>> tx = lamb(1e-2, weight_decay=0.1)
    >>> updates, _ = tx.update(jax.tree.map(jnp.ones_like, params), tx.init(params), params)
    >>> [round(float(jnp.linalg.norm(u)), 5) for u in (updates["w"], updates["b"])]   # lr ||w||, lr ||adam step||
    [0.03464, 0.01732]
"""

from __future__ import annotations

import itertools
import math
import numbers
import re
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import optax
from optax import contrib
from optax.contrib._muon import _DEFAULT_NS_COEFFS, orthogonalize_via_newton_schulz
from jax.sharding import PartitionSpec

from jaxpar.adapters._blocks import LAYERS
from jaxpar.cost import (FEATURES, PLACEMENTS, PLATFORM_CLUSTERS, STACKS, MatrixGroup, PlacementCost, choose_placement,
                         load_cluster, matrix_sides, placement_cost, placement_table)
from jaxpar.mesh import CONTEXT, EXPERT, REPLICA, STANDARD_AXES
from jaxpar.rules import axes_of, path_str, shard_map_mesh
from jaxpar.errors import MaskError, OptimizerError, check_int, int_problem

__all__ = ["LR_SCALING_RULES", "HYPERPARAMETERS", "MaskError", "OptimizerError", "hyperparameter_problem",
           "check_hyperparameters", "scaled_lr", "trust_mask", "stacked_axes", "scale_by_layer_trust_ratio", "lars",
           "lamb", "scale_by_adam_frozen_variance", "adamw_frozen_variance", "MUON_FEATURES", "MUON_STACKS",
           "MUON_ADAM_DEFAULTS", "MUON_PLACEMENTS", "MUON_KERNEL_LAYOUTS", "MuonRoute", "MuonState", "MuonPlacement", "muon_routes",
           "muon_routing", "muon_routing_table", "muon_placements", "muon_placement_table", "muon"]

#: ``linear``: lr x B / B0 (Goyal et al.); ``sqrt``: lr x sqrt(B / B0); ``none``: lr.
LR_SCALING_RULES = ("linear", "sqrt", "none")

Mask = Any   # a tree of bools mirroring the params, or ``params -> such a tree``

#: ``name -> (holds, what it must be)``: the range of each optimizer option, checked on finite real numbers
#: (a ``learning_rate`` or ``weight_decay`` that is an optax schedule is not checked).
HYPERPARAMETERS = {
    "learning_rate": (lambda v: v > 0, "a finite number > 0"),
    "b1": (lambda v: 0 <= v < 1, "a decay in [0, 1)"),
    "b2": (lambda v: 0 <= v < 1, "a decay in [0, 1)"),
    "momentum": (lambda v: 0 <= v < 1, "a decay in [0, 1)"),
    "eps": (lambda v: v >= 0, "a finite number >= 0"),
    "weight_decay": (lambda v: v >= 0, "a finite number >= 0 (0: no decay)"),
    "trust_coefficient": (lambda v: v > 0, "a finite number > 0 (LARS: e.g. 0.001)"),
    "clip_norm": (lambda v: v > 0, "a finite number > 0 (the global gradient norm to clip to, e.g. 1.0), or None "
                                   "for no clipping"),
}


def hyperparameter_problem(name: str, value: Any) -> str | None:
    """What is wrong with an optimizer option's value.

    Args:
      name: a key of :data:`HYPERPARAMETERS` (``"learning_rate"``, ``"b1"``, ``"eps"``, ...).
      value: its value: a real number (a 0-d array counts); ``learning_rate`` and ``weight_decay`` may
        also be optax schedules.

    Returns:
      ``"must be ..."`` naming the range (a bool, NaN and inf are out of every range), or None.

    >>> hyperparameter_problem("b2", 1.0), hyperparameter_problem("eps", 1e-8)
    ('must be a decay in [0, 1)', None)
    """
    holds, what = HYPERPARAMETERS[name]
    if (callable(value) and name in ("learning_rate", "weight_decay")) or isinstance(value, jax.core.Tracer):
        return None          # an optax schedule; a traced value is checked where it is concrete
    if not isinstance(value, bool) and getattr(value, "shape", None) == ():
        value = value.item()               # a 0-d numpy / jax array
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) \
            or not holds(value):
        return f"must be {what}"
    return None


def check_hyperparameters(owner: str, **values: Any) -> None:
    """Raise :class:`OptimizerError` naming ``owner(name=value)`` for the first option out of its range.

    Args:
      owner: the function named in the message (``"lamb"``).
      **values: options by their :data:`HYPERPARAMETERS` names.

    >>> check_hyperparameters("lamb", learning_rate=-0.1)
    Traceback (most recent call last):
    ...
    jaxpar.errors.OptimizerError: lamb(learning_rate=-0.1): must be a finite number > 0.
    """
    for name, value in values.items():
        why = hyperparameter_problem(name, value)
        if why is not None:
            raise OptimizerError(f"{owner}({name}={value!r}): {why}.")


def scaled_lr(lr: float, batch: int, base_batch: int, rule: str = "linear") -> float:
    """The peak learning rate for global batch ``batch``, given ``lr`` tuned at ``base_batch``.

    Args:
      lr: the peak learning rate tuned at ``base_batch``.
      batch: the global batch size (sequences).
      base_batch: the global batch ``lr`` was tuned at.
      rule: ``"linear"`` (``lr x batch / base_batch``), ``"sqrt"`` or ``"none"``.

    Returns:
      The peak learning rate.

    Raises:
      OptimizerError: an unknown ``rule``, a batch that is not a positive int, or an ``lr`` out of
        :data:`HYPERPARAMETERS`' range.

    >>> scaled_lr(3e-4, batch=64, base_batch=256, rule="linear")
    7.5e-05
    >>> scaled_lr(3e-4, 64, 256, rule="none")
    0.0003
    """
    if rule not in LR_SCALING_RULES:
        raise OptimizerError(f"scaled_lr(rule={rule!r}): unknown rule; choose one of {', '.join(LR_SCALING_RULES)}.")
    for name, value in (("batch", batch), ("base_batch", base_batch)):
        if int_problem(value, 1) is not None:
            raise OptimizerError(f"scaled_lr({name}={value!r}): must be a positive int (a number of examples).")
    if (why := hyperparameter_problem("learning_rate", lr)) is not None or callable(lr):
        raise OptimizerError(f"scaled_lr(lr={lr!r}): {why or 'must be a finite number > 0'}; scale the peak, then "
                             "build the schedule from it.")
    ratio = batch / base_batch
    return lr * {"linear": ratio, "sqrt": math.sqrt(ratio), "none": 1.0}[rule]


def _is_spec(x) -> bool:
    """A leaf of a logical-names tree: ``None``, a ``PartitionSpec`` or a tuple of names."""
    return x is None or isinstance(x, PartitionSpec) or (
        isinstance(x, (tuple, list)) and all(e is None or isinstance(e, (str, tuple)) for e in x))


def _logical_by_path(logical: Any) -> dict[str, tuple]:
    flat = jax.tree_util.tree_flatten_with_path(logical, is_leaf=_is_spec)[0]
    return {path_str(p): () if s is None else tuple(s) for p, s in flat}


def _leading_layers(names: tuple) -> int:
    return len(list(itertools.takewhile(lambda name: name == LAYERS, names)))


def stacked_axes(params: Any, logical: Any = None) -> dict[str, int]:
    """``{path: k}``: how many leading axes of each parameter index stacked layers (named
    ``'layers'`` in ``logical``, a tree of logical names mirroring ``params``); 0 without ``logical``.

    Args:
      params: the parameters (a pytree of arrays).
      logical: a mirroring tree of logical names, or ``None``.

    Returns:
      Parameter path -> the number of leading stacked-layer axes.

    >>> import jax.numpy as jnp
    >>> logical = {"ln": ("layers", "embed"), "w": ("embed", "mlp")}
    >>> stacked_axes({"ln": jnp.ones((2, 8)), "w": jnp.ones((8, 8))}, logical)
    {'ln': 1, 'w': 0}
    """
    names = _logical_by_path(logical) if logical is not None else {}
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        key = path_str(path)
        if logical is not None and key not in names:
            raise MaskError(f"logical names: no entry for parameter {key!r}; give a tree of logical names that "
                            "mirrors the params (e.g. StateLayout.logical or abstract_model(model_fn)[2]).")
        out[key] = _leading_layers(names.get(key, ()))
    return out


def _matches(patterns: Sequence[str], paths: Sequence[str], what: str) -> set[str]:
    hit = set()
    for pattern in patterns:
        try:
            found = {p for p in paths if re.search(pattern, p)}
        except re.error as e:
            raise MaskError(f"{what}: {pattern!r} is not a valid regular expression ({e}).") from None
        if not found:
            shown = ", ".join(paths[:8]) + (", ..." if len(paths) > 8 else "")
            raise MaskError(f"{what}: {pattern!r} matches no parameter; parameter paths are {shown}. "
                            "Fix the pattern (a regex searched in the path) or remove it.")
        hit |= found
    return hit


def trust_mask(params: Any, logical: Any = None, *, exclude: Sequence[str] = (),
               include: Sequence[str] = ()) -> Any:
    """Which parameters get weight decay and a trust ratio: a tree of bools mirroring ``params``.

    Default: ``True`` for parameters of rank >= 2 per layer (the rank without leading
    ``'layers'`` axes of ``logical``), ``False`` for biases and norm scales. ``include`` /
    ``exclude``: regexes searched in the path (``'blocks/ln1_scale'``) that force ``True`` /
    ``False`` (``exclude`` wins); a pattern that matches no parameter raises :class:`MaskError`.

    Args:
      params: the parameters (a pytree of arrays).
      logical: a mirroring tree of logical names, or ``None`` (the arrays' rank decides).
      exclude: path regexes forced to ``False``.
      include: path regexes forced to ``True``.

    Returns:
      A tree of bools mirroring ``params``.

    >>> import jax.numpy as jnp
    >>> p = {"emb": jnp.ones((16, 8)), "ln": jnp.ones((2, 8)), "w": jnp.ones((2, 8, 8))}
    >>> trust_mask(p, {"emb": ("vocab", "embed"), "ln": ("layers", "embed"), "w": ("layers", "embed", "mlp")})
    {'emb': True, 'ln': False, 'w': True}
    >>> trust_mask(p, exclude=["^emb$"])                     # no logical names: the array's rank
    {'emb': False, 'ln': True, 'w': True}
    """
    axes = stacked_axes(params, logical)
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    paths = [path_str(p) for p, _ in flat]
    on = _matches(include, paths, "trust_mask include")
    off = _matches(exclude, paths, "trust_mask exclude")
    leaves = [(path not in off) and (path in on or leaf.ndim - axes[path] >= 2)
              for path, (_, leaf) in zip(paths, flat)]
    return jax.tree_util.tree_unflatten(treedef, leaves)


def _mask_fn(mask: Mask, logical: Any) -> Mask:
    return (lambda params: trust_mask(params, logical)) if mask is None else mask


def scale_by_layer_trust_ratio(logical: Any = None, *, trust_coefficient: float = 1.0,
                               eps: float = 0.0) -> optax.GradientTransformation:
    """``optax.scale_by_trust_ratio`` per layer: ``u * c ||w|| / (||u|| + eps)`` (1 where a norm is 0),
    with the norms taken over each slice of the leading ``'layers'`` axes of ``logical``
    (:func:`stacked_axes`); without ``logical``, over whole leaves, as optax does. Each norm is
    computed once (optax's ``safe_norm`` computes it twice, which doubles the all-reduces of a
    sharded leaf); the values equal optax's with ``min_norm=0``.

    Args:
      logical: the params' logical names, or ``None`` (norms over whole leaves).
      trust_coefficient: ``c``.
      eps: added to ``||u||``.

    Returns:
      The ``optax.GradientTransformation``.

    >>> import jax.numpy as jnp
    >>> w = jnp.stack([jnp.ones(4), 2 * jnp.ones(4)])          # two stacked layers
    >>> tx = scale_by_layer_trust_ratio({"w": ("layers", "embed")})
    >>> tx.update({"w": jnp.ones((2, 4))}, tx.init({"w": w}), {"w": w})[0]["w"][:, 0].tolist()
    [1.0, 2.0]
    """
    check_hyperparameters("scale_by_layer_trust_ratio", trust_coefficient=trust_coefficient, eps=eps)
    names = _logical_by_path(logical) if logical is not None else {}

    def one(path, update, param):
        axes = tuple(range(_leading_layers(names.get(path_str(path), ())), param.ndim))
        param_norm = jnp.sqrt(jnp.sum(jnp.square(param), axis=axes, keepdims=True))
        update_norm = jnp.sqrt(jnp.sum(jnp.square(update), axis=axes, keepdims=True))
        ratio = trust_coefficient * param_norm / (update_norm + eps)
        zero = (param_norm == 0) | (update_norm == 0)
        return update * jnp.where(zero, jnp.ones_like(ratio), ratio).astype(update.dtype)

    def update_fn(updates, state, params=None):
        if params is None:
            raise OptimizerError("scale_by_layer_trust_ratio: call tx.update(updates, state, params); "
                                 "the trust ratio needs the params.")
        return jax.tree_util.tree_map_with_path(one, updates, params), state

    return optax.GradientTransformation(optax.init_empty_state, update_fn)


def lars(learning_rate: optax.ScalarOrSchedule, *, weight_decay: float = 0.0, momentum: float = 0.9,
         nesterov: bool = False, trust_coefficient: float = 0.001, eps: float = 0.0, logical: Any = None,
         mask: Mask = None) -> optax.GradientTransformation:
    """LARS (You et al. 2017) as ``optax.lars`` builds it, with masks and per-layer trust ratios.

    Per masked-in parameter: ``u = g + wd w``, ``u *= trust_coefficient ||w|| / (||u|| + eps)``,
    then ``v = momentum v + lr u`` and ``w -= v``. Masked-out parameters (``mask``; default
    :func:`trust_mask` from ``logical``: biases, norm scales) get ``v = momentum v + lr g``.
    ``logical``: the params' logical names (e.g. ``StateLayout.logical``); ``mask``: a tree
    of bools or a function of the params.

    Args:
      learning_rate: a scalar or an optax schedule.
      weight_decay: ``wd``.
      momentum: the momentum of ``v``.
      nesterov: Nesterov momentum.
      trust_coefficient: scales the trust ratio.
      eps: added to ``||u||``.
      logical: the params' logical names (e.g. ``StateLayout.logical``), or ``None``.
      mask: a tree of bools or a function of the params; default :func:`trust_mask`.

    Returns:
      The ``optax.GradientTransformation``.

    >>> import jax.numpy as jnp
    >>> p = {"w": jnp.full((2, 2), 3.0), "b": jnp.ones(2)}
    >>> tx = lars(0.1, trust_coefficient=0.5)
    >>> u, _ = tx.update({"w": jnp.ones((2, 2)), "b": jnp.ones(2)}, tx.init(p), p)
    >>> u["w"][0, 0].item(), u["b"][0].item()          # w: -0.1 * 0.5 * 6 / 2 x 1;  b: -0.1 x 1
    (-0.15000000596046448, -0.10000000149011612)
    """
    check_hyperparameters("lars", learning_rate=learning_rate, weight_decay=weight_decay, momentum=momentum,
                          trust_coefficient=trust_coefficient, eps=eps)
    m = _mask_fn(mask, logical)
    return optax.chain(
        optax.add_decayed_weights(weight_decay, mask=m),
        optax.masked(scale_by_layer_trust_ratio(logical, trust_coefficient=trust_coefficient, eps=eps), m),
        optax.scale_by_learning_rate(learning_rate),
        optax.trace(decay=momentum, nesterov=nesterov),
    )


def lamb(learning_rate: optax.ScalarOrSchedule, *, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-6,
         weight_decay: float = 0.0, logical: Any = None, mask: Mask = None) -> optax.GradientTransformation:
    """LAMB (You et al. 2020) as ``optax.lamb`` builds it, with the trust ratio masked as well.

    Per parameter: Adam's bias-corrected ``r = m_hat / (sqrt(v_hat) + eps)``; masked-in ones
    (default :func:`trust_mask` from ``logical``) get ``u = r + wd w`` scaled by ``||w|| / ||u||``
    (per layer for stacked blocks), masked-out ones (biases, norm scales) ``u = r``; then
    ``w -= lr u``. ``optax.lamb`` masks only the decay and applies the trust ratio everywhere.

    Args:
      learning_rate: a scalar or an optax schedule.
      b1: Adam's first-moment decay.
      b2: Adam's second-moment decay.
      eps: added to ``sqrt(v_hat)``.
      weight_decay: ``wd``.
      logical: the params' logical names, or ``None``.
      mask: a tree of bools or a function of the params; default :func:`trust_mask`.

    Returns:
      The ``optax.GradientTransformation``.

    >>> import jax.numpy as jnp
    >>> p = {"w": jnp.full((2, 2), 3.0), "b": jnp.ones(2)}
    >>> tx = lamb(0.1)
    >>> u, _ = tx.update({"w": jnp.ones((2, 2)), "b": jnp.ones(2)}, tx.init(p), p)
    >>> round(u["w"][0, 0].item(), 5), round(u["b"][0].item(), 5)    # w: -0.1 x 6 / 2;  b: -0.1 x ~1
    (-0.3, -0.1)
    """
    check_hyperparameters("lamb", learning_rate=learning_rate, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay)
    m = _mask_fn(mask, logical)
    return optax.chain(
        optax.scale_by_adam(b1=b1, b2=b2, eps=eps),
        optax.add_decayed_weights(weight_decay, mask=m),
        optax.masked(scale_by_layer_trust_ratio(logical), m),
        optax.scale_by_learning_rate(learning_rate),
    )


def scale_by_adam_frozen_variance(freeze_step: int, *, b1: float = 0.9, b2: float = 0.999,
                                  eps: float = 1e-8) -> optax.GradientTransformation:
    """``optax.scale_by_adam`` whose second moment stops changing after ``freeze_step`` updates
    (1-bit Adam, Tang et al. 2021: from then on only the first moment, a linear function of the
    gradients, is exchanged compressed). Before it, the same numbers as ``optax.scale_by_adam``;
    the state is optax's ``ScaleByAdamState``, so checkpoints of either restore into the other.

    Args:
      freeze_step: the number of updates after which the second moment is frozen.
      b1: the first-moment decay.
      b2: the second-moment decay.
      eps: added to ``sqrt(nu_hat)``.

    Returns:
      The ``optax.GradientTransformation``.

    >>> import jax.numpy as jnp
    >>> tx = scale_by_adam_frozen_variance(1, b2=0.5)
    >>> state = tx.init(jnp.zeros(2))
    >>> _, state = tx.update(jnp.array([1.0, 2.0]), state)
    >>> _, state = tx.update(jnp.array([9.0, 9.0]), state)     # after 1 update: the variance is frozen
    >>> state.nu.tolist()
    [0.5, 2.0]
    """
    check_int("scale_by_adam_frozen_variance", "freeze_step", freeze_step, 1, OptimizerError)
    check_hyperparameters("scale_by_adam_frozen_variance", b1=b1, b2=b2, eps=eps)
    def update_fn(updates, state, params=None):
        frozen = state.count >= freeze_step
        nu = optax.tree.update_moment_per_elem_norm(updates, state.nu, b2, 2)
        nu = jax.tree.map(lambda new, old: jnp.where(frozen, old, new), nu, state.nu)
        mu = optax.tree.update_moment(updates, state.mu, b1, 1)
        count = optax.safe_increment(state.count)
        mu_hat = optax.tree.bias_correction(mu, b1, count)
        nu_hat = optax.tree.bias_correction(nu, b2, jnp.minimum(count, freeze_step))
        out = jax.tree.map(lambda m, v: m / (jnp.sqrt(v) + eps), mu_hat, nu_hat)
        return out, optax.ScaleByAdamState(count=count, mu=mu, nu=nu)

    return optax.GradientTransformation(optax.scale_by_adam(b1=b1, b2=b2, eps=eps).init, update_fn)


def adamw_frozen_variance(learning_rate: optax.ScalarOrSchedule, freeze_step: int, *, b1: float = 0.9,
                          b2: float = 0.999, eps: float = 1e-8, weight_decay: float = 1e-4,
                          mask: Mask = None) -> optax.GradientTransformation:
    """``optax.adamw`` with :func:`scale_by_adam_frozen_variance`: the optimizer of 1-bit Adam,
    with ``compression=sign(optimizer_momentum=b1, start_step=freeze_step)`` (:mod:`jaxpar.parallel.compression`).

    Args:
      learning_rate: a scalar or an optax schedule.
      freeze_step: the number of updates after which the second moment is frozen.
      b1: the first-moment decay.
      b2: the second-moment decay.
      eps: added to ``sqrt(nu_hat)``.
      weight_decay: the decoupled weight decay.
      mask: which parameters decay: a tree of bools or a function of the params.

    Returns:
      The ``optax.GradientTransformation``.

    >>> import jax.numpy as jnp, optax
    >>> p, g = jnp.ones(3), jnp.array([0.1, -0.2, 0.3])
    >>> a, b = adamw_frozen_variance(1e-2, 10), optax.adamw(1e-2)
    >>> bool(jnp.allclose(a.update(g, a.init(p), p)[0], b.update(g, b.init(p), p)[0]))   # before freeze_step
    True
    """
    check_hyperparameters("adamw_frozen_variance", learning_rate=learning_rate, weight_decay=weight_decay)
    return optax.chain(
        scale_by_adam_frozen_variance(freeze_step, b1=b1, b2=b2, eps=eps),
        optax.add_decayed_weights(weight_decay, mask=mask),
        optax.scale_by_learning_rate(learning_rate),
    )


# ----------------------------------------------------------------------------- Muon, routed by logical names

#: Logical names of feature axes: a parameter whose feature axes form two groups is a matrix.
MUON_FEATURES = FEATURES
#: Logical names of stacked axes (``None``: an unnamed sub-layer axis): batch dimensions of Newton-Schulz.
MUON_STACKS = STACKS
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


def _route_by_names(names: tuple) -> MuonRoute:
    """The rule of a parameter from its logical names alone (:func:`jaxpar.cost.matrix_sides`)."""
    reduction, output, batch, why = matrix_sides(names)
    return MuonRoute("muon" if reduction else "adam", reduction, output, batch, why)


def _forced_muon(path: str, names: tuple, ndim: int) -> MuonRoute:
    """``routing=`` says Muon: the two non-stacked axes (the last two without names) are the matrix."""
    if not any(n is not None for n in names):
        if ndim < 2:
            raise OptimizerError(f"muon(routing=...): parameter {path!r} has rank {ndim}; Muon needs a matrix. "
                                 "Route it to 'adam'.")
        return MuonRoute("muon", (ndim - 2,), (ndim - 1,), tuple(range(ndim - 2)), "routing=: the last two axes")
    free = [i for i, n in enumerate(names) if n not in MUON_STACKS]
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
        _matches(list(routing), list(paths), "muon(routing=...)")
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
    unnamed = sum(n is None for n in own) >= 2 and all(n is None or n in MUON_STACKS for n in own)
    if unnamed or any(n in _MESH_NAMES for n in own):
        raise _unnamed_error(path, own, tuple(shape))
    return _route_by_names(own)


def _routes(params: Any, logical: Any, routing: dict[str, str]) -> dict[str, MuonRoute]:
    names = _logical_by_path(logical) if logical is not None else {}
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    missing = [path_str(p) for p, _ in flat if logical is not None and path_str(p) not in names]
    if missing:
        raise OptimizerError(f"muon(logical=...): no logical names for parameter {missing[0]!r}; give a tree of "
                             "logical names that mirrors the params (abstract_model(model_fn)[2] or StateLayout.logical).")
    return {path_str(p): _route_one(path_str(p), names.get(path_str(p), ()), leaf.shape, routing)
            for p, leaf in flat}


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
    routes = _routes(params, logical, routing)
    if kernel_layout == "out_in":               # the first feature group is the output side
        routes = {k: r._replace(reduction=r.output, output=r.reduction) for k, r in routes.items()}
    return routes


def _check_kernel_layout(kernel_layout: str) -> None:
    if kernel_layout not in MUON_KERNEL_LAYOUTS:
        raise OptimizerError(f"muon(kernel_layout={kernel_layout!r}): choose one of {', '.join(MUON_KERNEL_LAYOUTS)} "
                             "(in_out: Flax kernels [in, out]; out_in: PyTorch / Hugging Face weights [out, in]).")


def _unnamed_error(path: str, names: tuple, shape: tuple) -> OptimizerError:
    mesh = [n for n in names if n in _MESH_NAMES]
    what = f"mesh-axis names {mesh}, not logical names" if mesh else \
        "no logical names" if all(n is None for n in names) else f"logical names {names} without a feature name"
    return OptimizerError(
        f"muon: parameter {path!r} of shape {shape} has {what}; without feature names ({', '.join(MUON_FEATURES)}) "
        "whether it is a matrix is unknown (Muon never guesses from shapes). Annotate the model with logical names "
        "(nnx.with_partitioning(init, ('embed', 'mlp'))) and pass logical=abstract_model(model_fn)[2], or route it "
        "explicitly: muon(..., routing={'<path regex>': 'muon' | 'adam'}).")


def muon_routing(params: Any, logical: Any = None, *, routing: dict[str, str] | None = None) -> dict[str, str]:
    """``{path: "muon" | "adam"}``: which half of :func:`muon` updates each parameter.

    A parameter is a matrix (Muon) when its feature axes (:data:`MUON_FEATURES`) form exactly two groups
    and every other axis is stacked (:data:`MUON_STACKS`: ``layers``, ``experts``, unnamed sub-layer axes):
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
    names = _logical_by_path(logical) if logical is not None else {}
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


def _adam_options(adam: dict | None, learning_rate) -> dict:
    options = {**MUON_ADAM_DEFAULTS, **(adam or {})}
    unknown = sorted(set(options) - set(MUON_ADAM_DEFAULTS))
    if unknown:
        raise OptimizerError(f"muon(adam={{{unknown[0]!r}: ...}}): unknown option; the AdamW half takes "
                             f"{', '.join(MUON_ADAM_DEFAULTS)}.")
    options["lr"] = learning_rate if options["lr"] is None else options["lr"]
    check_hyperparameters("muon(adam=...)", learning_rate=options["lr"], b1=options["b1"], b2=options["b2"],
                          eps=options["eps"], weight_decay=options["weight_decay"])
    return options


class MuonState(NamedTuple):
    """:func:`muon`'s state: params-shaped trees (so layouts shard them like the params); each half's
    tree holds ``optax.MaskedNode()`` where the other half owns the parameter.

    Attributes:
      count: updates so far.
      mu: Muon's momentum (the matrices).
      adam: ``optax.adamw``'s state (the rest).
    """

    count: jax.Array
    mu: Any
    adam: Any


def _hide(tree: Any, keep: dict[str, bool]) -> Any:
    """``tree`` with the leaves not in ``keep`` replaced by ``optax.MaskedNode()`` (no leaves)."""
    return jax.tree_util.tree_map_with_path(lambda p, x: x if keep[path_str(p)] else optax.MaskedNode(), tree)


def _newton_schulz(x: jax.Array, reduction: tuple, output: tuple, ns_steps: int) -> jax.Array:
    """optax's Newton-Schulz over the matrix axes ``reduction`` x ``output`` (the other axes: a batch)."""
    dims = contrib.MuonDimensionNumbers(reduction, output)
    return orthogonalize_via_newton_schulz(x, jnp.asarray(_DEFAULT_NS_COEFFS), ns_steps, "frobenius", 1e-8, dims)


class MuonPlacement(NamedTuple):
    """Where one matrix group's Newton-Schulz runs (:func:`muon_placements`).

    Attributes:
      kind: ``"gather"``, ``"owner"`` or ``"local"`` (:data:`MUON_PLACEMENTS`).
      axes: the mesh axes that shard its matrix dimensions (the collectives' group; ``()``: none).
      dims: per dimension, the mesh axes (of ``axes``) that shard it.
      spec: the momentum's ``PartitionSpec`` (the ``shard_map``'s in and out specs).
      cost: its Newton-Schulz FLOPs, collectives and seconds on one device (:func:`jaxpar.cost.placement_cost`).
    """

    kind: str
    axes: tuple[str, ...]
    dims: tuple[tuple[str, ...], ...]
    spec: PartitionSpec
    cost: PlacementCost


def _linear_index(axes: tuple[str, ...], sizes: dict) -> jax.Array:
    """This device's index over ``axes`` (row-major), inside a ``shard_map``."""
    index = jnp.int32(0)
    for a in axes:
        index = index * sizes[a] + jax.lax.axis_index(a)
    return index


def _assemble(blocks: jax.Array, dims: tuple, axes: tuple[str, ...], sizes: dict) -> jax.Array:
    """``blocks [P, *local]`` (one block per device of ``axes``, row-major, as ``all_gather`` and
    ``all_to_all`` stack them) -> the array whose dims are whole (``dims[d]``: the axes that cut dim ``d``)."""
    k = len(axes)
    x = blocks.reshape(tuple(sizes[a] for a in axes) + blocks.shape[1:])
    perm, shape = [], []
    for d, own in enumerate(dims):
        perm += [axes.index(a) for a in own] + [k + d]
        shape.append(blocks.shape[1 + d] * math.prod(sizes[a] for a in own))
    return x.transpose(perm).reshape(shape)


def _split(x: jax.Array, dims: tuple, axes: tuple[str, ...], sizes: dict) -> jax.Array:
    """The inverse of :func:`_assemble`: ``x`` -> ``[P, *local]``, one block per device of ``axes``."""
    shape, where, local, local_shape = [], {}, [], []
    for d, own in enumerate(dims):
        for a in own:
            where[a] = len(shape)
            shape.append(sizes[a])
        local.append(len(shape))
        local_shape.append(x.shape[d] // math.prod(sizes[a] for a in own))
        shape.append(local_shape[-1])
    y = x.reshape(shape).transpose([where[a] for a in axes] + local)
    return y.reshape((math.prod(sizes[a] for a in axes),) + tuple(local_shape))


def _gathered(x, route: MuonRoute, place: MuonPlacement, sizes: dict, ns_steps: int) -> jax.Array:
    """``gather``: one all-gather of the matrix dims, Newton-Schulz, this device's slice kept."""
    full = _assemble(jax.lax.all_gather(x, place.axes, axis=0, tiled=False), place.dims, place.axes, sizes)
    out = _newton_schulz(full, route.reduction, route.output, ns_steps)
    return _split(out, place.dims, place.axes, sizes)[_linear_index(place.axes, sizes)]


def _owned(x, route: MuonRoute, place: MuonPlacement, sizes: dict, ns_steps: int) -> jax.Array:
    """``owner``: the local batch of matrices spread over the matrix axes (padded with zero matrices),
    one all-to-all to the owners, Newton-Schulz once per matrix, one all-to-all back."""
    matrix = tuple(sorted(route.reduction + route.output))
    order = tuple(route.batch) + matrix
    xt = x.transpose(order)
    nb, p = math.prod(xt.shape[:len(route.batch)]), math.prod(sizes[a] for a in place.axes)
    c = -(-nb // p)
    flat = xt.reshape((nb,) + xt.shape[len(route.batch):])
    flat = jnp.pad(flat, [(0, c * p - nb)] + [(0, 0)] * len(matrix))
    dims = ((),) + tuple(place.dims[d] for d in matrix)
    received = jax.lax.all_to_all(flat.reshape((p, c) + flat.shape[1:]), place.axes, 0, 0, tiled=False)
    full = _assemble(received, dims, place.axes, sizes)
    new = lambda side: tuple(1 + matrix.index(d) for d in side)          # noqa: E731
    out = _newton_schulz(full, new(route.reduction), new(route.output), ns_steps)
    back = jax.lax.all_to_all(_split(out, dims, place.axes, sizes), place.axes, 0, 0, tiled=False)
    back = back.reshape((p * c,) + back.shape[2:])[:nb].reshape(xt.shape)
    return back.transpose(tuple(order.index(d) for d in range(x.ndim)))


def _placed_newton_schulz(x: jax.Array, route: MuonRoute, place: MuonPlacement | None, mesh, ns_steps: int):
    """Newton-Schulz of one matrix group where ``place`` says (None: as XLA partitions it)."""
    if place is None:
        return _newton_schulz(x, route.reduction, route.output, ns_steps)
    sizes = dict(mesh.shape)
    body = {"gather": _gathered, "owner": _owned,
            "local": lambda v, r, *_: _newton_schulz(v, r.reduction, r.output, ns_steps)}[place.kind]
    return jax.shard_map(lambda v: body(v, route, place, sizes, ns_steps), mesh=shard_map_mesh(mesh),
                         in_specs=place.spec, out_specs=place.spec, check_vma=False)(x)


def _muon_direction(mu_hat: jax.Array, route: MuonRoute, ns_steps: int, consistent_rms: float | None,
                    place: MuonPlacement | None = None, mesh=None) -> jax.Array:
    """Newton-Schulz over the route's matrix axes (stacked axes: batch) where ``place`` says, then optax's
    shape scaling (of the whole matrix)."""
    out = _placed_newton_schulz(mu_hat, route, place, mesh, ns_steps)
    fan_in = math.prod(mu_hat.shape[i] for i in route.reduction)
    fan_out = math.prod(mu_hat.shape[i] for i in route.output)
    scale = math.sqrt(max(1, fan_out / fan_in)) if consistent_rms is None else \
        consistent_rms * math.sqrt(max(fan_in, fan_out))
    return out * jnp.asarray(scale, out.dtype)


def _matrix_step(g: jax.Array, m: jax.Array, count: jax.Array, route: MuonRoute, opts: tuple,
                 place: MuonPlacement | None = None, mesh=None) -> jax.Array:
    """optax's ``scale_by_muon`` step of one matrix leaf: bias-corrected (Nesterov) momentum, orthogonalised."""
    momentum, nesterov, ns_steps, consistent_rms = opts
    hat = m / (1 - momentum ** count.astype(m.dtype))
    if nesterov:
        hat = momentum * m / (1 - momentum ** (count + 1).astype(m.dtype)) + \
            (1 - momentum) * g / (1 - momentum ** count.astype(g.dtype))
    return _muon_direction(hat, route, ns_steps, consistent_rms, place, mesh)


def _spec_dims(spec: PartitionSpec, ndim: int, sizes: dict, manual: set) -> tuple[tuple[str, ...], ...]:
    """Per dimension, the mesh axes of ``spec`` of size > 1 that are not manual already."""
    entries = tuple(spec) + (None,) * (ndim - len(spec))
    return tuple(tuple(a for a in axes_of(e) if sizes.get(a, 1) > 1 and a not in manual) for e in entries)


def _place_one(path: str, shape: tuple, route: MuonRoute, spec: PartitionSpec, sizes: dict, options: tuple
               ) -> MuonPlacement:
    """One matrix group's placement: :func:`jaxpar.cost.choose_placement` on its momentum's spec."""
    placement, ns_steps, cluster = options
    manual = set(jax.sharding.get_abstract_mesh().manual_axes)
    dims = _spec_dims(spec, len(shape), sizes, manual)
    group = MatrixGroup(path, tuple(shape), route.reduction, route.output, dims)
    kind = choose_placement(group, sizes, ns_steps, cluster, placement)
    on = group.axes(route.reduction + route.output, sizes)
    matrix_dims = tuple(dims[d] if d in route.reduction + route.output else () for d in range(len(shape)))
    kept = PartitionSpec(*(None if not d else d[0] if len(d) == 1 else d for d in dims))
    return MuonPlacement(kind, on, matrix_dims, kept, placement_cost(group, sizes, kind, ns_steps, cluster))


def _spec_by_path(specs: Any) -> dict[str, PartitionSpec]:
    flat = jax.tree_util.tree_flatten_with_path(specs, is_leaf=lambda x: isinstance(x, PartitionSpec) or x is None)[0]
    return {path_str(p): (PartitionSpec() if s is None else s) for p, s in flat}


def _placements(tree: Any, routes: dict[str, MuonRoute], specs: dict[str, PartitionSpec], sizes: dict,
                options: tuple) -> dict[str, MuonPlacement]:
    shapes = {path_str(p): x.shape for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}
    missing = [k for k, r in routes.items() if r.rule == "muon" and k not in specs]
    if missing:
        raise OptimizerError(f"muon(specs=...): no PartitionSpec for the Muon-routed parameter {missing[0]!r}; give "
                             "a params-shaped tree of the momentum's specs (StateLayout.opt_param_specs).")
    return {k: _place_one(k, shapes[k], r, specs[k], sizes, options) for k, r in routes.items() if r.rule == "muon"}


def _cluster_of(mesh, cluster):
    """The cost model's cluster that ``auto`` times placements on (default: by the mesh's platform)."""
    if mesh is None:
        return None
    if cluster is None:
        cluster = PLATFORM_CLUSTERS.get(mesh.devices.flat[0].platform, "h100")
    return load_cluster(cluster) if isinstance(cluster, str) else cluster


def _check_placement(placement: str, mesh, specs) -> None:
    if placement not in MUON_PLACEMENTS:
        raise OptimizerError(f"muon(placement={placement!r}): choose one of {', '.join(MUON_PLACEMENTS)}.")
    if (mesh is None) != (specs is None):
        raise OptimizerError("muon(mesh=..., specs=...): give both, the mesh and the momentum's PartitionSpecs "
                             "(StateLayout.opt_param_specs), or neither (one device, or XLA's placement).")
    if mesh is None and placement != "auto":
        raise OptimizerError(f"muon(placement={placement!r}) places Newton-Schulz on the mesh: give mesh= and specs= "
                             "(the momentum's PartitionSpecs, StateLayout.opt_param_specs).")


def muon_placement_table(placements: dict[str, MuonPlacement]) -> str:
    """:func:`muon_placements` as text: per matrix group its placement, the mesh axes it gathers over, its
    Newton-Schulz FLOPs and collectives on one device and the cost model's milliseconds.

    Args:
      placements: ``{path: MuonPlacement}``.

    Returns:
      The table.
    """
    return placement_table([(path, p.axes, p.cost) for path, p in placements.items()])


def muon_placements(params: Any, logical: Any = None, *, mesh, specs: Any, placement: str = "auto",
                    ns_steps: int = 5, cluster: Any = None, routing: dict[str, str] | None = None
                    ) -> dict[str, MuonPlacement]:
    """``{path: MuonPlacement}``: where :func:`muon` runs each matrix group's Newton-Schulz on ``mesh``.

    Args:
      params: the parameters (arrays or ``ShapeDtypeStruct``s).
      logical: their logical names (:func:`muon_routing`).
      mesh: the device mesh.
      specs: the momentum's ``PartitionSpec`` tree (``StateLayout.opt_param_specs``).
      placement: one of :data:`MUON_PLACEMENTS` (``auto``: :func:`jaxpar.cost.choose_placement`).
      ns_steps: Newton-Schulz iterations.
      cluster: the cost model's cluster for ``auto`` (a preset name or a ``jaxpar.cost.Cluster``;
        None: by the mesh's platform, :data:`jaxpar.cost.PLATFORM_CLUSTERS`).
      routing: ``{path regex: "muon" | "adam"}`` overriding the names.

    Returns:
      Muon-routed parameter path -> :class:`MuonPlacement`.
    """
    _check_placement(placement, mesh, specs)
    routes = muon_routes(params, logical, routing=routing)
    return _placements(params, routes, _spec_by_path(specs), dict(mesh.shape),
                       (placement, ns_steps, _cluster_of(mesh, cluster)))


def _checked_adamw(learning_rate, momentum, weight_decay, ns_steps, consistent_rms, adam) -> optax.GradientTransformation:
    """:func:`muon`'s options checked by name; its AdamW half."""
    check_hyperparameters("muon", learning_rate=learning_rate, momentum=momentum, weight_decay=weight_decay)
    check_int("muon", "ns_steps", ns_steps, 1, OptimizerError)
    if consistent_rms is not None:
        check_hyperparameters("muon(consistent_rms=...)", learning_rate=consistent_rms)
    a = _adam_options(adam, learning_rate)
    return optax.adamw(a["lr"], b1=a["b1"], b2=a["b2"], eps=a["eps"], weight_decay=a["weight_decay"])


def muon(learning_rate: optax.ScalarOrSchedule, *, logical: Any = None, routing: dict[str, str] | None = None,
         momentum: float = 0.95, nesterov: bool = True, ns_steps: int = 5, weight_decay: float = 0.0,
         consistent_rms: float | None = None, adam: dict | None = None, placement: str = "auto", mesh=None,
         specs: Any = None, cluster: Any = None, kernel_layout: str = "in_out") -> optax.GradientTransformation:
    """Muon (Jordan et al. 2024) on the matrices, AdamW on the rest, routed by logical names (:func:`muon_routing`).

    The matrices get optax's Muon (``scale_by_muon``'s momentum and Newton-Schulz per matrix, stacked axes as
    batch; its shape scaling), decoupled ``weight_decay``; the others ``optax.adamw`` with ``adam``'s options.
    With ``mesh`` and ``specs``, each matrix group's Newton-Schulz runs where ``placement`` says
    (:func:`muon_placements`, docs/muon.md): ``gather`` and ``owner`` are exact, ``local`` (each shard
    alone) approximates; without them XLA partitions it.

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
      placement: one of :data:`MUON_PLACEMENTS`; ``auto``: the cost model's exact choice per group.
      mesh: the device mesh the update runs on (with ``specs``).
      specs: the momentum's ``PartitionSpec`` tree (``StateLayout.opt_param_specs``; with ``mesh``).
      cluster: the cost model's cluster for ``auto`` (preset name or ``jaxpar.cost.Cluster``; None: by platform).
      kernel_layout: ``in_out`` (Flax kernels, the default) or ``out_in`` (PyTorch / Hugging Face weights, jaxpar's
        ``Decoder``): which side of a weight is its input, for the shape scaling (:func:`muon_routes`).

    Returns:
      The ``optax.GradientTransformation``; its state is a :class:`MuonState`.

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
    rest = _checked_adamw(learning_rate, momentum, weight_decay, ns_steps, consistent_rms, adam)
    _check_placement(placement, mesh, specs)
    _check_kernel_layout(kernel_layout)
    _check_routing(dict(routing or {}), ())        # the rules and regexes now; the matches at tx.init(params)
    routes = lambda tree: muon_routes(tree, logical, routing=routing, kernel_layout=kernel_layout)   # noqa: E731
    where = None if mesh is None else (mesh, _spec_by_path(specs), (placement, ns_steps, _cluster_of(mesh, cluster)))

    def init_fn(params):
        on = {k: r.rule == "muon" for k, r in routes(params).items()}
        mu = _hide(jax.tree.map(jnp.zeros_like, params), on)
        return MuonState(jnp.zeros([], jnp.int32), mu, rest.init(_hide(params, {k: not v for k, v in on.items()})))

    opts = (momentum, nesterov, ns_steps, consistent_rms)
    update_fn = _muon_update_fn(rest, routes, learning_rate, weight_decay, opts, where)
    return optax.GradientTransformation(init_fn, update_fn)


def _muon_update_fn(rest, routes, learning_rate, weight_decay: float, opts: tuple, where: tuple | None):
    """:func:`muon`'s ``update_fn``: ``where`` is ``(mesh, specs by path, placement options)`` or None."""
    momentum = opts[0]

    def update_fn(updates, state, params=None):
        if params is None:
            raise OptimizerError("muon: call tx.update(updates, state, params); weight decay needs the params.")
        route = routes(updates)
        mesh = None if where is None else where[0]
        places = {} if where is None else _placements(updates, route, where[1], dict(mesh.shape), where[2])
        off = {k: r.rule != "muon" for k, r in route.items()}
        adam_updates, adam_state = rest.update(_hide(updates, off), state.adam, _hide(params, off))
        count = optax.safe_increment(state.count)
        lr = learning_rate(state.count) if callable(learning_rate) else learning_rate

        moment = lambda path, g, m: momentum * m + (1 - momentum) * g if route[path_str(path)].rule == "muon" else m
        def one(path, g, m, p, u):
            k = path_str(path)
            if route[k].rule != "muon":
                return u
            return -lr * (_matrix_step(g, m, count, route[k], opts, places.get(k), mesh) + weight_decay * p)

        mu = jax.tree_util.tree_map_with_path(moment, updates, state.mu)
        out = jax.tree_util.tree_map_with_path(one, updates, mu, params, adam_updates)
        return out, MuonState(count, mu, adam_state)

    return update_fn
