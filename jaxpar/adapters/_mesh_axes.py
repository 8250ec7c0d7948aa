"""A model's parameter shapes and logical annotations, traced without allocating anything
(:func:`abstract_model`), and models written in JAX's explicit-sharding style: they pin shardings
by mesh axes (``jnp.einsum(..., out_sharding=P("data", None, "tensor"))``, ``nnx.Linear(...)(x,
out_sharding=...)``, ``jax.reshard``), which JAX accepts only under a mesh whose axes are ``Explicit``.

jaxpar's step runs with ``Auto`` axes: XLA chooses the collectives that the strategy's shardings
imply. Such a model's loss runs inside :func:`jax.sharding.explicit_axes` over the layout's mesh:
its parameters enter in the model's *own* specs (what its annotations say, before ZeRO adds the
data axes; ZeRO-3's all-gather is the reshard into them), the batch split over the data axes the
model names (:func:`model_batch_axes`; the others stay ``Auto`` around it), and the loss leaves as
a replicated scalar. Gradients flow back through the same
reshards, into the strategy's gradient layout. A model that runs without a mesh is left alone:
the explicit region is entered only when the plain call fails for want of one.

Example::

    >>> import jax, jax.numpy as jnp, optax, jaxpar
    >>> from flax import nnx
    >>> from jax.sharding import PartitionSpec as P
    >>> class Pinned(nnx.Module):
    ...     def __init__(self, rngs):
    ...         init = nnx.with_partitioning(nnx.initializers.normal(0.1), P("fsdp", "tensor"))
    ...         self.w = nnx.Param(init(rngs.params(), (8, 4)))
    ...     def __call__(self, x):
    ...         return jnp.einsum("bd,dh->bh", x, self.w[...], out_sharding=P(("data", "fsdp"), "tensor"))
    >>> mesh = jaxpar.make_mesh({"fsdp": 2, "tensor": 2}, devices=jax.devices()[:4])
    >>> state, layout = jaxpar.init_train_state(lambda: Pinned(nnx.Rngs(0)), optax.sgd(0.1), mesh)
    >>> loss = lambda model, batch: jnp.mean(model(batch["x"]) ** 2)
    >>> step = jaxpar.make_train_step(loss, optax.sgd(0.1), layout)
    >>> state, metrics = step(state, jaxpar.shard_batch({"x": jnp.ones((4, 8))}, mesh))
    >>> state.params["w"].sharding.spec
    P('fsdp', 'tensor')
"""

from __future__ import annotations

import contextlib
import re
import traceback
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple

import jax
from flax import nnx
from jax.sharding import PartitionSpec

from jaxpar.mesh import data_axes
from jaxpar.rules import axes_of, manual_axes, path_str, spec_without
from jaxpar.errors import ModelMeshError, ModelStateError

# What JAX says when a model pins a sharding by mesh axes under a mesh that does not allow it.
_SIGNS = ("not under a mesh context", "of type Auto", "AxisType", "Auto or Manual", "`out_sharding`",
          "out_sharding=", "explicit mesh", "Explicit axes")


def abstract_model(model_fn: Callable[[], nnx.Module]):
    """The model's structure, parameter shapes and logical annotations, without allocating it.

    Args:
      model_fn: builds the NNX model (every variable an ``nnx.Param``); it is only traced. An abstract model
        (``nnx.eval_shape``'s) is read as it is.

    Returns:
      ``(graphdef, shapes, logical)``: the ``nnx`` graph definition, a pure dict of
      ``ShapeDtypeStruct`` and one of ``PartitionSpec`` over logical names.

    Raises:
      ModelStateError: state that is not an ``nnx.Param``.

    Example:
      >>> from flax import nnx
      >>> from jaxpar.models._mlp import MLPClassifier
      >>> _, shapes, logical = abstract_model(lambda: MLPClassifier(4, 8, 8, 3, depth=1, rngs=nnx.Rngs(0)))
      >>> shapes["inp"]["kernel"].shape, logical["inp"]["kernel"]
      ((4, 8), P(None, 'embed'))
    """
    abs_model = model_fn
    if not isinstance(model_fn, nnx.Module):
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


