"""Large-batch optimizers: LARS and LAMB built as optax builds them, with the weight decay **and** the trust
ratio masked off for biases and norm scales (:func:`trust_mask`), and per-layer trust ratios for stacked blocks
(docs/large_batch.md)."""
from __future__ import annotations

import itertools
import re
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec

from jaxpar.adapters._blocks import LAYERS
from jaxpar.errors import MaskError, OptimizerError
from jaxpar.optimizers._ranges import check_hyperparameters
from jaxpar.rules import path_str

Mask = Any   # a tree of bools mirroring the params, or ``params -> such a tree``


def _is_spec(x) -> bool:
    """A leaf of a logical-names tree: ``None``, a ``PartitionSpec`` or a tuple of names."""
    return x is None or isinstance(x, PartitionSpec) or (
        isinstance(x, (tuple, list)) and all(e is None or isinstance(e, (str, tuple)) for e in x))


def logical_by_path(logical: Any) -> dict[str, tuple]:
    """``{path: logical names}`` of a tree of logical names (``()`` for a leaf without names)."""
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
    names = logical_by_path(logical) if logical is not None else {}
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        key = path_str(path)
        if logical is not None and key not in names:
            raise MaskError(f"logical names: no entry for parameter {key!r}; give a tree of logical names that "
                            "mirrors the params (e.g. StateLayout.logical or abstract_model(model_fn)[2]).")
        out[key] = _leading_layers(names.get(key, ()))
    return out


def paths_matching(patterns: Sequence[str], paths: Sequence[str], what: str) -> set[str]:
    """The ``paths`` that the regexes ``patterns`` match; :class:`MaskError` names a pattern that matches none."""
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
    on = paths_matching(include, paths, "trust_mask include")
    off = paths_matching(exclude, paths, "trust_mask exclude")
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
    names = logical_by_path(logical) if logical is not None else {}

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
