"""The same program on every process: before the first step, the processes compare their step programs.

Every process of a job must run the same compiled program, or the collectives of one wait for
collectives the others never issue (MaxText's hang playbook: "inconsistent HLO module compilation
across workers"). With several processes, :func:`check_same_program` lowers the step about to run
(each program of a :class:`~jaxpar.step.TrainStep`, with the first batch: the arguments it is called
with) and hashes the StableHLO text, headed by the jax / jaxlib versions and the device kind. The
lowered text is the same in every process that traces the same step (shardings included) and is made
before anything compiles; jax reuses the lowering for the first call, so the check costs the
exchange and the hash.

The processes exchange the hashes through the coordination service's key-value store (host only,
no device program, so it cannot itself mismatch), each wait bounded by ``timeout_s``. A mismatch
raises :class:`~jaxpar.errors.ProgramMismatchError` in every process at once: the processes that
differ from process 0, the first differing instruction (process 0's line and the other's) and, for
a run from a config, the config keys whose values differ. A process that does not report in time is
the same error. One process: nothing is done.

Example (the pieces of the message; one process here)::

    >>> first_difference("// program step\\n%0 = add\\n%1 = mul", "// program step\\n%0 = add\\n%1 = div")
    ('step', 3, '%1 = mul', '%1 = div')
    >>> config_differences("optimizer: {clip_norm: 1.0, lr: 0.1}", "optimizer: {clip_norm: 0.5, lr: 0.1}")
    ['optimizer.clip_norm: 1.0 vs 0.5']
"""

from __future__ import annotations

import hashlib
import itertools
import time
import zlib
from dataclasses import dataclass
from typing import Any, Callable

import jax

from jaxpar.errors import LoopError, ProgramMismatchError, is_number
from jaxpar.run._preemption import coordination_client

#: Seconds a process waits for the others' fingerprints (and, after a mismatch, their programs).
TIMEOUT_S = 60.0
#: Checks made in this process; one per train() call, so the same count in every process.
_checks = itertools.count(1)
_SHOWN = 3            # differing groups shown in the message


def program_text(step_fn: Callable, state: Any, batch: Any) -> str | None:
    """The text a process fingerprints: versions and device kind, then each program's lowered StableHLO.

    Args:
      step_fn: a :class:`~jaxpar.step.TrainStep` (``lower_all``) or a jitted function (``lower``).
      state: the train state it is called with.
      batch: the first batch it is called with.

    Returns:
      The text (``// program <name>`` heads each program), or None: ``step_fn`` cannot be lowered.
    """
    if hasattr(step_fn, "lower_all"):
        lowered = step_fn.lower_all(state, batch)
    elif hasattr(step_fn, "lower"):
        lowered = {"step": step_fn.lower(state, batch)}
    else:
        return None
    import jaxlib

    parts = [f"// jax {jax.__version__}, jaxlib {jaxlib.__version__}, {jax.local_devices()[0].device_kind}"]
    for name in sorted(lowered):
        parts += [f"// program {name}", lowered[name].as_text()]
    return "\n".join(parts)


def first_difference(a: str, b: str) -> tuple[str, int, str, str]:
    """The first line at which two program texts differ.

    Args:
      a: process 0's text (:func:`program_text`).
      b: another process's text.

    Returns:
      ``(program name, line number (1-based, in the whole text), a's line, b's line)``; a missing line is
      ``"<end of program>"``.
    """
    program = "?"
    for i, (x, y) in enumerate(itertools.zip_longest(a.splitlines(), b.splitlines(), fillvalue=None), 1):
        if x == y:
            if x.startswith("// program "):
                program = x.removeprefix("// program ")
            continue
        return program, i, _short(x), _short(y)
    return program, 0, "", ""


def _short(line: str | None, width: int = 240) -> str:
    if line is None:
        return "<end of program>"
    line = line.strip()
    return line if len(line) <= width else line[:width] + " ..."


def config_differences(a: str, b: str) -> list[str]:
    """The keys whose values differ between two resolved configs (YAML), as ``key: a vs b``.

    Args:
      a: process 0's config text.
      b: another process's config text.

    Returns:
      One ``key: value vs value`` string per differing key, sorted by key (a missing key shows ``<none>``).
    """
    import yaml

    from flax import traverse_util

    fa, fb = (traverse_util.flatten_dict(yaml.safe_load(t) or {}, sep=".") for t in (a, b))
    return [f"{k}: {fa.get(k, '<none>')} vs {fb.get(k, '<none>')}" for k in sorted(fa.keys() | fb.keys())
            if fa.get(k, "<none>") != fb.get(k, "<none>")]


