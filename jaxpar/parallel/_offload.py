"""Memory offloading: the optimizer state, the fp32 master weights and named activations in host memory.

:class:`~jaxpar.options.Offload` is ``Strategy.offload``'s value. Between steps the offloaded parts of the
train state live in ``pinned_host`` memory: their shardings (the step's ``in_shardings`` and ``out_shardings``, the
state's own, a checkpoint's restore target) carry that memory kind (:func:`host_state_shardings`). Inside
the step they are streamed to the device (:func:`stream_in`: ``jax.device_put`` to the ``device`` kind)
where the forward, the backward and the update read them, and the step's outputs go back to the host.
The arithmetic is the step's own, so an offloaded run equals the run without offload bit for bit.
Activations are offloaded by the remat policy ``"offload"`` (:func:`jaxpar.adapters.remat_policy`): the
residuals named in ``activations`` go to the host after the forward and come back for the backward.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import jax
from jax.experimental.compute_on import compute_on
from jax.sharding import NamedSharding

from jaxpar.adapters._blocks import OffloadedActivations
from jaxpar.errors import OffloadError
from jaxpar.options import Offload

#: The memory kind the offloaded state lives in between steps, and the one it is computed in.
HOST, DEVICE = "pinned_host", "device"
#: Whether ``compute_on`` is a transform that names its outputs' memory spaces (jax 0.11) or a context manager.
_COMPUTE_ON_TRANSFORM = "out_memory_spaces" in inspect.signature(compute_on).parameters


def with_kind(sharding: NamedSharding, kind: str) -> NamedSharding:
    """``sharding`` in the memory ``kind``. Devices that list no memories (a compile target's abstract
    devices) drop a memory kind from a sharding over them; there the sharding is over the mesh's
    abstract mesh, which keeps it (lower under ``jax.set_mesh(mesh)``).

    Args:
      sharding: a ``NamedSharding``.
      kind: ``"pinned_host"`` or ``"device"``.

    Returns:
      The sharding with that memory kind.
    """
    out = sharding.with_memory_kind(kind)
    if out.memory_kind == kind or not isinstance(sharding.mesh, jax.sharding.Mesh):
        return out
    return NamedSharding(sharding.mesh.abstract_mesh, sharding.spec, memory_kind=kind)


def host_state_shardings(shardings: Any, offload: Offload | None) -> Any:
    """The train state's shardings with the offloaded fields in host memory.

    Args:
      shardings: a ``TrainState`` of ``NamedSharding``s.
      offload: ``Strategy.offload``.

    Returns:
      The same ``TrainState``, the fields of :attr:`Offload.fields` in ``pinned_host``.
    """
    if offload is None or not offload.fields:
        return shardings
    return shardings._replace(**{f: jax.tree.map(lambda s: with_kind(s, HOST), getattr(shardings, f))
                                 for f in offload.fields})


def stream_in(state: Any, shardings: Any, offload: Offload | None) -> Any:
    """Inside a step: the offloaded fields of ``state`` copied to device memory (``jax.device_put``).

    Args:
      state: the ``TrainState`` as the step received it.
      shardings: its shardings (a ``TrainState`` of ``NamedSharding``s, host kinds included).
      offload: ``Strategy.offload``.

    Returns:
      The state with every field in device memory.
    """
    if offload is None or not offload.streamed:
        return state
    return state._replace(**{f: _put(getattr(state, f), getattr(shardings, f), DEVICE) for f in offload.streamed})


def _put(tree: Any, shardings: Any, kind: str) -> Any:
    """``tree`` copied to the memory ``kind`` in its ``shardings``' layout (inside a program)."""
    return jax.device_put(tree, jax.tree.map(lambda s: with_kind(s, kind), shardings))