def check_model_axes(logical: Any, rules, mesh) -> None:
    """Refuse a model that names mesh axes (JAX's explicit style) and also names an axis the mesh lacks.

    A model in that style (Flax's Gemma example: ``ShardingConfig.fsdp_tp_sharding(...)``) pins its
    parameters and its activations by the same names; a logical rule could place the parameters but
    not the activations' ``out_sharding``, so the names must be the mesh's.

    Args:
      logical: the parameters' annotated specs (``abstract_model``'s third output).
      rules: the logical rules, ``(name, mesh axes)`` pairs.
      mesh: the layout's mesh.

    Raises:
      ModelMeshError: quoting the parameter, its spec and the mesh's axes.
    """
    known = {name for name, _ in rules}
    leaves = jax.tree_util.tree_flatten_with_path(logical, is_leaf=lambda x: isinstance(x, PartitionSpec))[0]
    named = [(path, spec, [a for e in spec for a in axes_of(e)]) for path, spec in leaves]
    if not any(a in mesh.axis_names and a not in known for _, _, names in named for a in names):
        return                                           # logical names only: the rules' errors apply
    for path, spec, names in named:
        foreign = [a for a in names if a not in mesh.axis_names and a not in known]
        if foreign:
            raise ModelMeshError(
                f"parameter {path_str(path)!r}: the model's spec {spec} names {foreign[0]!r}, which is not an axis of "
                f"jaxpar's mesh {tuple(mesh.axis_names)} (sizes {dict(mesh.shape)}). The model names mesh axes "
                "(JAX's explicit-sharding style) in its parameters and in its activations' out_sharding alike, "
                f"so a rule for {foreign[0]!r} would place the parameters only: build the model with the mesh's axis "
                "names (for Flax's Gemma example, ShardingConfig.fsdp_tp_sharding(fsdp_axis_name='fsdp', "
                "tensor_parallel_axis_name='tensor')).")


def needs_explicit_mesh(error: BaseException) -> bool:
    """Whether ``error`` is JAX refusing a mesh-axis sharding for want of an ``Explicit`` mesh.

    Args:
      error: what calling the model raised.

    Returns:
      ``True`` for JAX's errors about a ``PartitionSpec`` outside a mesh context or over
      ``Auto`` axes.
    """
    text = str(error)
    return isinstance(error, (ValueError, TypeError, NotImplementedError)) and any(s in text for s in _SIGNS)


def explicit_call(fn: Callable, mesh, specs_of: Callable, auto: tuple[str, ...] = ()) -> Callable:
    """``fn(*args)`` run with ``mesh``'s axes ``Explicit`` (those a ``shard_map`` around the call has
    not made manual, and not in ``auto``), each argument entering in its spec.

    Args:
      fn: the function of a model's code that pins shardings by mesh axes.
      mesh: the layout's mesh.
      specs_of: ``(*args) -> specs``, a tuple with one ``PartitionSpec`` tree per argument; manual
        and ``auto`` axes are dropped from them.
      auto: mesh axes left ``Auto`` around the call (data axes the model does not name: XLA splits
        the batch over them as for any model).

    Returns:
      The same function, for use under ``jit`` with ``Auto`` axes, or inside a ``shard_map``
      (a pipeline stage) manual over some axes.

    >>> import jax, jax.numpy as jnp, jaxpar
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jaxpar.make_mesh({"data": 2}, devices=jax.devices()[:2])
    >>> f = lambda x: jnp.sum(jax.sharding.reshard(x * 2, P(None, "data")))
    >>> float(jax.jit(explicit_call(f, mesh, lambda x: (P("data", None),)))(jnp.ones((4, 2))))
    16.0
    """
    def run(*args):
        manual = manual_axes()
        specs = jax.tree.map(lambda sp: spec_without(sp, set(manual) | set(auto)), specs_of(*args),
                             is_leaf=lambda x: isinstance(x, PartitionSpec))
        axes = tuple(a for a in mesh.axis_names if a not in manual and a not in auto)
        inner = jax.sharding.explicit_axes(fn, axes=axes, in_sharding=specs)
        if manual:
            with _auto_axes_of(axes):
                return inner(*args)
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return inner(*args)

    return run


@contextlib.contextmanager
def _auto_axes_of(default: tuple[str, ...]) -> Iterator[None]:
    """``jax.sharding.auto_axes(f, out_sharding=...)`` with no ``axes`` means ``default`` here.

    JAX 0.10 reads a missing ``axes`` as every axis of the context mesh, manual ones too, and then
    refuses to turn a manual axis into an auto one ("Going from `Manual` AxisType to `Auto` ... is
    not allowed"). Flax calls it that way (``nnx.Embed(...)(x, out_sharding=...)``), so a model's
    embedding could not run inside a pipeline stage (manual over ``pipe``). The default is set
    only while jaxpar traces such a stage."""
    original = jax.sharding.auto_axes

    def patched(f=None, /, *, axes=None, out_sharding=None):
        return original(f, axes=default if axes is None else axes, out_sharding=out_sharding)

    jax.sharding.auto_axes = patched
    try:
        yield
    finally:
        jax.sharding.auto_axes = original


