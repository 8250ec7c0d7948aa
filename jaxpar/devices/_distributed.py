"""Many processes: join one JAX job from explicit flags or the cluster's environment.

Each process calls :func:`initialize` before anything touches JAX's backend. It works
out who it is (:func:`resolve`): explicit values (``coordinator``, ``num_processes``,
``process_id``; the CLI's ``--coordinator/--num-processes/--process-id``) win, the rest
comes from the launcher's environment (SLURM ``srun``, Open MPI ``mpirun``, a
Kubernetes indexed Job), and with neither it is a single process (nothing to do).
Then it sets the CPU collectives (gloo: CPU processes form one global mesh) and,
for simulated CPU devices, the local device count, and calls
:func:`jax.distributed.initialize`.

Failure of a peer: JAX's coordination service ends every surviving process (exit
by ``SIGABRT`` with "Terminating process because the JAX distributed service
detected fatal errors"). A dead coordinator (process 0) is noticed at once; another
dead process after ``heartbeat_timeout`` seconds. A collective with a dead peer
fails at once on CPU ("Gloo all-reduce failed ... Connection reset by peer").

Example (two processes on one machine, 4 CPU devices each): process 0 runs
``initialize("127.0.0.1:12355", num_processes=2, process_id=0, local_device_count=4)``
first thing. Who it is comes from :func:`resolve`, which touches nothing::

    >>> info = resolve("127.0.0.1:12355", num_processes=2, process_id=0, environ={})
    >>> info.describe(), info.multiprocess
    ('process 0 of 2 (explicit flags), coordinator 127.0.0.1:12355', True)
    >>> split_devices(8, num_processes=2)                    # train.devices=8 over 2 processes
    4
    >>> resolve(environ={}).method                           # no flags, no cluster env
    'single'
    >>> resolve(num_processes=2, process_id=0, environ={})
    Traceback (most recent call last):
    ...
    jaxpar.errors.DistributedError: no coordinator address for 2 processes (explicit flags): pass --coordinator ...
"""

from __future__ import annotations

import importlib.util
import os
import re
from dataclasses import dataclass
from typing import Mapping

import jax

from jaxpar.errors import DistributedError, int_problem
from jaxpar.mesh import use_devices

#: What each detected launcher reads, for messages and docs.
ENV_HINTS = {
    "slurm": "SLURM_JOB_ID, SLURM_STEP_NODELIST, SLURM_NTASKS, SLURM_PROCID, SLURM_LOCALID (set by srun)",
    "ompi": "OMPI_COMM_WORLD_SIZE, OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_LOCAL_RANK (set by mpirun)",
    "k8s": "KUBERNETES_SERVICE_HOST and JOB_COMPLETION_INDEX (an Indexed Job)",
}
_METHODS = {"single": "single process", "explicit": "explicit flags", "slurm": "SLURM", "ompi": "Open MPI",
            "k8s": "Kubernetes"}


@dataclass(frozen=True)
class ClusterInfo:
    """Who this process is. ``method``: single, explicit, slurm, ompi or k8s.

    ``local_device_ids=None``: every local accelerator is visible to this process.
    ``coordinator=None`` with ``method='k8s'``: JAX asks the Kubernetes API.
    """

    method: str
    num_processes: int = 1
    process_id: int = 0
    coordinator: str | None = None
    local_device_ids: tuple[int, ...] | None = None
    note: str = ""

    @property
    def multiprocess(self) -> bool:
        return self.num_processes > 1

    def describe(self) -> str:
        """One line, e.g. ``process 1 of 4 (SLURM), coordinator node001:63338``."""
        if not self.multiprocess:
            return f"single process ({self.note})" if self.note else "single process"
        text = f"process {self.process_id} of {self.num_processes} ({_METHODS[self.method]})"
        if self.coordinator:
            text += f", coordinator {self.coordinator}"
        if self.local_device_ids is not None:
            text += f", local devices {list(self.local_device_ids)}"
        return text