def host_placement(shardings: Any, offload: Offload | None) -> Callable | None:
    """Where the update's arithmetic runs under ``Offload.update="host"``: ``place(optimize, grads, opt_state,
    params, *scalars)`` copies the gradients, the parameters and the scalars (the clip's scale, the skip
    rule's flag) to host memory, runs ``optimize`` there (``jax.experimental.compute_on("device_host")``: XLA
    compiles it for the host's CPU, each device's host on its own shard) on the host-resident optimizer
    state, and returns each result in the memory kind its input came in. (Under ``master`` the parameters
    come in as the device copy the step streamed in: XLA reads the host original and keeps the result there.)

    Args:
      shardings: the state's shardings (a ``TrainState`` of ``NamedSharding``s, host kinds included).
      offload: ``Strategy.offload``.

    Returns:
      ``place``, or None where the update runs on the device (:func:`jaxpar.step._update.apply_update`'s own).
    """
    if offload is None or not offload.host_update:
        return None

    def place(optimize: Callable, grads: Any, opt_state: Any, params: Any, *scalars: Any) -> tuple[Any, Any, Any]:
        back = lambda tree, like, where: jax.tree.map(    # noqa: E731  (each output to its input's memory kind)
            lambda x, old, s: jax.device_put(x, with_kind(s, _kind(old))), tree, like, where)
        old_params, old_opt, kind = params, opt_state, _kind(scalars[0]) if scalars else None
        grads, params = _put(grads, shardings.params, HOST), _put(params, shardings.params, HOST)
        scalars = [jax.device_put(x, with_kind(shardings.step, HOST)) for x in scalars]
        try:
            new_params, new_opt, ok = on_host(jax.jit(optimize))(grads, opt_state, params, *scalars)
        except ValueError as e:
            if "memory_space of all inputs" not in str(e):
                raise
            raise OffloadError(f"Strategy.offload.update='host': the optimizer's update does not run in host "
                               f"memory ({e}; it mixes its host-resident inputs with arrays it creates on the "
                               "device). Use Offload(update='device').") from None
        ok = None if ok is None else jax.device_put(ok, with_kind(shardings.step, kind))
        return back(new_params, old_params, shardings.params), back(new_opt, old_opt, shardings.opt_state), ok

    return place


def on_host(fn: Callable) -> Callable:
    """``fn`` run by the host, its results in host memory: ``jax.experimental.compute_on("device_host")``, a
    context manager up to jax 0.10 and a transform that names its outputs' memory spaces from jax 0.11.

    Args:
      fn: a jitted function.

    Returns:
      A function of the same arguments.
    """
    if _COMPUTE_ON_TRANSFORM:
        return compute_on(fn, compute_type="device_host", out_memory_spaces=jax.memory.Space.Host)

    def run(*args):
        with compute_on("device_host"):
            return fn(*args)
    return run


def _kind(x: Any) -> str:
    """The memory kind of a traced array."""
    return HOST if jax.typeof(x).memory_space == jax.memory.Space.Host else DEVICE


def check_activations(record: OffloadedActivations) -> None:
    """After a step's trace: the activations it was asked to offload were offloaded.

    Args:
      record: what the trace asked (:func:`jaxpar.adapters._blocks.use_offloaded_activations`).

    Raises:
      OffloadError: no layer ran under the ``"offload"`` remat policy, or a name met no ``checkpoint_name``.
    """
    if not record.names:
        return
    if not record.policies:
        raise OffloadError(f"Strategy.offload.activations={record.names}: no layer of the model ran under the "
                           "remat policy 'offload', so nothing would be offloaded. Set the model's remat='offload' "
                           "(GPTConfig / DecoderConfig.remat, YAML model.remat: offload); in a model of your own, "
                           "call jaxpar.scan_blocks(blocks, x, remat=jaxpar.adapters.remat_policy('offload')) in its "
                           "__call__ (made there, during the step's trace, the policy sees these names; made once "
                           "in __init__, it saves nothing); or drop the activations.")
    missing = [n for n in record.names if n not in record.seen]
    if missing:
        raise OffloadError(f"Strategy.offload.activations names {missing}, which no checkpoint_name inside the "
                           f"model's layers carries; the names there: {sorted(record.seen)}. Name a residual with "
                           "jax.ad_checkpoint.checkpoint_name(x, name), or offload those.")