def batch_specs(batch: Any, mesh, axes: tuple[str, ...] | None = None) -> Any:
    """``P(axes, None, ...)`` for every leaf of ``batch``: the batch split over ``axes`` (default:
    the mesh's data axes).

    Args:
      batch: a pytree of arrays, batch first.
      mesh: the mesh.
      axes: the mesh axes of the batch dimension, or ``None``.

    Returns:
      A tree of ``PartitionSpec`` s mirroring ``batch``.
    """
    axes = data_axes(mesh) if axes is None else axes
    return jax.tree.map(lambda a: PartitionSpec(axes or None, *([None] * (a.ndim - 1))), batch)


def model_batch_axes(loss_of: Callable, own_specs: Any, params: Any, batch: Any, mesh) -> tuple[str, ...] | None:
    """The data axes a model that pins shardings by mesh axes splits its batch over.

    A model written to jaxpar's convention pins its activations' batch to all data axes
    (``("data", "fsdp")``); Flax's Gemma example pins it to ``fsdp`` alone. In JAX's explicit mode
    the model's arithmetic between the batch and its pinned activations is refused unless the
    specs agree, so the batch must enter as the model declares it. The loss is traced abstractly
    with the batch split over each candidate in turn (all data axes; then fewer, those the
    parameters' specs name first) and the first that traces is the model's. A data axis it leaves
    out stays ``Auto`` around the model (:func:`explicit_call`'s ``auto``): XLA splits the batch
    over it as for any model, so the step's collectives are the strategy's.

    Args:
      loss_of: ``(params, batch) -> scalar``.
      own_specs: the parameters' specs as the model annotates them.
      params: the parameters (arrays, tracers or ``ShapeDtypeStruct`` s).
      batch: one batch (shapes are enough).
      mesh: the layout's mesh.

    Returns:
      A sub-tuple of :func:`jaxpar.mesh.data_axes`, in mesh order; ``None`` if no candidate traces
      (the model's annotations conflict with the strategy's split of the batch).
    """
    last = batch_split_trials(loss_of, own_specs, params, batch, mesh)[-1]
    return last.axes if last.error is None else None


class SplitTrial(NamedTuple):
    """One split of the batch traced with a model's annotations.

    Attributes:
      axes: the data axes the batch's first dimension was split over.
      error: what JAX raised, or ``None`` when the loss traced.
    """
    axes: tuple[str, ...]
    error: BaseException | None


def batch_split_trials(loss_of: Callable, own_specs: Any, params: Any, batch: Any, mesh) -> list[SplitTrial]:
    """The candidate splits of :func:`model_batch_axes`, traced in turn up to the first that traces.

    Args:
      loss_of: ``(params, batch) -> scalar``.
      own_specs: the parameters' specs as the model annotates them.
      params: the parameters (arrays, tracers or ``ShapeDtypeStruct`` s).
      batch: one batch (shapes are enough).
      mesh: the layout's mesh.

    Returns:
      One :class:`SplitTrial` per split tried, in order; only the last may have traced.
    """
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), (params, batch))
    trials = []
    for candidate in _batch_candidates(data_axes(mesh), own_specs):
        try:
            jax.make_jaxpr(explicit_model_loss(loss_of, own_specs, mesh, candidate))(*abstract)
        except Exception as e:  # noqa: BLE001 - JAX's refusal of this split: try the next
            trials.append(SplitTrial(candidate, e))
            continue
        trials.append(SplitTrial(candidate, None))
        break
    return trials


def closest_trial(trials: list[SplitTrial]) -> SplitTrial:
    """The failed split whose trace got furthest through the model's code.

    Two failures are ordered by the user's frames that raised them, outermost first: at the first
    frame where they differ, the later line of the same function got further. Ties (the same line,
    a loop's later pass, different functions) keep the earlier candidate, the one that splits the
    batch over more of the axes the model's parameters name.

    Args:
      trials: :func:`batch_split_trials`' failures.

    Returns:
      One of ``trials``.
    """
    best = trials[0]
    for trial in trials[1:]:
        if _got_further(_user_frames(trial.error), _user_frames(best.error)):
            best = trial
    return best


