"""The lines ``jaxpar train`` and ``jaxpar inspect`` print about a :class:`~jaxpar.config.Job`:
its devices, mesh and strategy, the model's parameters, the train state's bytes per device, the
data, and the compiled programs.

Example::

    >>> from pathlib import Path
    >>> from jaxpar.config import load_config
    >>> from jaxpar.config._job import build_job
    >>> cfg = load_config(Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml")
    >>> job = build_job(cfg, data=False)
    >>> print("\\n".join(header_lines(job)[1:]))
    mesh     pipe=1 x data=2 x fsdp=2 x tensor=2
    strategy dp2-fsdp2-tp2
    >>> describe_data(cfg, job.batch_fn)
    ('data     text: global batch 32 x 64 tokens', 2048)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Mapping

import jax
import numpy as np
from jax.sharding import PartitionSpec

from jaxpar.config._data_section import describe_batch
from jaxpar.config._job import Job
from jaxpar.config._schema import JobConfig


def header_lines(job: Job) -> list[str]:
    """The devices, mesh and strategy lines.

    Args:
      job: the job (built with a mesh).

    Returns:
      The lines.
    """
    sizes, dev = dict(job.mesh.shape), job.mesh.devices.flat[0]
    hosts = len({d.process_index for d in job.mesh.devices.flat})
    return [f"devices  {job.mesh.size} x {dev.platform} ({dev.device_kind})" + (f" in {hosts} processes" if hosts > 1 else ""),
            "mesh     " + " x ".join(f"{k}={v}" for k, v in sizes.items()),
            f"strategy {job.strategy.name(sizes)}"]


def model_label(m: Any, hf: Any = None) -> str:
    """How ``jaxpar train`` and ``jaxpar inspect`` name the model: ``model.name``, with ``model.target``
    or, for ``model.hf``, the checkpoint's family and directory.

    Args:
      m: the model section.
      hf: ``model.hf``'s opened checkpoint (:attr:`Job.hf`), if any.

    Returns:
      The label.
    """
    if m.target is not None:
        return f"{m.name} ({m.target})"
    return f"{m.name} ({hf.family} from {m.hf})" if hf is not None else m.name


def model_line(label: str, layout: Any) -> str:
    """The model line: its label and number of parameters.

    Args:
      label: how the model is named.
      layout: the train state's layout.

    Returns:
      The line.
    """
    return f"model    {label}: {sum(a.size for a in jax.tree.leaves(layout.shapes)):,} parameters"


def state_line(layout: Any) -> str:
    """``jaxpar train``'s line of the train state's bytes per device (parameters, optimizer, ``comm``).

    Args:
      layout: the train state's layout.

    Returns:
      The line.
    """
    from jaxpar.analysis._compiled_memory import format_bytes

    nbytes, parts = layout.analytic_bytes(), part_bytes(layout)
    names = {"codec": "codec state", "sync": "relaxed-sync state"}
    extra = "".join(f", {names[k]} {format_bytes(v)}" for k, v in parts.items() if v)
    total = nbytes["total"] + sum(parts.values())
    return (f"state    {format_bytes(total)} per device (params {format_bytes(nbytes['params'])}, "
            f"optimizer {format_bytes(nbytes['opt'])}{extra})")


def program_lines(job: Job, compiled: Mapping[str, Any]) -> list[str]:
    """``jaxpar inspect``'s lines of the compiled programs: when each runs and the batch it takes.

    Args:
      job: the job.
      compiled: :meth:`Job.compile`'s programs.

    Returns:
      One line per program.
    """
    k, lines = job.steps_per_call, []
    for name, c in compiled.items():
        when = {"step": f"{k} optimizer steps per call" if k > 1 else "every step",
                "measure": f"every {job.noise_scale_every} steps: also measures the noise scale",
                "warm": "the warm-up steps: every replica steps in sync",
                "outer": "every sync: the replicas' outer step"}[name]
        args = c.in_avals[0]
        batch = ", ".join(f"{jax.tree_util.keystr(p)}: {a.dtype}{list(a.shape)}"
                          for p, a in jax.tree_util.tree_leaves_with_path(args[1])) if len(args) > 1 else "none"
        lines.append(f"program  {name} ({when}): batch {batch}")
    return lines


def describe_data(cfg: JobConfig, batch_fn: Callable[[int], Any]) -> tuple[str, int | None]:
    """The data line of ``jaxpar train`` and the tokens per global batch (None: not fixed, or no tokens).

    The GPT's batches hold ``batch_size x model.seq_len`` tokens; for a model of your own, a
    batch of ``data.target`` with a 2-D integer ``tokens`` leaf holds that many.

    Args:
      cfg: the config.
      batch_fn: the job's batch function (called for step 0 with ``data.kind=import``).

    Returns:
      ``(line, tokens per batch)``.
    """
    d, seq, gpt_tokens = cfg.data, cfg.model.seq_len, cfg.data.batch_size * cfg.model.seq_len
    if d.batch_ramp.get("adaptive"):    # the batch changes: no fixed tokens per batch (records carry batch_size)
        r = d.batch_ramp
        return (f"data     {d.kind}: adaptive global batch {r['sizes'][0]}, growing among {list(r['sizes'])} toward "
                f"{r.get('factor', 1.0)} x the noise scale, decided every {r['every']} steps "
                f"(x {seq} tokens for the GPT)"), None
    if d.batch_ramp:
        ramp = ", ".join(f"{b} from step {s}" for b, s in zip(d.batch_ramp["sizes"], d.batch_ramp["steps"]))
        return f"data     {d.kind}: global batch ramp {ramp} (x {seq} tokens for the GPT)", None
    if d.kind == "documents":
        names = ", ".join(f"{Path(str(dict(s)['path'])).name} x{dict(s).get('weight', 1.0):g}" for s in d.sources)
        return (f"data     documents ({names}), tokenized by data.tokenizer={d.tokenizer!r}"
                f"{' from data.cache' if d.cache else ' on the fly'}, packed {d.pack}: global batch {d.batch_size} "
                f"x {seq} tokens"), gpt_tokens
    if d.kind != "import":
        tok = f" tokenized by data.tokenizer={d.tokenizer!r}" if d.tokenizer else ""
        return f"data     {d.kind}{tok}: global batch {d.batch_size} x {seq} tokens", gpt_tokens
    batch = batch_fn(0)
    line = f"data     {d.kind} {d.target}: global batch {d.batch_size} ({describe_batch(batch)})"
    if cfg.model.target is None:
        return line, gpt_tokens
    tokens = np.asarray(batch.get("tokens", 0))
    return line, int(tokens.size) if tokens.ndim == 2 and tokens.dtype.kind in "iu" else None


def packing_line(batches: Any, steps: int, most: int = 1000) -> str | None:
    """``packing  98.97% non-padding tokens (steps 0-99)``: packed batches' real tokens over the run's first
    ``min(steps, most)`` steps (planned from the documents' lengths, no token read); ``None`` for batches
    that are not packed.

    Args:
      batches: the job's batches (a :class:`jaxpar.data.PackedBatches`, or anything else).
      steps: the run's steps.
      most: the most steps planned.

    Returns:
      The line, or None.
    """
    if not hasattr(batches, "efficiency"):
        return None
    n = min(steps, most)
    skipped = f"; {batches.skipped} malformed records skipped" if batches.skipped else ""
    return f"packing  {batches.efficiency(0, n):.2%} non-padding tokens (steps 0-{n - 1}){skipped}"


def part_bytes(layout) -> dict[str, int]:
    """Bytes per device of the state parts a codec or relaxed synchronisation adds.

    Args:
      layout: the train state's :class:`~jaxpar.StateLayout`.

    Returns:
      ``{"codec": ..., "sync": ...}``: the codec's residuals and relaxed synchronisation's
      replicas (or history) on one device, each 0 without the part.
    """
    from jaxpar.parallel._zero import spec_shards

    sizes = dict(layout.mesh.shape)
    out = {}
    for name in ("codec", "sync"):
        specs = jax.tree.leaves(layout.part(name).specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
        out[name] = sum(a.size * a.dtype.itemsize // spec_shards(spec, sizes)
                        for a, spec in zip(jax.tree.leaves(layout.part(name).shapes), specs))
    return out
