"""A cluster as the cost model sees it: nodes of devices, their memory and peak FLOP/s, an
intra-node and an inter-node α-β-γ :class:`~jaxpar.cost.Link` (per device and direction), and each
device's link to host memory with the host memory's bandwidth (memory offloading). Presets are
YAML files in ``configs/clusters/`` (:func:`presets`, :func:`load_cluster`; keys in docs/planning.md §2).

Example::

    >>> c = load_cluster("h100", nodes=2)
    >>> c.num_devices, c.devices_per_node, round(c.intra.beta * 450e9, 6)
    (16, 8, 1.0)
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from jaxpar.cost._capacity import Capacity, device_capacity
from jaxpar.cost._collectives import Link
from jaxpar.errors import ClusterError, check_int, finite_number, int_problem

#: The ``peak_tflops`` key of a device's FP8 GEMMs (``parallel.fp8``): never a compute dtype.
FP8 = "float8"
#: The ``platform`` key's values: the compiler's platform, which sets the capacity rule (:func:`device_capacity`).
PLATFORMS = ("cuda", "tpu", "cpu")
#: Where the preset YAML files live (``configs/clusters`` of the repository).
PRESET_DIR = Path(__file__).resolve().parents[2] / "configs" / "clusters"

#: The fractions of a :class:`Cluster`, in order: ``(field, interval, what it is)``.
#: Rows a group at which MoE's grouped-GEMM kernel reaches half of the cluster's ``efficiency``: assumed (the Triton
#: blocks are 128 rows by 128 columns and untuned), until ``benchmarks/moe_gpu.py`` fits it on a GPU.
GROUPED_HALF_ROWS = 256.0
#: Seconds of one kernel launch on a GPU: a grouped call's, and each of a tile loop's fusions.
LAUNCH_S = 10e-6

_FRACTIONS = (("efficiency", "(0, 1]", "achieved / peak FLOP/s, e.g. 0.5"),
              ("attention_efficiency", "[0, 1]",
               "a flash attention kernel's achieved / peak FLOP/s; 0: the GEMMs' curve"),
              ("memory_efficiency", "(0, 1]", "achieved / memory_gbps of a streaming kernel, e.g. 0.85"))


@dataclass(frozen=True)
class Cluster:
    """Nodes x devices with memory, peak FLOP/s per dtype, compute efficiency and two links."""

    name: str
    devices_per_node: int
    nodes: int
    memory_bytes: float
    peak_flops: Mapping[str, float]
    intra: Link
    inter: Link
    efficiency: float = 0.5
    gemm_half_flops: float = 0.0
    memory_bandwidth: float = 0.0
    memory_efficiency: float = 1.0
    shared_compute: float = 1.0
    fused_attention: bool = False
    attention_efficiency: float = 0.0       # the flash kernel's own curve (0: the GEMMs' curve)
    attention_half_flops: float = 0.0
    host_link: float = 0.0                  # bytes/s between a device and host memory, per direction (0: none)
    host_memory_bandwidth: float = 0.0      # bytes/s of host memory one device's host update streams (0: none)
    platform: str = "cpu"                   # cuda: JAX's GPU client holds XLA_PYTHON_CLIENT_MEM_FRACTION of the memory
    description: str = ""
    sources: tuple[str, ...] = field(default=(), repr=False)

    def __post_init__(self):
        for f in ("devices_per_node", "nodes"):
            v = getattr(self, f)
            if why := int_problem(v, 1):
                raise ClusterError(f"cluster {self.name!r}: {f}={v!r} {why}.")
        _positive(self.name, "device_memory_gib", self.memory_bytes / 2**30)
        if not self.peak_flops or set(self.peak_flops) == {FP8}:
            raise ClusterError(f"cluster {self.name!r}: peak_tflops has no compute dtype; give e.g. {{bfloat16: 989}} "
                               "(float8 is the FP8 GEMMs' peak only).")
        for k, v in self.peak_flops.items():
            _positive(self.name, f"peak_tflops.{k}", v)
        for f, interval, what in _FRACTIONS:
            v = getattr(self, f)
            if not (0 <= v <= 1 if interval == "[0, 1]" else 0 < v <= 1):
                raise ClusterError(f"cluster {self.name!r}: {f}={v!r} must be in {interval} ({what}).")

    def matmul_efficiency(self, gemm_flops: float) -> float:
        """``efficiency * w / (w + gemm_half_flops)`` for a matmul of ``w`` FLOPs: small matmuls
        (small micro-batches, thin tensor-parallel shards) reach less of the peak.

        Args:
          gemm_flops: the FLOPs ``w`` of one matmul.

        Returns:
          The fraction of the peak reached.

        >>> load_cluster("h100").matmul_efficiency(2e9)        # at the half point: half of 0.5
        0.25
        """
        if self.gemm_half_flops <= 0:
            return self.efficiency
        return self.efficiency * gemm_flops / (gemm_flops + self.gemm_half_flops)

    def grouped_efficiency(self, group_rows: float) -> float:
        """The fraction of the peak MoE's grouped-GEMM kernel reaches (:mod:`jaxpar.parallel.moe._grouped`, one
        call over every local expert's rows): ``efficiency * r / (r + GROUPED_HALF_ROWS)`` at ``r`` rows a group.
        Assumed, not fitted: no GPU has run ``benchmarks/moe_gpu.py`` (docs/planning.md §10).

        Args:
          group_rows: the rows of one expert's group, ``r``.

        Returns:
          The fraction of the peak reached.

        >>> load_cluster("h100").grouped_efficiency(256)        # at the half point: half of 0.5
        0.25
        """
        return self.efficiency * group_rows / (group_rows + GROUPED_HALF_ROWS)

    def flash_efficiency(self, gemm_flops: float) -> float:
        """The fraction of the peak a fused (flash) attention kernel reaches, per ``w`` FLOPs of one of its
        ``s²`` GEMMs (the causal half): ``attention_efficiency * w / (w + attention_half_flops)``, the curve
        measured on the kernel (docs/planning.md §4); without one, :meth:`matmul_efficiency`.

        Args:
          gemm_flops: the FLOPs ``w`` of one of the kernel's ``s²`` GEMMs.

        Returns:
          The fraction of the peak reached.

        >>> c = load_cluster("h200")
        >>> round(c.flash_efficiency(12.885e9) * 989, 1)              # GPT-124M's attention: 111 TFLOP/s
        111.1
        >>> load_cluster("h100").flash_efficiency(2e9)                 # no curve of its own: the GEMMs'
        0.25
        """
        if self.attention_efficiency <= 0:
            return self.matmul_efficiency(gemm_flops)
        return self.attention_efficiency * gemm_flops / (gemm_flops + self.attention_half_flops)

    @property
    def stream_bandwidth(self) -> float:
        """Bytes/s a memory-bound kernel moves: ``memory_bandwidth * memory_efficiency`` (0: not modelled).

        >>> load_cluster("h100").stream_bandwidth == 3350e9
        True
        """
        return self.memory_bandwidth * self.memory_efficiency

    @property
    def has_fp8(self) -> bool:
        """Whether the device runs FP8 GEMMs (a ``peak_tflops.float8``).

        >>> load_cluster("h100").has_fp8, load_cluster("a100_80gb").has_fp8, load_cluster("tpu_v5e").has_fp8
        (True, False, False)
        """
        return FP8 in self.peak_flops

    @property
    def compute_dtypes(self) -> tuple[str, ...]:
        """The dtypes a step may compute in: those of ``peak_tflops`` but ``float8``."""
        return tuple(k for k in self.peak_flops if k != FP8)

    @property
    def capacity(self) -> Capacity:
        """The bytes a program may use on one device: the one capacity rule (:func:`device_capacity`).

        >>> load_cluster("h100").capacity.text()       # XLA_PYTHON_CLIENT_MEM_FRACTION unset
        '59.3 GiB usable (75% of 79.1 GiB: XLA_PYTHON_CLIENT_MEM_FRACTION)'
        """
        return device_capacity(self.memory_bytes, self.platform)

    @property
    def num_devices(self) -> int:
        return self.devices_per_node * self.nodes

    def peak(self, dtype: str) -> float:
        """Peak FLOP/s of one device for ``dtype``.

        Args:
          dtype: ``"fp32"``, ``"bf16"``, ...

        Returns:
          FLOP/s.
        """
        if dtype not in self.peak_flops:
            raise ClusterError(f"cluster {self.name!r} has no peak_tflops.{dtype}; it has "
                               f"{', '.join(self.peak_flops)}. Add it to the preset or choose one of those.")
        return self.peak_flops[dtype]

    def with_devices(self, num_devices: int) -> "Cluster":
        """The same hardware with ``num_devices`` devices (whole nodes, or part of one node).

        Args:
          num_devices: the device count.

        Returns:
          The resized :class:`Cluster`.

        >>> load_cluster("h100").with_devices(1024).nodes
        128
        """
        check_int("Cluster.with_devices", "num_devices", num_devices, 1, ClusterError)
        if num_devices <= self.devices_per_node:
            peaks = self.peak_flops
            if self.shared_compute > 1 and self.nodes == 1:      # the node's compute, split over fewer devices
                f = min(self.devices_per_node / num_devices, self.shared_compute)
                peaks = {k: v * f for k, v in peaks.items()}
            return replace(self, devices_per_node=num_devices, nodes=1, peak_flops=peaks)
        if num_devices % self.devices_per_node:
            raise ClusterError(f"num_devices={num_devices} is not a whole number of {self.name!r} nodes of "
                               f"{self.devices_per_node} devices; use a multiple of {self.devices_per_node}.")
        return replace(self, nodes=num_devices // self.devices_per_node)


def _positive(name: str, field_name: str, value: Any, unit: str = "", *, zero: bool = False) -> float:
    """``value`` as a float; a :class:`ClusterError` unless it is a finite number > 0 (``zero``: >= 0)."""
    if not finite_number(value) or value < 0 or (value == 0 and not zero):
        what = "a number >= 0" if zero else "a positive number"
        raise ClusterError(f"cluster {name!r}: {field_name}={value!r} must be {what}{unit}.")
    return float(value)


def _link(name: str, key: str, d: Any) -> Link:
    if not isinstance(d, Mapping):
        raise ClusterError(f"cluster {name!r}: {key} must be a mapping with alpha_us and bandwidth_gbps; got {d!r}.")
    unknown = set(d) - {"alpha_us", "bandwidth_gbps", "reduce_gbps", "shared_memory"}
    if unknown:
        raise ClusterError(f"cluster {name!r}: unknown key(s) {sorted(unknown)} under {key}; allowed: alpha_us, "
                           "bandwidth_gbps, reduce_gbps, shared_memory.")
    shm = d.get("shared_memory", False)
    if not isinstance(shm, bool):
        raise ClusterError(f"cluster {name!r}: {key}.shared_memory={shm!r} must be true or false.")
    for k in ("alpha_us", "bandwidth_gbps"):
        if k not in d:
            raise ClusterError(f"cluster {name!r}: {key}.{k} is missing.")
    alpha = _positive(name, f"{key}.alpha_us", d["alpha_us"], " (microseconds)", zero=True)
    bw = _positive(name, f"{key}.bandwidth_gbps", d["bandwidth_gbps"],
                   " of GB/s (1e9 bytes/s per device and direction), e.g. 50 for 400 Gb/s")
    red = d.get("reduce_gbps")
    red = None if red is None else _positive(name, f"{key}.reduce_gbps", red) * 1e9
    return Link.from_bandwidth(alpha * 1e-6, bw * 1e9, red, shm)


_KEYS = {"name", "description", "sources", "devices_per_node", "nodes", "device_memory_gib", "peak_tflops",
         "efficiency", "gemm_half_gflop", "memory_gbps", "memory_efficiency", "shared_compute", "fused_attention",
         "attention_efficiency", "attention_half_gflop", "intra_node", "inter_node",
         "host_link_gbps", "host_memory_gbps", "fit", "platform"}


#: The optional keys of a preset that take a number >= 0 (0: not modelled): ``(Cluster field, key, scale)``.
_AT_LEAST_ZERO = (("gemm_half_flops", "gemm_half_gflop", 1e9), ("memory_bandwidth", "memory_gbps", 1e9),
                  ("attention_efficiency", "attention_efficiency", 1),
                  ("attention_half_flops", "attention_half_gflop", 1e9), ("host_link", "host_link_gbps", 1e9),
                  ("host_memory_bandwidth", "host_memory_gbps", 1e9))


def cluster_from_dict(d: Mapping[str, Any], name: str = "cluster") -> Cluster:
    """A :class:`Cluster` from a preset's mapping (keys in docs/planning.md §2; ``fit`` is kept as a record only).

    Args:
      d: the preset's keys and values.
      name: the cluster's name.

    Returns:
      The :class:`Cluster`.
    """
    if not isinstance(d, Mapping):
        raise ClusterError(f"cluster {name!r}: expected a mapping of keys {sorted(_KEYS)}, got {type(d).__name__}.")
    name = str(d.get("name", name))
    unknown = set(d) - _KEYS
    if unknown:
        raise ClusterError(f"cluster {name!r}: unknown key(s) {sorted(unknown)}; allowed: {', '.join(sorted(_KEYS))}.")
    for k in ("devices_per_node", "device_memory_gib", "peak_tflops", "intra_node"):
        if k not in d:
            raise ClusterError(f"cluster {name!r}: {k} is missing.")
    peaks = d["peak_tflops"]
    if not isinstance(peaks, Mapping) or not peaks:
        raise ClusterError(f"cluster {name!r}: peak_tflops must map dtypes to TFLOP/s, e.g. {{bfloat16: 989}}.")
    shared = d.get("shared_compute", 1)
    if not finite_number(shared) or shared < 1:
        raise ClusterError(f"cluster {name!r}: shared_compute={shared!r} must be a number >= 1 (1: devices do not "
                           "share compute; s: one device alone runs up to s times faster).")
    fused = d.get("fused_attention", False)
    if not isinstance(fused, bool):
        raise ClusterError(f"cluster {name!r}: fused_attention={fused!r} must be true or false (true: attention runs "
                           "a flash kernel, whose softmax stays on chip, as jaxpar's does on NVIDIA GPUs).")
    platform = d.get("platform", "cpu")
    if platform not in PLATFORMS:
        raise ClusterError(f"cluster {name!r}: platform={platform!r}; choose one of {PLATFORMS} (cuda: a program may "
                           "use XLA_PYTHON_CLIENT_MEM_FRACTION of each GPU's memory, else the whole memory).")
    intra = _link(name, "intra_node", d["intra_node"])
    inter = _link(name, "inter_node", d["inter_node"]) if "inter_node" in d else intra
    return Cluster(name=name, devices_per_node=d["devices_per_node"], nodes=d.get("nodes", 1),
                   memory_bytes=_positive(name, "device_memory_gib", d["device_memory_gib"]) * 2**30,
                   peak_flops={k: _positive(name, f"peak_tflops.{k}", v) * 1e12 for k, v in peaks.items()},
                   **{f: _positive(name, key, d.get(key, 0), zero=True) * scale for f, key, scale in _AT_LEAST_ZERO},
                   intra=intra, inter=inter, efficiency=d.get("efficiency", 0.5),
                   memory_efficiency=d.get("memory_efficiency", 1.0),
                   shared_compute=float(shared), fused_attention=fused,
                   platform=platform, description=str(d.get("description", "")), sources=tuple(d.get("sources", ())))


def fit_gemm_efficiency(points: list[tuple[float, float]], peak: float) -> dict[str, float]:
    """The roofline's ``efficiency`` and ``gemm_half_gflop`` from ``[(FLOPs, seconds)]`` at ``peak`` FLOP/s
    (:func:`jaxpar.devices.calibrate_device` times the GEMMs).

    :meth:`Cluster.matmul_efficiency` is ``e * w / (w + h)`` for a GEMM of ``w`` FLOPs: ``1 / eff = 1 / e +
    (h / e) / w`` is linear in ``1 / w``, fitted by least squares on the measured ``eff = w / (t * peak)``.

    Args:
      points: the timed GEMMs.
      peak: the datasheet's peak FLOP/s of the compute dtype.

    Returns:
      ``{"efficiency", "gemm_half_gflop", "max_rel_residual"}`` (the residual of the fitted time).

    >>> fit_gemm_efficiency([(1e9, 2e-6), (1e12, 1.25e-3)], 1e15)      # 1 GFLOP at 50%, 1 TFLOP at 80%
    {'efficiency': 0.8005, 'gemm_half_gflop': 0.601, 'max_rel_residual': 0.0}
    """
    w = np.array([p[0] for p in points])
    eff = w / (np.array([p[1] for p in points]) * peak)
    (a, b), *_ = np.linalg.lstsq(np.stack([np.ones_like(w), 1 / w], 1), 1 / eff, rcond=None)
    # no curve with e > 0, h >= 0 through the points (noisy small GEMMs): the largest efficiency, flat
    e, h = (min(1.0, 1 / a), max(0.0, b / a)) if a > 0 and b >= 0 else (min(1.0, float(eff.max())), 0.0)
    fitted = e * w / (w + h)
    return {"efficiency": float(f"{e:.4g}"), "gemm_half_gflop": float(f"{h / 1e9:.4g}"),
            "max_rel_residual": round(float(np.max(np.abs(eff / fitted - 1))), 4)}


def presets() -> dict[str, Path]:
    """``{preset name: YAML path}`` of ``configs/clusters/`` (the file stem is the name).

    >>> {"h100", "tpu_v5e", "cpu_sim"} <= set(presets())
    True
    """
    return {p.stem: p for p in sorted(PRESET_DIR.glob("*.yaml"))} if PRESET_DIR.is_dir() else {}


def load_cluster(preset: str | Path, *, nodes: int | None = None, num_devices: int | None = None) -> Cluster:
    """Read a preset by name (:func:`presets`) or a YAML path; ``nodes`` / ``num_devices`` resize it.

    Args:
      preset: a preset name or the path of a YAML file.
      nodes: the node count, or ``None`` for the preset's.
      num_devices: the device count, or ``None``.

    Returns:
      The :class:`Cluster`.
    """
    import yaml

    known = presets()
    path = known.get(str(preset))
    if path is None:
        path = Path(preset)
        if path.suffix not in (".yaml", ".yml") or not path.is_file():
            raise ClusterError(f"unknown cluster preset {str(preset)!r}; presets: {', '.join(known) or 'none'} "
                               f"(in {PRESET_DIR}), or give the path of a cluster YAML file.")
    c = cluster_from_dict(yaml.safe_load(path.read_text()), name=path.stem)
    if nodes is not None:
        check_int("load_cluster", "nodes", nodes, 1, ClusterError)
        c = replace(c, nodes=nodes)
    if num_devices is not None:
        c = c.with_devices(num_devices)
    return c
