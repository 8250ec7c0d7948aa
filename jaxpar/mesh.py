"""Meshes from named axis sizes, hybrid ICI x DCN meshes; real accelerators or simulated CPU devices.

Example::

    >>> import jax, jaxpar
    >>> from jaxpar.mesh import use_devices
    >>> use_devices(8)        # first thing: the accelerators, else 8 CPU devices
    'cpu'
    >>> spec = jaxpar.MeshSpec(data=2, fsdp=-1, tensor=2)   # -1 = "the rest"
    >>> mesh = jaxpar.make_mesh(spec, devices=jax.devices()[:8])
    >>> dict(mesh.shape)
    {'pipe': 1, 'data': 2, 'fsdp': 2, 'tensor': 2}
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import jax
import numpy as np
from jax._src import hardware_utils
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh
from jaxpar.logical import AXES, CONTEXT, EXPERT, REPLICA, STANDARD_AXES
from jaxpar.errors import BackendStartedError, MeshError, check_int, int_problem

__all__ = ["STANDARD_AXES", "MeshSpec", "MeshError", "make_mesh", "simulate_cpu_devices", "use_devices",
           "accelerator_platform", "data_axes", "batch_axes", "replicas", "AXES", "REPLICA", "CONTEXT", "EXPERT"]


@dataclass(frozen=True)
class MeshSpec:
    """Named mesh axis sizes; one size may be -1 ("the rest of the devices").

    ``extra`` holds user-named axes (placed after the standard ones). ``expert > 1`` adds an
    ``expert`` axis just inside ``fsdp`` (expert parallelism, :mod:`jaxpar.parallel.moe`: the experts split
    over it, the batch too, so that its devices are data parallel for the other layers). ``context > 1`` adds a
    ``context`` axis just outside ``tensor`` (context parallelism, :mod:`jaxpar.parallel.context`: the
    sequence split over it; its ring traffic is per layer). ``replica > 1`` adds
    an outermost ``replica`` axis: K model replicas, each sharded over the other axes,
    synchronised as :mod:`jaxpar.parallel.sync` says (on several hosts give it ``dcn``).
    ``dcn`` gives, per axis, the factor that spans hosts (data-center network);
    the rest of the axis is within a host (ICI). Only used with several processes.

    >>> MeshSpec(data=2, tensor=4).sizes(8)["tensor"]
    4
    """

    data: int = 1
    fsdp: int = 1
    tensor: int = 1
    pipe: int = 1
    context: int = 1
    expert: int = 1
    extra: Mapping[str, int] = field(default_factory=dict)
    dcn: Mapping[str, int] = field(default_factory=dict)
    replica: int = 1

    def requested(self) -> dict[str, int]:
        sizes = {a: getattr(self, a) for a in AXES if a in STANDARD_AXES or getattr(self, a) != 1}
        for name, size in self.extra.items():
            if name in AXES:
                raise MeshError(f"MeshSpec.extra: axis name {name!r} clashes with a standard axis {STANDARD_AXES}; "
                                "choose another name.")
            sizes[name] = size
        return sizes

    def sizes(self, num_devices: int) -> dict[str, int]:
        """Resolve -1 and check that the product equals ``num_devices``.

        Args:
          num_devices: the number of devices the mesh spans.

        Returns:
          Axis name -> size, every axis present.
        """
        sizes = self.requested()
        for name, size in sizes.items():
            if not isinstance(size, (int, np.integer)) or isinstance(size, bool) or (size < 1 and size != -1):
                raise MeshError(f"MeshSpec.{name}={size!r}: each axis size must be a positive int or -1 "
                                "(-1 = the rest of the devices).")
        fill = [n for n, s in sizes.items() if s == -1]
        if len(fill) > 1:
            raise MeshError(f"MeshSpec: only one axis may be -1, got {fill}; give explicit sizes for all but one.")
        known = math.prod(s for s in sizes.values() if s != -1)
        if fill:
            if num_devices % known:
                raise MeshError(
                    f"MeshSpec: cannot fill axis {fill[0]!r}: the other axes multiply to {known}, "
                    f"which does not divide the {num_devices} devices. Sizes: {self._fmt(sizes)}.")
            sizes[fill[0]] = num_devices // known
        elif known != num_devices:
            raise MeshError(
                f"MeshSpec: axis sizes {self._fmt(sizes)} multiply to {known}, but there are "
                f"{num_devices} devices. Make the product equal {num_devices}, or set one axis to -1.")
        for name, d in self.dcn.items():
            if name not in sizes:
                raise MeshError(f"MeshSpec.dcn: unknown axis {name!r}; axes are {tuple(sizes)}.")
            if d < 1 or sizes[name] % d:
                raise MeshError(f"MeshSpec.dcn[{name!r}]={d}: must be a positive divisor of the axis size "
                                f"{sizes[name]}.")
        return sizes

    @staticmethod
    def _fmt(sizes: Mapping[str, int]) -> str:
        return ", ".join(f"{k}={v}" for k, v in sizes.items())


def make_mesh(spec: MeshSpec | Mapping[str, int], devices: Sequence[jax.Device] | None = None,
              *, axis_type: AxisType = AxisType.Auto) -> Mesh:
    """Build a ``jax.sharding.Mesh`` with axes ``('pipe', 'data', 'fsdp', 'tensor', *extra)``
    (``'replica'`` first when ``spec.replica > 1``).

    With several processes and ``spec.dcn`` set, the mesh is hybrid: each axis is
    ``dcn[axis]`` (across hosts) x the rest (within a host), so that the fast
    in-host links carry the inner axes.

    Args:
      spec: a ``MeshSpec``, or axis name -> size (missing axes are 1; one size may be -1).
      devices: the devices to lay out; all of ``jax.devices()`` when ``None``.
      axis_type: the ``AxisType`` of every axis (``Auto``: GSPMD propagation).

    Returns:
      The mesh.

    >>> import jax
    >>> mesh = make_mesh({"data": 2, "tensor": 2}, devices=jax.devices()[:4])
    >>> mesh.axis_names, mesh.devices.shape
    (('pipe', 'data', 'fsdp', 'tensor'), (1, 2, 1, 2))
    >>> make_mesh({"data": 3}, devices=jax.devices()[:4])
    Traceback (most recent call last):
    ...
    jaxpar.errors.MeshError: MeshSpec: axis sizes ... multiply to 3, but there are 4 devices. ...
    """
    if isinstance(spec, Mapping):
        spec = MeshSpec(**{k: v for k, v in spec.items() if k in AXES},
                        extra={k: v for k, v in spec.items() if k not in AXES})
    devices = list(jax.devices() if devices is None else devices)
    sizes = spec.sizes(len(devices))
    names = tuple(sizes)
    shape = tuple(sizes.values())
    if spec.dcn and jax.process_count() > 1:
        dcn_shape = tuple(spec.dcn.get(n, 1) for n in names)
        ici_shape = tuple(s // d for s, d in zip(shape, dcn_shape))
        if math.prod(dcn_shape) != jax.process_count():
            raise MeshError(f"MeshSpec.dcn: factors {dict(zip(names, dcn_shape))} multiply to "
                            f"{math.prod(dcn_shape)}, but there are {jax.process_count()} processes.")
        # Granules: TPU slices when the devices report several, else processes (CPU / GPU hosts).
        by_process = len({getattr(d, "slice_index", 0) for d in devices}) != math.prod(dcn_shape)
        grid = mesh_utils.create_hybrid_device_mesh(ici_shape, dcn_shape, devices=devices,
                                                    process_is_granule=by_process)
    else:
        try:
            grid = mesh_utils.create_device_mesh(shape, devices=devices)
        except (ValueError, NotImplementedError, AssertionError):
            grid = np.asarray(devices, dtype=object).reshape(shape)
    return Mesh(grid, names, axis_types=(axis_type,) * len(names))


def data_axes(mesh: Mesh) -> tuple[str, ...]:
    """The data-parallel axes of one model replica (``data`` and ``fsdp``, when present).

    Args:
      mesh: the mesh.

    Returns:
      The axis names, in mesh order.
    """
    return tuple(a for a in ("data", "fsdp") if a in mesh.axis_names)


def batch_axes(mesh: Mesh) -> tuple[str, ...]:
    """The mesh axes that split the global batch: ``replica`` (when present), then :func:`data_axes`,
    then ``expert`` (when present: expert-parallel devices are data parallel for the other layers).

    Args:
      mesh: the mesh.

    Returns:
      The axis names.
    """
    expert = (EXPERT,) if EXPERT in mesh.axis_names else ()
    return ((REPLICA,) if REPLICA in mesh.axis_names else ()) + data_axes(mesh) + expert


def replicas(mesh: Mesh) -> int:
    """The size of the ``replica`` axis (1 without it).

    Args:
      mesh: the mesh.

    Returns:
      The number of replicas.
    """
    return dict(mesh.shape).get(REPLICA, 1)


def simulate_cpu_devices(n: int) -> None:
    """Make JAX show ``n`` CPU devices. Call before anything touches the backend.

    With ``JAX_PLATFORMS`` unset it also selects the ``cpu`` platform (environment and
    live flag). Raises :class:`~jaxpar.errors.BackendStartedError` (a ``RuntimeError`` too) if the
    backend is already up with a different count (the count cannot change after initialisation;
    restart the process).

    Args:
      n: the number of CPU devices.

    Once the backend is up, asking for the count it has is a no-op, and any other count
    is an error:

    >>> import jax
    >>> jax.device_count()          # the backend is up (the tests simulate 8 CPU devices)
    8
    >>> simulate_cpu_devices(8)
    >>> simulate_cpu_devices(4)
    Traceback (most recent call last):
    ...
    jaxpar.errors.BackendStartedError: simulate_cpu_devices(4): the JAX backend is already initialised with 8 ...
    """
    check_int("simulate_cpu_devices", "n", n, 1, MeshError)
    if _backend_initialized():
        have = jax.device_count()
        if have != n:
            raise BackendStartedError(
                f"simulate_cpu_devices({n}): the JAX backend is already initialised with {have} "
                f"device(s). Call simulate_cpu_devices before any JAX computation (or set "
                f"XLA_FLAGS=--xla_force_host_platform_device_count={n} before starting Python), "
                "then restart the process / kernel.")
        return
    if _requested_platform() is None:
        os.environ["JAX_PLATFORMS"] = "cpu"          # read by jax at import: set the live flag too
        jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", n)


def use_devices(n_simulated: int = 8, *, detect: bool = True) -> str:
    """Use the accelerators when there are any, else simulate ``n_simulated`` CPU devices.

    The one place that decides between real devices and simulated CPU devices
    (notebooks, the CLI, :func:`jaxpar.devices.initialize`). Call it before
    anything touches JAX's backend; it never starts the backend itself. In order:

    1. the backend is already up: its platform (``simulate_cpu_devices`` checks the count);
    2. ``JAX_PLATFORMS`` (or ``jax.config.jax_platforms``) names a platform first: that
       one (``cpu`` -> simulate; ``cuda``, ``tpu``, ... -> its real devices);
    3. ``detect=True``: an installed accelerator plugin whose hardware is visible
       (:func:`accelerator_platform`); ``detect=False`` (the CLI's ``train.devices > 0``)
       skips this step, so only an explicit ``JAX_PLATFORMS`` wins over simulation;
    4. otherwise: ``n_simulated`` CPU devices (:func:`simulate_cpu_devices`).

    Args:
      n_simulated: the number of CPU devices to simulate when there is no accelerator.
      detect: look for an installed accelerator (step 3).

    Returns:
      The platform name (``"cpu"`` when simulating).

    >>> use_devices(8)    # here: no accelerator, so 8 simulated CPU devices
    'cpu'
    """
    if int_problem(n_simulated, 1) is not None:
        raise MeshError(f"use_devices(n_simulated={n_simulated!r}): must be a positive int "
                        "(the CPU devices to simulate when there is no accelerator), e.g. 8.")
    if _backend_initialized():
        platform = jax.default_backend()
        if platform != "cpu":
            return platform
    else:
        platform = _requested_platform() or (accelerator_platform() if detect else None)
        if platform is not None and platform != "cpu":
            return platform
    simulate_cpu_devices(n_simulated)
    return "cpu"


#: Installed modules that provide JAX's GPU plugins (found without importing them).
_CUDA_MODULES = ("jax_cuda13_plugin", "jax_cuda12_plugin")
_ROCM_MODULES = ("jax_rocm7_plugin", "jax_rocm6_plugin")


def accelerator_platform() -> str | None:
    """The accelerator an installed JAX plugin can drive on this machine, or None; starts no backend.

    ``"tpu"``: ``libtpu`` is installed (or ``TPU_LIBRARY_PATH`` is set) and TPU chips
    show on the PCI bus. ``"cuda"``: a CUDA plugin (``jax_cuda12_plugin``,
    ``jax_cuda13_plugin`` or a ``jax_plugins`` entry point naming cuda) is installed, an
    NVIDIA device node exists (``/dev/nvidia0``, ``/dev/nvidiactl``, ``/dev/dxg``) and
    ``CUDA_VISIBLE_DEVICES`` does not hide them all. ``"rocm"``: likewise with a ROCm
    plugin and an AMD GPU in the KFD topology. Other plugins are not guessed at: set
    ``JAX_PLATFORMS=<name>`` to use one.

    >>> accelerator_platform() in (None, "tpu", "cuda", "rocm")   # None: no accelerator here
    True
    """
    plugins = _installed_plugins()
    if ("libtpu" in plugins or os.environ.get("TPU_LIBRARY_PATH")) and _tpu_chips() > 0:
        return "tpu"
    if any("cuda" in p for p in plugins) and _nvidia_gpu_visible():
        return "cuda"
    if any("rocm" in p for p in plugins) and _amd_gpus() > 0:
        return "rocm"
    return None


def _backend_initialized() -> bool:
    from jax._src import xla_bridge

    return xla_bridge.backends_are_initialized()


def _requested_platform() -> str | None:
    """First entry of the live ``jax_platforms`` flag, else of ``JAX_PLATFORMS``; lower case; None if unset."""
    value = jax.config.jax_platforms or os.environ.get("JAX_PLATFORMS", "")
    first = value.split(",")[0].strip().lower()
    return first or None


def _installed_plugins() -> set[str]:
    """Lower-case names of installed JAX plugins: entry points, ``jax_plugins.*`` modules, known modules."""
    import importlib.metadata
    import importlib.util
    import pkgutil

    names: set[str] = set()
    try:
        for ep in importlib.metadata.entry_points(group="jax_plugins"):
            names.update((ep.name.lower(), ep.value.lower()))
    except Exception:                                    # a broken distribution's metadata: skip it
        pass

    def found(module: str):
        try:
            return importlib.util.find_spec(module)
        except (ImportError, ValueError):
            return None

    namespace = found("jax_plugins")
    if namespace is not None and namespace.submodule_search_locations:
        names.update(m.name.lower() for m in pkgutil.iter_modules(list(namespace.submodule_search_locations)))
    names.update(m for m in _CUDA_MODULES + _ROCM_MODULES + ("libtpu",) if found(m) is not None)
    return names


def _nvidia_gpu_visible() -> bool:
    if os.environ.get("CUDA_VISIBLE_DEVICES", "unset").strip() in ("", "-1"):
        return False
    return hardware_utils.has_visible_nvidia_gpu()


def _amd_gpus() -> int:
    return hardware_utils.num_available_amd_gpus(stop_at=1)


def _tpu_chips() -> int:
    return hardware_utils.num_available_tpu_chips_and_device_id()[0]