# ----------------------------------------------------------------------------- checks
def _check_coordinator(value: str, source: str) -> str:
    host, sep, port = str(value).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise DistributedError(f"{source}={value!r}: expected HOST:PORT, e.g. 10.0.0.1:12355 or node001:12355 "
                               "(process 0's host and a free port that every process can reach).")
    return str(value)


def _check_int(value, name: str, low: int) -> int:
    if why := int_problem(value, low):
        raise DistributedError(f"{name}={value!r}: {why}.")
    return value


def _env_int(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise DistributedError(f"environment variable {name}={env[name]!r} is not an integer.") from None


# ----------------------------------------------------------------------------- detection
def _detect(env: Mapping[str, str]) -> ClusterInfo | None:
    """The launcher's view (None: no launcher with several processes). Reads ``env`` only."""
    if "SLURM_JOB_ID" in env:
        if "SLURM_PROCID" not in env or "SLURM_STEP_NODELIST" not in env:
            return ClusterInfo("single", note="inside a SLURM allocation but not under srun; launch with srun "
                                              "to start one process per task")
        n, pid = _env_int(env, "SLURM_NTASKS"), _env_int(env, "SLURM_PROCID")
        nodes = _env_int(env, "SLURM_STEP_NUM_NODES") if "SLURM_STEP_NUM_NODES" in env else n
        per_node = n > nodes        # several tasks per node: one device each, like JAX's default
        local = (_env_int(env, "SLURM_LOCALID"),) if per_node else None
        return ClusterInfo("slurm", n, pid, _slurm_coordinator(env), local)
    if "OMPI_COMM_WORLD_SIZE" in env:
        n, pid = _env_int(env, "OMPI_COMM_WORLD_SIZE"), _env_int(env, "OMPI_COMM_WORLD_RANK")
        local_size = _env_int(env, "OMPI_COMM_WORLD_LOCAL_SIZE") if "OMPI_COMM_WORLD_LOCAL_SIZE" in env else 1
        local = (_env_int(env, "OMPI_COMM_WORLD_LOCAL_RANK"),) if local_size > 1 else None
        return ClusterInfo("ompi", n, pid, _ompi_coordinator(env), local)
    if "KUBERNETES_SERVICE_HOST" in env and "JOB_COMPLETION_INDEX" in env:
        return ClusterInfo("k8s", 0, _env_int(env, "JOB_COMPLETION_INDEX"))   # count: from flags or the API
    return None


def _port(env: Mapping[str, str], job_id: int) -> str:
    # JAX's rule: JAX_COORDINATOR_PORT, else a port in [61440, 65535] derived from the job id.
    return env.get("JAX_COORDINATOR_PORT") or str(job_id % 2**12 + (65535 - 2**12 + 1))


def _slurm_coordinator(env: Mapping[str, str]) -> str:
    """First host of ``SLURM_STEP_NODELIST`` (``node[001-004],gpu7`` -> ``node001``), as JAX does."""
    nodes = env["SLURM_STEP_NODELIST"]
    cut = next((i for i, ch in enumerate(nodes) if ch in ",["), len(nodes))
    host = nodes[:cut]
    if cut < len(nodes) and nodes[cut] == "[":
        rest = nodes[cut + 1:]
        host += rest[:next((i for i, ch in enumerate(rest) if ch in ",-]"), len(rest))]
    return f"{host}:{_port(env, _env_int(env, 'SLURM_JOB_ID'))}"


def _ompi_coordinator(env: Mapping[str, str]) -> str | None:
    """The ``mpirun`` host from ``OMPI_MCA_orte_hnp_uri`` (Open MPI 4); None on Open MPI 5 (PMIx)."""
    uri = env.get("OMPI_MCA_orte_hnp_uri")
    if not uri:
        return None
    match = re.search(r"tcp://(.+?)[,:]|tcp6://\[(.+?)[,\]]", uri)
    if match is None:
        return None
    host = next(g for g in match.groups() if g is not None)
    job = int(uri.split(".", 1)[0]) // 2**12
    return f"{host}:{_port(env, job)}"


def _explicit(num_processes: int | None, process_id: int | None) -> ClusterInfo:
    """Who this process is from explicit flags alone (no launcher): ``explicit``, or ``single`` for one process."""
    if num_processes is None:
        raise DistributedError(
            "--num-processes (num_processes) is missing: --coordinator / --process-id were given, but no "
            "launcher environment was found to supply the process count ("
            + "; ".join(ENV_HINTS.values()) + "). Pass --num-processes N to every process.")
    if num_processes == 1:
        if process_id not in (None, 0):
            raise DistributedError(f"--process-id (process_id)={process_id} with --num-processes 1: the only "
                                   "process is 0.")
        return ClusterInfo("single", note="--num-processes 1")
    if process_id is None:
        raise DistributedError(f"--process-id (process_id) is missing: with --num-processes {num_processes} "
                               f"give each process its own id 0..{num_processes - 1} (0 runs the coordinator).")
    return ClusterInfo("explicit")


def resolve(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None,
            *, environ: Mapping[str, str] | None = None) -> ClusterInfo:
    """Combine explicit values with the launcher's environment; raise :class:`DistributedError` if inconsistent.

    Explicit values win; ``JAX_COORDINATOR_ADDRESS`` supplies a missing coordinator. Never touches JAX.

    Args:
      coordinator: process 0's ``HOST:PORT`` (``--coordinator``), or None.
      num_processes: the number of processes in the job (``--num-processes``), or None.
      process_id: this process's id, ``0..num_processes-1`` (``--process-id``), or None.
      environ: the environment to read (default ``os.environ``).

    Returns:
      This process's :class:`ClusterInfo`; ``method="single"`` with neither values nor a launcher.

    >>> resolve(environ={"SLURM_JOB_ID": "7", "SLURM_NTASKS": "2", "SLURM_PROCID": "1", "SLURM_LOCALID": "0",
    ...                  "SLURM_STEP_NODELIST": "gpu[03-04]", "SLURM_STEP_NUM_NODES": "2"}).describe()
    'process 1 of 2 (SLURM), coordinator gpu03:61447'
    """
    env = os.environ if environ is None else environ
    if coordinator is not None:
        _check_coordinator(coordinator, "--coordinator (coordinator)")
    if num_processes is not None:
        _check_int(num_processes, "--num-processes (num_processes)", 1)
    if process_id is not None:
        _check_int(process_id, "--process-id (process_id)", 0)
    detected = _detect(env)
    if detected is not None and detected.method == "single":
        if num_processes is None and process_id is None and coordinator is None:
            return detected
        detected = None
    explicit = any(v is not None for v in (coordinator, num_processes, process_id))
    if detected is None and not explicit:
        return ClusterInfo("single")
    base = detected if detected is not None else _explicit(num_processes, process_id)
    if base.method == "single":
        return base
    n = num_processes if num_processes is not None else base.num_processes
    pid = process_id if process_id is not None else base.process_id
    coord = coordinator or env.get("JAX_COORDINATOR_ADDRESS") or base.coordinator
    if coord is not None and coordinator is None:
        _check_coordinator(coord, "JAX_COORDINATOR_ADDRESS" if env.get("JAX_COORDINATOR_ADDRESS") else
                           f"coordinator derived from the {_METHODS[base.method]} environment")
    if base.method == "k8s" and n == 0:
        return ClusterInfo("k8s", 0, pid, coord, None, note="process count from the Kubernetes API")
    if n == 1:
        return ClusterInfo("single", note=f"{_METHODS[base.method]} with one process")
    if not 0 <= pid < n:
        src = "--process-id" if process_id is not None else f"the {_METHODS[base.method]} environment"
        raise DistributedError(f"process id {pid} (from {src}) is not in 0..{n - 1} for {n} processes "
                               "(--num-processes / the launcher's task count).")
    if coord is None:
        raise DistributedError(
            f"no coordinator address for {n} processes ({_METHODS[base.method]}): pass --coordinator HOST:PORT "
            "(process 0's host, the same on every process) or set JAX_COORDINATOR_ADDRESS."
            + (" Open MPI 5 (PMIx) does not export the launcher's address." if base.method == "ompi" else ""))
    return ClusterInfo(base.method, n, pid, coord, base.local_device_ids, base.note)


def split_devices(total: int, num_processes: int) -> int:
    """Simulated CPU devices per process.

    Args:
      total: the devices of all processes together (``train.devices``).
      num_processes: the number of processes; it must divide ``total``.

    Returns:
      ``total // num_processes``.

    Raises:
      DistributedError: ``num_processes`` does not divide ``total``.
    """
    if total % num_processes:
        raise DistributedError(f"train.devices={total} (all processes together) is not divisible by "
                               f"{num_processes} processes; set train.devices to a multiple of {num_processes} "
                               "or give --local-devices K (devices per process).")
    return total // num_processes


# ----------------------------------------------------------------------------- start-up
def initialize(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None,
               *, local_device_count: int | None = None, cpu_collectives: str | None = "gloo",
               heartbeat_timeout: int = 100, initialization_timeout: int = 300, shutdown_timeout: int = 300
               ) -> ClusterInfo:
    """Join the job (see :func:`resolve`); a single process only sets the CPU device count. Call before any JAX use.

    Args:
      coordinator, num_processes, process_id: explicit values, as in :func:`resolve`.
      local_device_count: simulate that many CPU devices in this process (:func:`jaxpar.mesh.use_devices`
        with ``detect=False``: ``jax_num_cpu_devices`` and the ``cpu`` platform; an error if
        ``JAX_PLATFORMS`` names an accelerator).
      cpu_collectives: ``jax_cpu_collectives_implementation``: "gloo", "mpi" or None.
      heartbeat_timeout: seconds without heartbeats before a process is declared dead (every other one ends).
      initialization_timeout, shutdown_timeout: seconds to wait for all processes to connect / to stop.

    Returns:
      This process's :class:`ClusterInfo`.
    """
    from jax._src import xla_bridge

    info = resolve(coordinator, num_processes, process_id)
    if cpu_collectives not in ("gloo", "mpi", None):
        raise DistributedError(f"cpu_collectives={cpu_collectives!r}: choose 'gloo', 'mpi' or None.")
    for name, value in (("heartbeat_timeout", heartbeat_timeout), ("initialization_timeout", initialization_timeout),
                        ("shutdown_timeout", shutdown_timeout)):
        _check_int(value, name, 1)
    if local_device_count is not None:
        _check_int(local_device_count, "--local-devices (local_device_count)", 1)
    if not info.multiprocess and info.method != "k8s" and local_device_count is None:
        return info                                     # a single process: nothing to do
    if jax.distributed.is_initialized():
        raise DistributedError("jax.distributed is already initialised in this process; call initialize() once.")
    if xla_bridge.backends_are_initialized():
        raise DistributedError(
            "initialize() must run before anything touches JAX's backend (jax.devices(), a computation, "
            "device_put, ...); call it first thing in the program.")
    if local_device_count is not None:
        platform = use_devices(local_device_count, detect=False)   # simulate unless JAX_PLATFORMS says otherwise
        if platform != "cpu":
            asked = jax.config.jax_platforms or os.environ.get("JAX_PLATFORMS")
            raise DistributedError(f"--local-devices (local_device_count)={local_device_count} simulates CPU "
                                   f"devices, but JAX_PLATFORMS={asked!r} asks for {platform!r}; drop "
                                   "--local-devices to use the accelerator's own devices, or set JAX_PLATFORMS=cpu.")
    if not info.multiprocess and info.method != "k8s":
        return info
    if cpu_collectives is not None:
        jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
    timeouts = dict(initialization_timeout=initialization_timeout, heartbeat_timeout_seconds=heartbeat_timeout,
                    shutdown_timeout_seconds=shutdown_timeout)
    if info.method == "k8s" and (info.coordinator is None or info.num_processes == 0):
        return _initialize_k8s(info, timeouts)
    ids = None if os.environ.get("JAX_LOCAL_DEVICE_IDS") else (list(info.local_device_ids)
                                                                if info.local_device_ids is not None else None)
    jax.distributed.initialize(info.coordinator, info.num_processes, info.process_id, local_device_ids=ids,
                               cluster_detection_method="deactivate", **timeouts)
    return info


def _initialize_k8s(info: ClusterInfo, timeouts: dict) -> ClusterInfo:
    """``jax.distributed.initialize`` with the coordinator / process count from the Kubernetes API."""
    if importlib.util.find_spec("kubernetes") is None:
        raise DistributedError(
            "Kubernetes Indexed Job detected (JOB_COMPLETION_INDEX), but the coordinator / process count "
            "must come from the Kubernetes API and the 'kubernetes' package is missing: pip install "
            "'jax[k8s]' (the pod's service account must be allowed to read pods and jobs), or pass "
            "--coordinator <job>-0.<headless-service>:PORT and --num-processes N.")
    jax.distributed.initialize(info.coordinator, info.num_processes or None, info.process_id, **timeouts)
    from jax._src import distributed as _state

    s = _state.global_state
    return ClusterInfo("k8s", s.num_processes, s.process_id, s.coordinator_address)


def setup_devices(n: int) -> list:
    """Simulate ``n`` CPU devices when ``n > 0`` (``train.devices``); call before JAX's backend starts.

    :func:`jaxpar.mesh.use_devices` with ``detect=False`` decides: a ``JAX_PLATFORMS``
    that names an accelerator keeps its devices, otherwise ``n`` CPU devices. With
    ``n == 0`` JAX picks its own backend (GPU / TPU if present). A backend already up
    with exactly ``n`` devices is fine (e.g. under pytest).

    Args:
      n: the number of devices (``train.devices``); 0 or less: leave the backend to JAX.

    Returns:
      The first ``n`` devices (none for ``n <= 0``).

    Raises:
      DistributedError: the backend is already up with another number of devices, or cannot
        simulate ``n``.

    Example:
      >>> import jax
      >>> len(setup_devices(jax.device_count()))   # the backend is up with that many devices: nothing to do
      8
    """
    if n <= 0:
        return []
    try:
        use_devices(n, detect=False)
    except RuntimeError as e:
        raise DistributedError(f"train.devices={n}: {e}") from None
    return jax.devices()[:n]


def start_processes(coordinator: str | None = None, num_processes: int | None = None,
                    process_id: int | None = None, *, devices: int = 0, local_devices: int | None = None,
                    heartbeat_timeout: int | None = None) -> ClusterInfo:
    """Join the other processes, then set the device count; call before JAX's backend starts.

    Who this process is comes from the explicit values (the CLI's ``--coordinator``,
    ``--num-processes``, ``--process-id``) or the launcher (SLURM, Open MPI, Kubernetes;
    :func:`resolve`). A single process only sets the device count (:func:`setup_devices`).
    See docs/multihost.md.

    Args:
      coordinator: process 0's ``HOST:PORT``.
      num_processes: the number of processes in the job.
      process_id: this process's id.
      devices: the devices of all processes together (``train.devices``; 0: JAX's own).
      local_devices: simulated CPU devices in this process (``--local-devices``); default
        ``devices`` split evenly over the processes.
      heartbeat_timeout: seconds without heartbeats before a process counts as dead (default 100).

    Returns:
      The :class:`ClusterInfo` of this process.

    Raises:
      DistributedError: inconsistent flags or environment (the message names the fix).
    """
    info = resolve(coordinator, num_processes, process_id)
    if not info.multiprocess and info.method != "k8s":
        setup_devices(local_devices or devices)
        return info
    if local_devices is None and devices > 0:
        local_devices = split_devices(devices, info.num_processes) if info.num_processes else None
    return initialize(coordinator, num_processes, process_id, local_device_count=local_devices,
                      heartbeat_timeout=heartbeat_timeout or 100)


def sync_processes(name: str) -> None:
    """Wait until every process of the job reaches the barrier ``name`` (nothing with one process).

    Args:
      name: the barrier's name, the same in every process.
    """
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)
