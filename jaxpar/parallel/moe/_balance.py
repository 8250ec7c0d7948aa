"""The MoE layers' loads inside a train step: each layer reports its own and reads the whole step's.

The load-balancing loss's ``f`` is the load of the whole batch, so a step that splits its batch into
micro-batches runs a forward pre-pass that sums every layer's load over them and gives each
micro-batch's layers that load (:func:`use_step_loads`): the mean of the micro-batches' losses is then
the whole batch's, value and gradient.

:func:`balanced` numbers the MoE calls (*sites*) in the order the forward runs them: the next site at
the loss's own level, one per layer inside stacked layers (the layer runner carries the index, the
step's loads and the loads found so far beside the activation, through a scan or a pipeline). The
loss reports the loads ``[sites, E]`` as :data:`LAYER_LOADS`. :func:`probe` tells, from an abstract
trace, whether the loss uses the balancing loss and whether only as a sum with constant weights.

>>> import jax, jax.numpy as jnp
>>> from flax import nnx
>>> from jaxpar.parallel.moe import MoE
>>> layer = MoE(embed=4, mlp=8, experts=4, top_k=1, capacity_factor=None, rngs=nnx.Rngs(0))
>>> def loss(x):
...     y, stats = layer(x)
...     z, more = layer(y)
...     return jnp.mean(z) + 0.01 * (stats.aux_loss + more.aux_loss)
>>> found = probe(balanced(loss), jnp.ones((2, 3, 4)))
>>> found.loads.shape, found.aux_used, found.linear       # 2 sites of 4 experts
((2, 4), True, True)
>>> probe(balanced(lambda x: loss(x) ** 2), jnp.ones((2, 3, 4))).linear
False
"""
from __future__ import annotations

import contextvars
from typing import Any, Callable, ContextManager, NamedTuple

import jax
import jax.numpy as jnp
from jax._src.interpreters.partial_eval import dce_jaxpr

from jaxpar.adapters._blocks import LayerCall, current_layer_runner, use_layer_runner
from jaxpar.adapters._loss_metrics import collect_metrics, report_metric, with_reported_metrics
from jaxpar.rules import scoped
from jaxpar.errors import MoEError

#: The name under which a balanced loss reports its MoE layers' loads ``[sites, E]``.
LAYER_LOADS = "moe/layer_loads"


class Balance(NamedTuple):
    """What the step gives the MoE layers of a loss it traces: ``step``, the whole step's load per site
    ``[sites, E]`` (``None``: each call balances with its own load); ``taps``, ``[sites]`` zeros added to
    each site's balancing loss (:func:`probe` differentiates by them)."""

    step: Any = None
    taps: Any = None


_BALANCE: contextvars.ContextVar = contextvars.ContextVar("jaxpar_moe_balance", default=Balance())


def use_step_loads(loads: Any) -> ContextManager[Balance]:
    """Balance the MoE layers of the losses traced in this context with the whole step's loads.

    Args:
      loads: the step's loads ``[sites, E]`` (from its pre-pass); ``None``: each call with its own.

    Returns:
      A context manager yielding the :class:`Balance` in effect.
    """
    return scoped(_BALANCE, _BALANCE.get()._replace(step=loads))


_ROUTER_BIAS: contextvars.ContextVar = contextvars.ContextVar("jaxpar_moe_router_bias", default=None)


def use_router_bias(bias: Any) -> ContextManager[None]:
    """Give the losses traced in this context the aux-loss-free balancing bias of each MoE layer.

    Args:
      bias: ``[layers, E]``, one row per MoE call in the order the forward runs them (the sites of
        :func:`balanced`), kept in the train state and moved by the step
        (:mod:`jaxpar.step._router_bias`); ``None``: no bias.

    Returns:
      A context manager (:func:`jaxpar.parallel.moe.router_bias` reads the bias inside it).
    """
    return scoped(_ROUTER_BIAS, bias)


def step_bias() -> Any:
    """The bias of :func:`use_router_bias` (``None`` outside it), as it is: reading it marks nothing."""
    return _ROUTER_BIAS.get()


def _bias_rows(bias: Any, base: int, n: int) -> None:
    """A :class:`MoEError` when the sites ``base .. base + n - 1`` have no row in the bias."""
    if base + n > bias.shape[0]:
        raise MoEError(f"the loss runs at least {base + n} MoE layers that balance with the router bias, and the "
                       f"train state's bias has {bias.shape[0]} rows (shape {tuple(bias.shape)}): give "
                       "with_router_bias the shape (MoE layers, experts), one row per MoE call the forward makes.")


