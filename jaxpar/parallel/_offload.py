"""Memory offloading: the optimizer state, the fp32 master weights and named activations in host memory.

:class:`Offload` is ``Strategy.offload``'s value. Between steps the offloaded parts of the train state
live in ``pinned_host`` memory: their shardings (the step's ``in_shardings`` and ``out_shardings``, the
state's own, a checkpoint's restore target) carry that memory kind (:func:`host_state_shardings`). Inside
the step they are streamed to the device (:func:`stream_in`: ``jax.device_put`` to the ``device`` kind)
where the forward, the backward and the update read them, and the step's outputs go back to the host.
The arithmetic is the step's own, so an offloaded run equals the run without offload bit for bit.
Activations are offloaded by the remat policy ``"offload"`` (:func:`jaxpar.adapters.remat_policy`): the
residuals named in ``activations`` go to the host after the forward and come back for the backward.

Example::

    >>> o = Offload(optimizer=True, activations=("jaxpar_layer_input",))
    >>> o.fields, o.label
    (('opt_state',), 'offload-opt-act')
    >>> Offload(activations="mlp")
    Traceback (most recent call last):
    ...
    jaxpar.errors.OffloadError: Offload.activations='mlp': give a tuple of checkpoint_name names, e.g. ('jaxpar_layer_input',).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
from jax.sharding import NamedSharding

from jaxpar.adapters._blocks import OffloadedActivations
from jaxpar.errors import OffloadError

#: The memory kind the offloaded state lives in between steps, and the one it is computed in.
HOST, DEVICE = "pinned_host", "device"


@dataclass(frozen=True)
class Offload:
    """What lives in host memory (``Strategy.offload``).

    - ``optimizer``: the optimizer state (Adam's moments, counts) between steps;
    - ``master``: the parameters between steps. jaxpar keeps one copy of the parameters, the fp32 master
      (a bf16 ``compute_dtype`` casts it inside the step), so this is that copy: it is streamed to the
      device at the start of the step, the compute copy is cast there, and the update writes it back;
    - ``activations``: ``checkpoint_name`` names of residuals moved to host memory after the forward and
      back for the backward, under a model whose remat policy is ``"offload"``
      (:data:`jaxpar.adapters._blocks.LAYER_INPUT`: each layer's input, what a scan over the layers keeps).
    """

    optimizer: bool = False
    master: bool = False
    activations: tuple[str, ...] = ()

    def __post_init__(self):
        for key in ("optimizer", "master"):
            if not isinstance(getattr(self, key), bool):
                raise OffloadError(f"Offload.{key}={getattr(self, key)!r}: must be True or False.")
        names = self.activations
        if isinstance(names, str) or not isinstance(names, (tuple, list)) or \
                not all(isinstance(n, str) and n for n in names):
            raise OffloadError(f"Offload.activations={names!r}: give a tuple of checkpoint_name names, e.g. "
                               "('jaxpar_layer_input',).")
        object.__setattr__(self, "activations", tuple(names))
        if not (self.optimizer or self.master or self.activations):
            raise OffloadError("Offload() offloads nothing: set optimizer=True, master=True or activations=(...), "
                               "or leave Strategy.offload=None.")

    @property
    def fields(self) -> tuple[str, ...]:
        """The :class:`~jaxpar.step.TrainState` fields that live in host memory between steps."""
        return ("opt_state",) * self.optimizer + ("params",) * self.master

    @property
    def label(self) -> str:
        """The part of a strategy's name (``offload-opt-master-act``)."""
        return "-".join(["offload"] + ["opt"] * self.optimizer + ["master"] * self.master
                        + ["act"] * bool(self.activations))


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
    if offload is None or not offload.fields:
        return state
    return state._replace(**{f: jax.device_put(getattr(state, f), jax.tree.map(lambda s: with_kind(s, DEVICE),
                                                                                  getattr(shardings, f)))
                             for f in offload.fields})


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
                           "(GPTConfig / DecoderConfig.remat, YAML model.remat: offload), or drop the activations.")
    missing = [n for n in record.names if n not in record.seen]
    if missing:
        raise OffloadError(f"Strategy.offload.activations names {missing}, which no checkpoint_name inside the "
                           f"model's layers carries; the names there: {sorted(record.seen)}. Name a residual with "
                           "jax.ad_checkpoint.checkpoint_name(x, name), or offload those.")