def _digest(text: str | None) -> str:
    return hashlib.sha256(text.encode()).hexdigest() if text else "-"


class _Exchange:
    """One check's keys in the coordination service: ``jaxpar/program/<check>/...``, each wait bounded."""

    def __init__(self, client: Any, timeout_s: float, me: int, n: int, check: int):
        self.client, self.timeout_s, self.me, self.n = client, timeout_s, me, n
        self.prefix = f"jaxpar/program/{check}"
        self.deadline = time.monotonic() + timeout_s

    def _get(self, key: str, what: str, pids: list[int]) -> bytes:
        """The value of ``key``, waiting until the deadline; the named error names the silent ``pids``."""
        left_ms = max(1, int((self.deadline - time.monotonic()) * 1000))
        try:
            return self.client.blocking_key_value_get_bytes(f"{self.prefix}/{key}", left_ms)
        except jax.errors.JaxRuntimeError as e:     # DEADLINE_EXCEEDED
            kind = key.split("/", 1)[0]
            missing = [p for p in pids if not self._has(f"{kind}/{p}")] or pids
            raise ProgramMismatchError(
                f"train: process {self.me} waited {self.timeout_s:g} s for the {what} of "
                f"{_who(missing)} and got none ({str(e).split(':', 1)[0]}): they did not reach the first step "
                "(still loading, compiling or restoring, or stopped). Look at their logs; for a slow start, "
                "raise train(same_program=SameProgram(timeout_s=...)).") from None

    def _has(self, key: str) -> bool:
        try:
            self.client.key_value_try_get_bytes(f"{self.prefix}/{key}")
            return True
        except jax.errors.JaxRuntimeError:          # NOT_FOUND
            return False

    def fingerprints(self, digest: str, config_digest: str) -> dict[int, tuple[str, str]]:
        """Publish this process's ``(program, config)`` digests; read every process's."""
        self.client.key_value_set_bytes(f"{self.prefix}/digest/{self.me}", f"{digest} {config_digest}".encode())
        pids = list(range(self.n))
        return {p: tuple(self._get(f"digest/{p}", "program fingerprint", pids).decode().split(" ", 1))
                for p in pids}

    def put_text(self, name: str, text: str) -> None:
        """Publish this process's ``name`` text (compressed)."""
        self.client.key_value_set_bytes(f"{self.prefix}/{name}/{self.me}", zlib.compress(text.encode(), 6))

    def get_text(self, name: str, pid: int) -> str:
        """Process ``pid``'s ``name`` text, waiting until the deadline."""
        return zlib.decompress(self._get(f"{name}/{pid}", f"{name} text", [pid])).decode()


def _groups(found: dict[int, tuple[str, str]]) -> list[list[int]]:
    """The processes grouped by program digest, process 0's group first."""
    groups: dict[str, list[int]] = {}
    for pid in sorted(found):
        groups.setdefault(found[pid][0], []).append(pid)
    return sorted(groups.values(), key=lambda g: g[0])


def _mismatch(ex: _Exchange, groups: list[list[int]], found: dict, text: str, config_text: str | None) -> str:
    """Publish the programs (and configs) the message compares, read them back, and write the message."""
    shown = [g[0] for g in groups[1:1 + _SHOWN]]
    if ex.me in (0, *shown):
        ex.put_text("program", text)
        if config_text:
            ex.put_text("config", config_text)
    ex.deadline = time.monotonic() + ex.timeout_s       # every process got here: a fresh bound for the texts
    reference = ex.get_text("program", 0)
    differ, same = sorted(p for g in groups[1:] for p in g), groups[0][1:]
    lines = [f"the processes would run different step programs: {_who(differ)} of {ex.n} differ{'s' * (len(differ) == 1)} from process 0"
             + (f" ({_who(same)} the same as process 0)." if same else ".")]
    for group, pid in zip(groups[1:], shown):
        program, line, ours, theirs = first_difference(reference, ex.get_text("program", pid))
        lines += [f"  {_who(group)} (sha256 {found[pid][0][:12]}; process 0: {found[0][0][:12]}): "
                  f"first difference in program {program!r}, line {line} of the lowered StableHLO:",
                  f"    process 0:  {ours}", f"    process {pid}:  {theirs}"]
        if config_text and found[pid][1] != found[0][1] and "-" not in (found[pid][1], found[0][1]):
            diffs = config_differences(ex.get_text("config", 0), ex.get_text("config", pid))
            lines.append(f"    config (process 0 vs {pid}): " + ("; ".join(diffs) or "no key differs"))
    lines.append("Start every process with the same config, overrides, code and jax version.")
    return "\n".join(lines)