class _Trace:
    """One trace of a balanced loss: the sites' loads found so far (``None``: a site inside stacked
    layers, filled when they return) and the balance it was traced under."""

    def __init__(self, balance: Balance):
        self.balance, self.loads, self.experts = balance, [], None

    def reserve(self, n: int, experts: int) -> int:
        if self.experts not in (None, experts):
            raise MoEError(f"the loss runs MoE layers of {self.experts} and of {experts} experts; the step keeps one "
                           "load per layer and expert [layers, E], so every MoE layer of a model needs the same "
                           "number of experts. Give them the same experts=.")
        self.experts = experts
        self.loads.extend([None] * n)
        return len(self.loads) - n


_TRACE: contextvars.ContextVar = contextvars.ContextVar("jaxpar_moe_trace", default=None)


class _Slot:
    """The MoE calls of one stacked layer while it traces: its index and the rows of its carry. The
    carried rows are flat, ``[1, layers * calls * E]`` (``taps``: ``[1, layers * calls]``): a pipeline
    lays out a carried leaf whose leading size is the micro-batch's rows as activations."""

    def __init__(self, extra: dict | None, experts: list, calls: int = 0):
        self.extra, self.experts, self.loads, self.calls = extra, experts, [], calls

    def take(self, experts: int) -> tuple[Any, Any, Any]:
        j = len(self.experts)
        self.experts.append(experts)
        if self.extra is None:                       # counting the calls of one layer
            return None, None, None
        at = self.extra["index"] * self.calls + j
        row = lambda flat: None if flat is None else jax.lax.dynamic_slice(flat, (0, at * experts), (1, experts))[0]   # noqa: E731
        taps = self.extra.get("taps")
        return (row(self.extra.get("step")), None if taps is None else jax.lax.dynamic_slice(taps, (0, at), (1, 1))[0, 0],
                row(self.extra.get("bias")))


_SLOT: contextvars.ContextVar = contextvars.ContextVar("jaxpar_moe_slot", default=None)


def site_balance(experts: int) -> tuple[Any, Any, Callable[[jax.Array], None], Any]:
    """Take the next site for an MoE call.

    Args:
      experts: the call's number of experts.

    Returns:
      ``(balance_load, tap, record, bias)``: the step's load of its site ``[E]`` (``None``: its own),
      the zero its balancing loss adds (``None``: none), ``record(load)`` to report its load, and
      its row ``[E]`` of the router bias (:func:`use_router_bias`; ``None``: none). Outside a
      balanced loss: ``(None, None, a no-op, None)``.
    """
    slot = _SLOT.get()
    if slot is not None:
        load, tap, bias = slot.take(experts)
        return load, tap, slot.loads.append, bias
    trace = _TRACE.get()
    if trace is None:
        return None, None, lambda load: None, None
    site = trace.reserve(1, experts)
    b, bias = trace.balance, step_bias()
    pick = lambda rows: None if rows is None else rows[site]   # noqa: E731
    if bias is not None:
        _bias_rows(bias, site, 1)

    def record(load):
        trace.loads[site] = load

    return pick(b.step), pick(b.taps), record, pick(bias)


def _slotted(layer: Callable, calls: int) -> Callable:
    """``layer`` on ``(x, extra)``: its ``calls`` MoE calls read their rows of ``extra`` at
    ``extra["index"]`` and their loads go into ``extra["own"]``; the index moves on by one."""
    def run(p, carry):
        x, extra = carry
        slot = _Slot(extra, [], calls)
        with scoped(_SLOT, slot):
            y = layer(p, x)
        i, loads = extra["index"], jnp.concatenate(slot.loads).astype(extra["own"].dtype)
        own = jax.lax.dynamic_update_slice(extra["own"], loads[None], (0, i * loads.shape[0]))
        return y, {**extra, "own": own, "index": i + 1}
    return run


def _moe_calls(call: LayerCall) -> list[int]:
    """The experts of each MoE call one layer of ``call`` makes (an abstract trace)."""
    slot = _Slot(None, [])
    with scoped(_SLOT, slot), use_layer_runner(None):
        jax.eval_shape(call.source or call.layer, call.layer_shapes(), jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a)), call.x))
    return slot.experts


