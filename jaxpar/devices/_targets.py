"""Real GPU and TPU targets without the hardware: device descriptions as data, and their devices.

XLA's GPU and TPU compilers run on a machine with neither (deviceless ahead-of-time compilation):
given a description of the device and a topology, :func:`jax.experimental.topologies.get_topology_desc`
returns abstract devices; a ``Mesh`` over them, and ``jax.jit(f).lower(abstract args).compile()``,
builds the real executable, with the real collective combining, async collectives, latency-hiding
scheduler and memory assignment. Only running it needs the hardware.

A :class:`Target` is a preset (``configs/targets/*.yaml``: :func:`presets`) and a topology, written
as a string (:func:`parse_target`):

* ``h100:2x8``: 2 hosts x 8 GPUs (``h100:8`` = ``h100:1x8``; ``h100`` = one host of the preset's
  ``gpus_per_host``);
* ``tpu-v5e:4x4``, ``tpu-v5p:2x2x4``: the chips of one slice (libtpu's topology);
  ``2xtpu-v5e:16x16``: two such slices.

The compilers live in a directory of their own, off ``sys.path`` (:func:`targets_dir`; ``make targets``
or :func:`install_command` installs them): installed beside jax, every ``import jax`` would load them
and print their errors for the hardware that is not there. :func:`target_devices` loads them into the
process on the first target (JAX's plugin start-up, done on demand); without them it raises a
:class:`TargetError` that gives the command.

Example:
    >>> t = parse_target("h100:2x8")
    >>> t.num_devices, t.num_hosts, t.spec.platform, str(t)
    (16, 2, 'cuda', 'h100:2x8')
    >>> parse_target("2xtpu-v5e:4x4").num_devices
    32
    >>> round(t.capacity_bytes / 2**30, 1)      # what JAX lets a program use: 75% of 79.1 GiB by default
    59.3
    >>> parse_target("h101:8")
    Traceback (most recent call last):
    ...
    jaxpar.errors.TargetError: target 'h101:8': unknown device 'h101'; presets: a100-80gb, b200, h100, h200, tpu-v5e, tpu-v5p, tpu-v6e (configs/targets/), or the path of a target YAML file.
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.metadata as md
import importlib.util
import math
import os
import re
import shlex
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import jax

from jaxpar.cost._capacity import Capacity, device_capacity, memory_fraction_problem
from jaxpar.errors import TargetError

#: Where the preset YAML files live (``configs/targets`` of the repository).
PRESET_DIR = Path(__file__).resolve().parents[2] / "configs" / "targets"
#: The environment variable that moves the compilers' directory (:func:`targets_dir`).
TARGETS_DIR_ENV = "JAXPAR_TARGETS_DIR"


@dataclass(frozen=True)
class DeviceSpec:
    """One kind of device, as a preset describes it (``configs/targets/<name>.yaml``).

    Attributes:
      name: the preset's name (``h100``, ``tpu-v5e``).
      platform: ``cuda`` or ``tpu``.
      device: the device kind the runtime reports (``NVIDIA H100 80GB HBM3``).
      memory_bytes: the device memory.
      cluster: the cost model's cluster preset (``configs/clusters/``) for this device.
      sources: where the numbers come from.
      gpu: the GPU compiler's device description (``cuda``): compute capability, cores, bandwidth...
      gpus_per_host: GPUs per host (``cuda``).
      topology_name: libtpu's name of the chip (``tpu``: ``v5e``).
      chips_per_host_bounds: chips per host (``tpu``).
    """

    name: str
    platform: str
    device: str
    memory_bytes: int
    cluster: str
    sources: tuple[str, ...] = ()
    gpu: Mapping[str, Any] = field(default_factory=dict)
    gpus_per_host: int = 8
    topology_name: str = ""
    chips_per_host_bounds: tuple[int, ...] = (2, 2, 1)


@dataclass(frozen=True)
class Target:
    """A device kind and a topology (see the module docstring).

    Attributes:
      spec: the device kind.
      shape: ``(hosts, gpus per host)`` for GPUs; the chip grid of one slice for TPUs.
      slices: TPU slices (1 for GPUs).
    """

    spec: DeviceSpec
    shape: tuple[int, ...]
    slices: int = 1

    def __str__(self) -> str:
        prefix = f"{self.slices}x" if self.slices > 1 else ""
        return f"{prefix}{self.spec.name}:{'x'.join(map(str, self.shape))}"

    @property
    def num_devices(self) -> int:
        """The devices of the whole target."""
        return math.prod(self.shape) * self.slices

    @property
    def num_hosts(self) -> int:
        """The hosts (processes) the target's devices belong to."""
        if self.spec.platform == "cuda":
            return self.shape[0]
        return self.slices * max(1, math.prod(self.shape) // math.prod(self.spec.chips_per_host_bounds))

    @property
    def capacity(self) -> Capacity:
        """The memory one program may use on a device: the one capacity rule of every command
        (:func:`jaxpar.cost._capacity.device_capacity`): on GPUs JAX's share (``XLA_PYTHON_CLIENT_MEM_FRACTION``,
        default 0.75) of the device bytes, on TPUs the whole HBM.

        Raises:
          TargetError: ``XLA_PYTHON_CLIENT_MEM_FRACTION`` is no fraction.
        """
        if why := memory_fraction_problem():
            raise TargetError(why)
        return device_capacity(self.spec.memory_bytes, self.spec.platform)

    @property
    def capacity_bytes(self) -> int:
        """The usable bytes of :attr:`capacity`."""
        return int(self.capacity.usable)


def presets() -> dict[str, Path]:
    """``{preset name: YAML path}`` of ``configs/targets/`` (the file stem is the name).

    Returns:
      The presets, sorted by name.
    """
    return {p.stem: p for p in sorted(PRESET_DIR.glob("*.yaml"))} if PRESET_DIR.is_dir() else {}


def load_spec(name: str | Path, *, where: str = "") -> DeviceSpec:
    """The :class:`DeviceSpec` of a preset name or a YAML file.

    Args:
      name: a preset (:func:`presets`) or the path of a target YAML file.
      where: the text that named it, for errors (default: ``name``).

    Returns:
      The device spec.

    Raises:
      TargetError: an unknown preset, or a file without the fields a spec needs.
    """
    import yaml

    path = presets().get(str(name)) or Path(name)
    if not path.is_file():
        raise TargetError(f"target {where or name!r}: unknown device {str(name)!r}; presets: "
                          f"{', '.join(presets())} (configs/targets/), or the path of a target YAML file.")
    d = yaml.safe_load(path.read_text()) or {}
    known = {f for f in DeviceSpec.__dataclass_fields__}
    missing = [k for k in ("name", "platform", "device", "memory_bytes", "cluster") if k not in d]
    unknown = sorted(set(d) - known)
    if missing or unknown or d.get("platform") not in ("cuda", "tpu"):
        raise TargetError(f"target file {path}: needs name, platform (cuda or tpu), device, memory_bytes and cluster; "
                          f"missing {missing}, unknown keys {unknown}, platform={d.get('platform')!r}.")
    d["sources"] = tuple(d.get("sources", ()))
    d["chips_per_host_bounds"] = tuple(d.get("chips_per_host_bounds", (2, 2, 1)))
    return DeviceSpec(**d)


_TARGET = re.compile(r"^(?:(\d+)x(?=\D))?([^:]+?)(?::(\d+(?:x\d+)*))?$")


def has_fp8_gemms(spec: DeviceSpec) -> bool:
    """Whether the device runs FP8 GEMMs: an NVIDIA GPU of compute capability 8.9 or newer (Ada, Hopper,
    Blackwell: h100, h200, b200). A100 (8.0) and TPU v5e, v5p and v6e have none.

    Args:
      spec: the device kind.

    Returns:
      True or False.

    >>> has_fp8_gemms(load_spec("h100")), has_fp8_gemms(load_spec("a100-80gb")), has_fp8_gemms(load_spec("tpu-v5e"))
    (True, False, False)
    """
    return spec.platform == "cuda" and tuple(spec.gpu.get("compute_capability", (0, 0))) >= (8, 9)


def fp8_problem(spec: DeviceSpec, setting: str = "parallel.fp8") -> str | None:
    """Why FP8 matmuls cannot run on this device kind (None: they can).

    Args:
      spec: the device kind.
      setting: how the caller names the FP8 option (``parallel.fp8``, ``Strategy.fp8``).

    Returns:
      The problem, naming the device, the option and the fix, or None.

    >>> fp8_problem(load_spec("h100")) is None
    True
    >>> print(fp8_problem(load_spec("tpu-v5e")))
    target tpu-v5e has no FP8 GEMMs: parallel.fp8 runs the covered matmuls as FP8 GEMMs, which TPU v5 lite does not have; turn parallel.fp8 off (parallel.fp8={}) or choose b200 / h100 / h200.
    """
    if has_fp8_gemms(spec):
        return None
    fp8 = " / ".join(n for n in presets() if has_fp8_gemms(load_spec(n)))
    return (f"target {spec.name} has no FP8 GEMMs: {setting} runs the covered matmuls as FP8 GEMMs, which "
            f"{spec.device} does not have; turn {setting} off ({setting}={{}}) or choose {fp8}.")


def topology_problem(target: Target) -> str | None:
    """Why libtpu rejects the target's chip grid (None: it takes it; GPU topologies are always taken):
    a slice is whole hosts, so each of its sizes must be a multiple of the preset's
    ``chips_per_host_bounds`` (libtpu's own rule, decided here without the compiler; tests/test_targets.py
    checks it against libtpu).

    Args:
      target: the target.

    Returns:
      The problem, naming the target, the hosts' chips and a topology that is taken, or None.

    >>> topology_problem(parse_target("tpu-v5e:4x4")) is None, topology_problem(parse_target("h100:3x5")) is None
    (True, True)
    >>> print(topology_problem(parse_target("tpu-v5e:3x3")))
    target tpu-v5e:3x3: a TPU slice is whole hosts of 2x2x1 chips (chips_per_host_bounds of tpu-v5e), so each size of its chip grid must be a multiple of that host's; 3x3 is not: choose e.g. tpu-v5e:4x4 (docs/targets.md).
    """
    bounds = target.spec.chips_per_host_bounds
    shape = tuple(target.shape) + (1,) * (len(bounds) - len(target.shape))
    if target.spec.platform != "tpu" or (len(shape) == len(bounds) and all(s % b == 0 for s, b in zip(shape, bounds))):
        return None
    fit = Target(target.spec, tuple(_whole_hosts(shape, bounds, len(target.shape))), target.slices)
    return (f"target {target}: a TPU slice is whole hosts of {'x'.join(map(str, bounds))} chips "
            f"(chips_per_host_bounds of {target.spec.name}), so each size of its chip grid must be a multiple of "
            f"that host's; {'x'.join(map(str, target.shape))} is not: choose e.g. {fit} (docs/targets.md).")


def _whole_hosts(shape: tuple[int, ...], bounds: tuple[int, ...], dims: int) -> list[int]:
    """The smallest chip grid of whole hosts that holds ``shape`` (as many sizes as it had, ``dims``, where
    the rest are 1); the hosts' own for a grid of more sizes than they have."""
    if len(shape) != len(bounds):
        return list(bounds)
    fit = [-(-s // b) * b for s, b in zip(shape, bounds)]
    while len(fit) > max(dims, 1) and fit[-1] == 1:
        fit.pop()
    return fit


def parse_target(text: str) -> Target:
    """The :class:`Target` a string names (grammar in the module docstring).

    Args:
      text: ``DEVICE[:TOPOLOGY]`` with an optional ``Nx`` prefix (TPU slices), or a YAML path.

    Returns:
      The target.

    Raises:
      TargetError: an unknown device, or a topology that does not fit it.
    """
    m = _TARGET.match(text.strip())
    if not m:
        raise TargetError(f"target {text!r}: write DEVICE[:TOPOLOGY], e.g. h100:2x8 (2 hosts x 8 GPUs), "
                          f"tpu-v5e:4x4, or 2xtpu-v5e:16x16 (2 slices).")
    slices, name, topo = m.groups()
    spec = load_spec(name, where=text)
    shape = tuple(int(s) for s in topo.split("x")) if topo else ()
    if spec.platform == "cuda":
        return Target(spec, _gpu_shape(text, spec, shape, int(slices or 1)))
    if not shape:
        raise TargetError(f"target {text!r}: a TPU target needs its chip topology, e.g. {spec.name}:4x4 "
                          f"(libtpu's {spec.topology_name}:4x4).")
    return Target(spec, shape, int(slices or 1))


def _gpu_shape(text: str, spec: DeviceSpec, shape: tuple[int, ...], slices: int) -> tuple[int, int]:
    if slices != 1:
        raise TargetError(f"target {text!r}: the Nx prefix counts TPU slices; for GPUs write HOSTSxGPUS, "
                          f"e.g. {spec.name}:{slices}x{spec.gpus_per_host}.")
    shape = shape or (1, spec.gpus_per_host)
    shape = (1, *shape) if len(shape) == 1 else shape
    if len(shape) != 2 or min(shape) < 1:
        raise TargetError(f"target {text!r}: a GPU topology is HOSTSxGPUS (e.g. {spec.name}:2x8) or GPUS "
                          f"(one host), got {'x'.join(map(str, shape))}.")
    return shape


def gpu_target_config(spec: DeviceSpec) -> str:
    """The GPU compiler's device description (a ``GpuTargetConfigProto`` in text form) of a spec.

    Args:
      spec: a ``cuda`` device spec.

    Returns:
      The text proto that ``get_topology_desc(target_config=...)`` takes.
    """
    g = spec.gpu
    major, minor = g["compute_capability"]
    dnn = list(g.get("dnn_version", (9, 0, 0))) + [0, 0]
    fields = dict(threads_per_block_limit=1024, threads_per_warp=32, shared_memory_per_block=49152,
                  shared_memory_per_core=g["shared_memory_per_core"], threads_per_core_limit=2048,
                  core_count=g["core_count"], fpus_per_core=g["fpus_per_core"], block_dim_limit_x=2147483647,
                  block_dim_limit_y=65535, block_dim_limit_z=65535, memory_bandwidth=g["memory_bandwidth"],
                  l2_cache_size=g["l2_cache_size"], clock_rate_ghz=g["clock_rate_ghz"],
                  device_memory_size=spec.memory_bytes,
                  shared_memory_per_block_optin=g["shared_memory_per_block_optin"],
                  registers_per_core_limit=65536, registers_per_block_limit=65536)
    body = "\n".join(f"  {k}: {v}" for k, v in fields.items())
    return (f"gpu_device_info {{\n{body}\n  cuda_compute_capability {{ major: {major} minor: {minor} }}\n}}\n"
            f'platform_name: "CUDA"\ndnn_version_info {{ major: {dnn[0]} minor: {dnn[1]} patch: {dnn[2]} }}\n'
            f'device_description_str: "{spec.device}"\n')


def targets_dir() -> Path:
    """The directory the compilers are installed in: ``$JAXPAR_TARGETS_DIR``, else ``jaxpar-targets`` in the
    Python environment (``.venv/jaxpar-targets`` of a checkout). It is not on ``sys.path``: the first
    target puts it there (last), in the process that asks for it only.

    Returns:
      The directory (it may not exist).
    """
    return Path(os.environ.get(TARGETS_DIR_ENV) or Path(sys.prefix) / "jaxpar-targets")


def target_requirements() -> list[str]:
    """The compilers' packages for the installed jax: its CUDA 12 plugin (the same version; the CUDA
    runtime wheels are not needed to compile), ``ptxas`` (12.8 or newer knows B200's sm_100) and the
    libtpu of jax's own ``tpu`` extra.

    Returns:
      Requirement strings, for ``pip install --no-deps --target``.
    """
    try:
        extras = md.requires("jax") or []
    except md.PackageNotFoundError:
        extras = []
    libtpu = next((r.split(";")[0].replace(" ", "") for r in extras
                   if r.startswith("libtpu") and 'extra == "tpu"' in r), "libtpu")
    return [f"jax-cuda12-plugin=={jax.__version__}", f"jax-cuda12-pjrt=={jax.__version__}",
            "nvidia-cuda-nvcc-cu12>=12.8,<13", libtpu]


def install_command() -> str:
    """The shell command that installs the compilers into :func:`targets_dir`, with this Python's pip."""
    args = [sys.executable, "-m", "pip", "install", "--no-deps", "--upgrade", "--target", str(targets_dir()),
            *target_requirements()]
    return shlex.join(args)


def target_devices(target: Target) -> list[Any]:
    """The target's abstract devices (compile-only: a ``Mesh`` over them compiles, nothing runs).

    The first target of a platform loads its compiler (:func:`targets_dir`) into this process.

    Args:
      target: the target.

    Returns:
      The devices, host-major (a GPU target's first ``gpus_per_host`` are host 0's).

    Raises:
      TargetError: the compilers are not installed (:func:`install_command`) or reject the topology.
    """
    key = (str(target), repr(target.spec))
    if key not in _DEVICES:
        _DEVICES[key] = _devices(target)
    return list(_DEVICES[key])


_DEVICES: dict[tuple, tuple] = {}       # a topology's devices, made once per process


def _devices(target: Target) -> tuple:
    _check_plugin(target.spec.platform)
    with without_notes():
        if target.spec.platform == "cuda":
            _start_cuda_plugin()
        return tuple(_topology(target).devices)


def _topology(target: Target) -> Any:
    from jax.experimental import topologies

    spec = target.spec
    try:
        if spec.platform == "cuda":
            hosts, per_host = target.shape
            return topologies.get_topology_desc(platform="cuda", topology_name=spec.name,
                                                target_config=gpu_target_config(spec), topology=f"1x{hosts}x{per_host}")
        name = f"{spec.topology_name}:{'x'.join(map(str, target.shape))}"
        return topologies.get_topology_desc(topology_name=name, platform="tpu", num_slices=target.slices,
                                            chips_per_host_bounds=spec.chips_per_host_bounds)
    except Exception as e:      # the compilers' own errors name no jaxpar setting
        if "topology not implemented for cuda" in str(e):
            raise TargetError(f"target {target}: JAX started its backends before the CUDA plugin could be set up "
                              f"for compiling without a GPU; set JAX_PLATFORMS=cpu before starting Python "
                              f"(the plugin then skips its check for a CUDA runtime).") from None
        raise TargetError(f"target {target}: the {spec.platform} compiler rejected the topology: "
                          f"{str(e).splitlines()[0]}. Check the topology against docs/targets.md.") from None


_PLUGIN = {"cuda": ("jax_plugins.xla_cuda12", "jax-cuda12-plugin"), "tpu": ("libtpu", "libtpu")}


def _check_plugin(platform: str) -> None:
    module, dist = _PLUGIN[platform]
    if not jax.config.jax_platforms:    # deviceless: this process runs nothing on the target's platform
        jax.config.update("jax_platforms", "cpu")     # (and the CUDA plugin then skips its runtime check)
    if platform == "tpu":
        _quiet_libtpu()
    _use_targets_dir()
    missing = TargetError(f"compiling for {platform} targets needs {dist}, which is not installed in {targets_dir()} "
                          f"(${TARGETS_DIR_ENV}, default jaxpar-targets in the Python environment): "
                          f"{install_command()} (from a checkout: make targets; docs/targets.md).")
    if not _installed(module):
        raise missing
    try:
        version = md.version(dist) if platform == "cuda" else jax.__version__
    except md.PackageNotFoundError:     # the module without its distribution (another jax_plugins package)
        raise missing from None
    if version != jax.__version__:
        raise TargetError(f"{dist}=={version} is installed beside jax=={jax.__version__}; the plugin must "
                          f"match jax exactly: {install_command()}")


def _use_targets_dir() -> None:
    """Put :func:`targets_dir` on ``sys.path``, last (so it shadows nothing), once; after JAX has looked
    for plugins (its first backend or topology does, once), which would otherwise find the CUDA plugin
    there, start it and fail (no CUDA runtime), as at an ``import jax`` beside it."""
    from jax._src import xla_bridge

    path = str(targets_dir())
    if os.path.isdir(path) and path not in sys.path:
        xla_bridge._discover_and_register_pjrt_plugins()
        sys.path.append(path)
        importlib.invalidate_caches()


def _installed(module: str) -> bool:
    """Whether ``module`` can be imported; a dotted name whose parent package is missing (a plain install
    has no ``jax_plugins``) makes ``find_spec`` raise instead of returning None."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ModuleNotFoundError, ValueError):
        return False


def _start_cuda_plugin() -> None:
    """What JAX's start-up does for a CUDA plugin installed beside it, done now: register the plugin (its
    compiler and topologies), the custom calls of its GPU kernels (cuSOLVER, ...), and the ``ptxas`` of
    nvidia-cuda-nvcc-cu12. Nothing to do where JAX found the plugin itself."""
    from jax._src import lib
    from jax._src.lib import xla_client

    if xla_client.pjrt_plugin_loaded("cuda"):
        return
    try:
        importlib.import_module("jax_plugins.xla_cuda12").initialize()
        _register_gpu_kernels()
    except Exception as e:      # a broken or partial install: the plugin's own error names no fix
        raise TargetError(f"the CUDA plugin in {targets_dir()} did not start: {str(e).splitlines()[0]}; "
                          f"install it again: {install_command()}") from None
    if lib.cuda_path is None:   # JAX looked for nvidia-cuda-nvcc-cu12 at import, before it was on sys.path
        lib.cuda_path = lib._cuda_path()


def _register_gpu_kernels() -> None:
    """Register the CUDA custom calls that ``import jax`` registers when the plugin is importable then:
    jaxlib's GPU kernel modules, imported again with it on ``sys.path``."""
    from jaxlib import gpu_linalg, gpu_prng, gpu_rnn, gpu_solver, gpu_sparse, gpu_triton

    for module in (gpu_rnn, gpu_triton):        # these register their kernels when imported
        importlib.reload(module)
    for module in (gpu_linalg, gpu_prng, gpu_solver, gpu_sparse):
        importlib.reload(module)
        for name, value, api_version in module.registrations()["CUDA"]:
            jax.ffi.register_ffi_target(name, value, platform="CUDA", api_version=api_version)
        for name in getattr(module, "batch_partitionable_targets", list)():
            jax.ffi.register_ffi_target_as_batch_partitionable(name)


#: The compilers' notices that this machine has no GPU / TPU (harmless: compiling needs none), written by
#: their native logging straight to the stderr file descriptor while they load.
_NO_HARDWARE_NOTES = re.compile(r"All log messages before absl::InitializeLog\(\) is called are written to STDERR"
                                r"|cudart_stub\.cc:\d+\] Could not find cuda drivers on your machine"
                                r"|Failed to find host bounds for accelerator type")


#: XLA's log lines while it compiles a program for a target: the rematerialization pass's notice that the program
#: stays above the device memory (``jaxpar inspect``'s fit line says whether it fits, and by how much).
COMPILER_NOTES = re.compile(r"hlo_rematerialization\.cc:\d+\] ")


@contextlib.contextmanager
def without_notes(notes: re.Pattern = _NO_HARDWARE_NOTES):
    """Hold back what is written to file descriptor 2 meanwhile (native logging included); then write it out
    less the lines that ``notes`` finds.

    Args:
      notes: the lines to drop (default :data:`_NO_HARDWARE_NOTES`; :data:`COMPILER_NOTES` for a compile).
    """
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            lines = held.read().decode(errors="replace").splitlines(keepends=True)
            kept = "".join(line for line in lines if not notes.search(line))
            if kept:
                os.write(2, kept.encode())


def _quiet_libtpu() -> None:
    """Settings for libtpu compiling on a machine that is no TPU host (unless the environment has its own):
    several processes may compile at once (else a machine-wide lock file), and no query of the cloud
    metadata server for this host's TPU workers (it fails here and prints errors)."""
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    if jax.config.jax_platforms == "cpu":       # deviceless: this process uses no TPU of its own
        os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
        os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")


def compile_error(target: Target, error: Exception) -> TargetError | None:
    """A :class:`TargetError` for a compiler error that jaxpar can explain (None: it cannot).

    Args:
      target: the target compiled for.
      error: what ``.compile()`` raised.

    Returns:
      The error to raise instead, naming the value and the fix, or None.
    """
    text = str(error)
    if "ptxas too old" in text or "Unsupported .version" in text or "not defined for option 'gpu-name'" in text:
        major, minor = target.spec.gpu["compute_capability"]
        try:
            nvcc = md.version("nvidia-cuda-nvcc-cu12")
        except md.PackageNotFoundError:
            nvcc = "not installed"
        return TargetError(f"target {target}: ptxas (nvidia-cuda-nvcc-cu12 {nvcc}) is too old for compute "
                           f"capability {major}.{minor} ({target.spec.device}); install a newer one: "
                           f"pip install -U nvidia-cuda-nvcc-cu12.")
    if "No PTX compilation provider" in text or "Couldn't find a suitable version of ptxas" in text:
        return TargetError(f"target {target}: no ptxas to compile for {target.spec.device}: {install_command()} "
                           f"(it brings nvidia-cuda-nvcc-cu12).")
    return None