def _got_further(a: list[traceback.FrameSummary], b: list[traceback.FrameSummary]) -> bool:
    """Whether the failure at user frames ``a`` came after the one at ``b`` (see :func:`closest_trial`)."""
    for fa, fb in zip(a, b):
        if (fa.filename, fa.name) != (fb.filename, fb.name):
            return False
        if fa.lineno != fb.lineno:
            return fa.lineno > fb.lineno
    return False


def _batch_candidates(axes: tuple[str, ...], own_specs: Any) -> list[tuple[str, ...]]:
    """Sub-tuples of ``axes``: the longest first, then those the parameter specs name more of."""
    specs = jax.tree.leaves(own_specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
    named = {a for sp in specs for e in sp for a in ((e,) if isinstance(e, str) else e or ())}
    subsets = [tuple(a for i, a in enumerate(axes) if mask >> i & 1) for mask in range(2 ** len(axes))]
    return sorted(subsets, key=lambda c: (-len(c), -len(named.intersection(c))))


def explicit_model_loss(loss_of: Callable, own_specs: Any, mesh, batch_axes: tuple[str, ...] | None = None
                        ) -> Callable:
    """``loss_of(params, batch)`` run with ``mesh``'s axes ``Explicit``.

    Args:
      loss_of: ``(params, batch) -> scalar``, the model rebuilt from ``params`` and scored.
      own_specs: the parameters' specs as the model annotates them (before ZeRO).
      mesh: the layout's mesh.
      batch_axes: the data axes the model splits its batch over (:func:`model_batch_axes`;
        default: all); the others stay ``Auto``.

    Returns:
      The same function, for use under ``jit`` with ``Auto`` axes.
    """
    axes = data_axes(mesh) if batch_axes is None else batch_axes
    auto = tuple(a for a in data_axes(mesh) if a not in axes)
    return explicit_call(loss_of, mesh, lambda params, batch: (own_specs, batch_specs(batch, mesh, axes)), auto)


class ModelLoss:
    """``loss_of(params, batch)`` that enters :func:`explicit_model_loss` when the model needs an
    explicit mesh.

    Args:
      loss_of: ``(params, batch) -> scalar``.
      mesh: the state's mesh.
      own_specs: ``() -> `` the parameters' specs as the model annotates them (before ZeRO), asked
        for only when the model needs the explicit mesh.
      sequence_parallel: the strategy's sequence parallelism (refused with such a model: its rule
        is on logical names the model does not use).

    Calling it returns the loss; it raises :class:`ModelMeshError` where the model cannot run with
    an explicit mesh (inside jaxpar's ``shard_map`` programs), naming the model's call site.
    :attr:`explicit` says whether a call has needed the explicit mesh.
    """

    def __init__(self, loss_of: Callable, mesh, own_specs: Callable[[], Any], *, sequence_parallel: bool = False):
        self._plain, self._mesh, self._own_specs, self._sp = loss_of, mesh, own_specs, sequence_parallel
        self._explicit: Callable | None = None
        self._refusal: BaseException | None = None      # what JAX said of the plain call
        self.batch_axes: tuple[str, ...] | None = ()     # the data axes the model splits its batch over
        self._failed: SplitTrial | None = None           # the closest split, when none traces

    @property
    def explicit(self) -> bool:
        return self._explicit is not None

    def __call__(self, params, batch):
        if self._explicit is None:
            try:
                return self._plain(params, batch)
            except Exception as plain:  # noqa: BLE001 - only JAX's mesh-context refusals are handled
                if not needs_explicit_mesh(plain):
                    raise
                if self._sp:
                    raise ModelMeshError(
                        f"sequence_parallel=True, but the model pins its activations by mesh axes itself (at "
                        f"{call_site(plain)}): jaxpar's sequence parallelism is a rule on its logical names "
                        "('norm_length'), which this model does not use, so it would be ignored. Pin the residual "
                        "stream to P(batch, 'tensor', None) in the model where you want it split, and leave "
                        "sequence_parallel False.") from plain
                own = self._own_specs()
                trials = batch_split_trials(self._plain, own, params, batch, self._mesh)
                traced = trials[-1].error is None
                self.batch_axes = trials[-1].axes if traced else None
                self._failed = None if traced else closest_trial(trials)
                self._explicit = explicit_model_loss(self._plain, own, self._mesh, self.batch_axes)   # None: all
                self._refusal = plain
        manual = jax.sharding.get_abstract_mesh().manual_axes     # in mesh order, for the message
        if manual:
            raise ModelMeshError(
                f"the model pins shardings by mesh axes (at {call_site(self._refusal)}), which JAX allows only with "
                "the mesh's axes Explicit. jaxpar runs such a model in its GSPMD program (data, fsdp and tensor "
                "axes, ZeRO, accumulation) and in pipeline stages; here it runs inside a shard_map manual over "
                f"{tuple(manual)} (compression, the noise scale, relaxed synchronisation or explicit_dp=True), where "
                "it cannot. Drop "
                "that option, or pin the model's activations with jaxpar.constrain and logical names instead. "
                f"JAX said: {_first_line(self._refusal)}") from self._refusal
        if self._failed is not None and _refuses_sharding(self._failed.error):
            raise self._conflict(self._failed.error, self._failed.axes) from self._failed.error
        try:
            return self._explicit(params, batch)
        except Exception as e:  # noqa: BLE001 - only JAX's sharding refusals are named
            if not _refuses_sharding(e):
                raise
            ran = data_axes(self._mesh) if self.batch_axes is None else self.batch_axes
            raise self._conflict(e, ran) from e

    def _conflict(self, error: BaseException, axes: tuple[str, ...]) -> ModelMeshError:
        split = _spec_text(axes)
        tried = (f"the model's annotations traced with the batch's first dimension in {split}"
                 ) if self.batch_axes is not None else (
                 f"no split of the batch over them (all, some or none) traces with the model's annotations; this is "
                 f"the failure under {split}, the split that got furthest")
        return ModelMeshError(
            f"the model's shardings conflict with jaxpar's at {call_site(error)}: JAX said: "
            f"{_first_line(error).rstrip('.')}. jaxpar splits the batch over the data axes {data_axes(self._mesh)} "
            f"of the mesh {dict(self._mesh.shape)}, and {tried}. {_advice(error, axes)}")


def _advice(error: BaseException, axes: tuple[str, ...]) -> str:
    """What to change in the model for the failure JAX reported."""
    if "gather" in str(error):
        spec = _whole_spec(str(error), axes)
        return ("A gather (take_along_axis, x[indices]) refuses an operand split on the dimension it gathers "
                "along, as in plain JAX: reshard the operand whole on that dimension first (for a loss over logits "
                f"split on the vocabulary: logits = jax.sharding.reshard(logits, {spec}) before take_along_axis).")
    return ("The model splits another dimension over an axis the strategy splits the batch over, or names different "
            "batch axes in different activations: pin every activation's batch dimension to the same data axes, and "
            "no other dimension to them.")


def _spec_text(axes: tuple[str, ...], *rest: str) -> str:
    """``P('fsdp', ...)``: a batch split over ``axes``, then ``rest``, as a user writes it."""
    return f"P({', '.join([repr(axes[0] if len(axes) == 1 else axes or None), *rest])})"


def _whole_spec(text: str, axes: tuple[str, ...]) -> str:
    """``P(batch, None, ...)`` of the rank of the gather's operand in JAX's message, else ``P(batch, ..., None)``."""
    match = re.search(r"operand=ShapedArray\(\w+\[([^\]]*)\]", text)
    rank = len(match.group(1).split(",")) if match else 0
    return _spec_text(axes, *["None"] * (rank - 1)) if rank > 1 else _spec_text(axes, "...", "None")


def _refuses_sharding(error: BaseException) -> bool:
    """Whether ``error`` is JAX refusing the shardings of an explicit-mode program."""
    return type(error).__name__ == "ShardingTypeError" or needs_explicit_mesh(error) or any(
        s in str(error) for s in ("not found in mesh", "cannot contain axis names", "incompatible shardings"))


def call_site(error: BaseException) -> str:
    """The model's line that raised ``error``: the one JAX names ("This error occurs at source:
    ..."), else the innermost frame of the traceback outside JAX, Flax and jaxpar.

    Args:
      error: the exception.

    Returns:
      ``"file:line (function)"`` or JAX's text for it; ``"an unknown line"`` when there is none.
    """
    text = str(error)
    mark = "This error occurs at source:"
    if mark in text:
        return text.split(mark, 1)[1].strip().splitlines()[0]
    frames = _user_frames(error)
    return f"{frames[-1].filename}:{frames[-1].lineno} ({frames[-1].name})" if frames else "an unknown line"


def _user_frames(error: BaseException) -> list[traceback.FrameSummary]:
    """The frames of ``error``'s traceback outside JAX, Flax and jaxpar, outermost first."""
    library = tuple(str(Path(m.__file__).parent) for m in (jax, nnx)) + (str(Path(__file__).parents[1]),)
    return [f for f in traceback.extract_tb(error.__traceback__) if not f.filename.startswith(library)]


def _first_line(error: BaseException) -> str:
    return str(error).strip().splitlines()[0][:300]