def _runner(trace: _Trace, inner: Callable | None) -> Callable:
    """The layer runner of a balanced loss: stacked layers with MoE calls carry their sites' rows."""
    def run(call: LayerCall):
        plain = lambda c: inner(c) if inner is not None else c.run()   # noqa: E731
        if _SLOT.get() is not None:
            raise MoEError("stacked layers run inside stacked layers: the step numbers MoE layers through one level "
                           "of jaxpar.run_layers / scan_blocks. Run the inner layers in a Python loop.")
        experts = _moe_calls(call)
        if not experts:
            return plain(call)
        L, m = jax.tree.leaves(call.params)[0].shape[0], len(experts)
        if len(set(experts)) > 1:
            trace.reserve(1, experts[0]), trace.reserve(1, experts[-1])   # names the mismatch
        base = trace.reserve(L * m, experts[0])
        b, n, e = trace.balance, L * m, experts[0]
        extra = {"index": jnp.zeros((), jnp.int32), "own": jnp.zeros((1, n * e), jnp.int32)}
        if b.step is not None:
            extra["step"] = jax.lax.dynamic_slice_in_dim(b.step, base, n, 0).reshape(1, n * e)
        if b.taps is not None:
            extra["taps"] = jax.lax.dynamic_slice_in_dim(b.taps, base, n, 0).reshape(1, n)
        if (bias := step_bias()) is not None:
            _bias_rows(bias, base, n)
            extra["bias"] = jax.lax.dynamic_slice_in_dim(bias, base, n, 0).reshape(1, n * e)
        y, extra = plain(LayerCall(call.rewrap(lambda layer: _slotted(layer, m)), call.params, call.logical, (call.x, extra), call.remat,
                                   call.scan, call.closure))
        own = extra["own"].reshape(n, e)
        for r in range(n):
            trace.loads[base + r] = own[r]
        return y
    return run


def balanced(loss_of: Callable) -> Callable:
    """``loss_of`` (any ``(*args) -> loss``) traced with its MoE layers numbered (see the module
    docstring): they balance by :func:`use_step_loads`' loads, and the loss reports theirs as
    :data:`LAYER_LOADS` ``[sites, E]`` (:func:`jaxpar.report_metric`).

    Args:
      loss_of: the loss.

    Returns:
      The loss with the same arguments and value.
    """
    def run(*args):
        trace = _Trace(_BALANCE.get())
        with scoped(_TRACE, trace), scoped(_SLOT, None), use_layer_runner(_runner(trace, current_layer_runner())):
            loss = loss_of(*args)
        if trace.loads:
            report_metric(LAYER_LOADS, jnp.stack([jnp.asarray(a, jnp.float32) for a in trace.loads]))
        return loss
    return run


def reported_loads(fn: Callable) -> Callable:
    """The loads a balanced loss reports.

    Args:
      fn: a balanced loss ``fn(*args)`` (:func:`balanced`).

    Returns:
      ``(*args) -> what fn(*args) reports as`` :data:`LAYER_LOADS` ``[sites, E]`` (``None`` if it
      reports none).
    """
    return lambda *args: with_reported_metrics(fn)(*args)[1].get(LAYER_LOADS)


class Probe(NamedTuple):
    """What :func:`probe` found: ``loads``, the shape of the reported loads (``None``: no MoE layer);
    ``aux_used``, whether the loss's value depends on the step's loads (through the balancing loss);
    ``linear``, whether the loss is a sum of the balancing losses with constant weights plus the rest."""

    loads: Any
    aux_used: bool
    linear: bool


def _uses_inputs(fn: Callable, *args) -> list[bool]:
    """Which arguments' leaves ``fn``'s outputs depend on (JAX's dead-code elimination of its jaxpr)."""
    closed = jax.make_jaxpr(fn)(*args)
    _, used = dce_jaxpr(closed.jaxpr, [True] * len(closed.jaxpr.outvars))
    return used


def probe(loss_of: Callable, *args: Any) -> Probe:
    """Trace a balanced loss abstractly to learn its sites and how it uses their balancing losses.

    Args:
      loss_of: a balanced loss (:func:`balanced`).
      *args: its arguments: arrays or ``jax.ShapeDtypeStruct``.

    Returns:
      A :class:`Probe`.
    """
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a)), args)
    with use_step_loads(None):
        loads = jax.eval_shape(reported_loads(loss_of), *abstract)
    if loads is None:
        return Probe(None, False, True)
    sites = loads.shape[0]

    def value(step, taps, *a):
        with scoped(_BALANCE, Balance(step, taps)), collect_metrics():    # what it reports stays here
            return loss_of(*a)

    step = jax.ShapeDtypeStruct(loads.shape, jnp.float32)
    taps = jax.ShapeDtypeStruct((sites,), jnp.float32)
    aux_used = _uses_inputs(value, step, taps, *abstract)[0]
    linear = not any(_uses_inputs(jax.grad(value, argnums=1), step, taps, *abstract))
    return Probe(loads, aux_used, linear)


def prepass_loads(loads_of: Callable, microbatches: Any, like: Any) -> jax.Array:
    """The whole step's loads, summed over its micro-batches in a ``lax.scan`` (a forward each).

    Args:
      loads_of: ``loads_of(mb) -> [sites, E]`` (e.g. :func:`reported_loads` of the loss).
      microbatches: the micro-batches stacked on a leading axis.
      like: an array or shape struct of the loads' shape ``[sites, E]``.

    Returns:
      float32 ``[sites, E]``, without gradient.
    """
    total, _ = jax.lax.scan(lambda acc, b: (acc + loads_of(b), None), jnp.zeros(like.shape, jnp.float32),
                            microbatches)
    return jax.lax.stop_gradient(total)