def _who(pids: list[int]) -> str:
    """``[1]`` -> ``process 1``; ``[0, 1, 2, 5]`` -> ``processes 0-2, 5``."""
    out = []
    for _, run in itertools.groupby(enumerate(pids), lambda t: t[1] - t[0]):
        run = [p for _, p in run]
        out.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
    return ("process " if len(pids) == 1 else "processes ") + ", ".join(out)


def check_same_program(step_fn: Callable, state: Any, batch: Any, *, config_text: str | None = None,
                       timeout_s: float = TIMEOUT_S, client: Any = None) -> str | None:
    """With several processes: the same step program on every one, or the named error on every one.

    Every process calls it once before its first step, with the arguments of that step.

    Args:
      step_fn: the step (:func:`program_text` lowers it).
      state: the train state of the first step.
      batch: the first (global) batch.
      config_text: the run's resolved config (YAML), or None; a mismatch names the keys that differ.
      timeout_s: seconds to wait for the other processes (> 0).
      client: the coordination client (default: :func:`~jaxpar.run._preemption.coordination_client`).

    Returns:
      A one-line report (``program  the same on 2 processes ...``), or None: one process, or a step
      that cannot be lowered (a plain Python function).

    Raises:
      ProgramMismatchError: the programs differ, or a process did not report within ``timeout_s``.
    """
    if jax.process_count() == 1:
        return None
    t0 = time.perf_counter()
    text = program_text(step_fn, state, batch)
    if text is None:
        return None
    found = compare_programs(text, config_text, client=client or coordination_client(), timeout_s=timeout_s,
                             process_index=jax.process_index(), process_count=jax.process_count(),
                             check=next(_checks))
    configs = sorted({c[:12] for _, c in found.values()} - {"-"})
    return (f"program  the same on {len(found)} processes (lowered step sha256 {found[0][0][:12]}"
            + (f", config sha256 {', '.join(configs[:_SHOWN])}" if configs else "")
            + f"; checked in {time.perf_counter() - t0:.2f} s)")


def compare_programs(text: str, config_text: str | None, *, client: Any, timeout_s: float, process_index: int,
                     process_count: int, check: int = 1) -> dict[int, tuple[str, str]]:
    """One process's side of the comparison: publish its digests, read everyone's, raise on a difference.

    Args:
      text: this process's program text (:func:`program_text`).
      config_text: its resolved config (YAML), or None.
      client: a coordination client (``key_value_set_bytes``, ``blocking_key_value_get_bytes``,
        ``key_value_try_get_bytes``).
      timeout_s: seconds to wait for the others, all waits together.
      process_index: this process's index.
      process_count: the number of processes.
      check: which check of the job this is (the same number in every process; keys are not reused).

    Returns:
      ``{process: (program sha256, config sha256 or "-")}``, all programs the same.

    Raises:
      ProgramMismatchError: the programs differ, or a process did not report within ``timeout_s``.
    """
    ex = _Exchange(client, timeout_s, process_index, process_count, check)
    found = ex.fingerprints(_digest(text), _digest(config_text))
    groups = _groups(found)
    if len(groups) > 1:
        raise ProgramMismatchError(_mismatch(ex, groups, found, text, config_text))
    return found


@dataclass(frozen=True)
class SameProgram:
    """How :func:`~jaxpar.run.train` compares the first step's program across processes (several only).

    Args:
      timeout_s: seconds each process waits for the others' fingerprints (> 0).
      config_text: the run's resolved config (YAML), or None; a mismatch names the keys whose values differ.

    Example::

        >>> SameProgram(timeout_s=120).timeout_s
        120
    """

    timeout_s: float = TIMEOUT_S
    config_text: str | None = None

    def __post_init__(self):
        if not is_number(self.timeout_s) or not self.timeout_s > 0:
            raise LoopError(f"SameProgram(timeout_s={self.timeout_s!r}): must be a number of seconds > 0; "
                            "train(same_program=None) skips the check.")

    def check(self, step_fn: Callable, state: Any, batch: Any) -> str | None:
        """:func:`check_same_program` with these settings.

        Args:
          step_fn: the step about to run.
          state: its train state.
          batch: its first batch.

        Returns:
          The report line, or None (one process, or a step that cannot be lowered).
        """
        return check_same_program(step_fn, state, batch, config_text=self.config_text, timeout_s=self.timeout_s)
