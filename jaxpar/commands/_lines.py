"""The lines the commands print about a job: its devices, mesh and strategy (:func:`header_lines`), the model's
parameters, the train state's bytes per device, the compiled programs, the data and its packing, and where a
run's trace is.

Example::

    >>> from pathlib import Path
    >>> from jaxpar.config import build_job, load_config
    >>> quickstart = Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml"
    >>> cfg = load_config(quickstart, ["model.layers=1", "model.embed=32", "model.seq_len=16"])
    >>> job = build_job(cfg, data=False)          # no data read: the batches are the GPT's token windows
    >>> print("\\n".join(header_lines(job)[1:]))
    mesh     pipe=1 x data=2 x fsdp=2 x tensor=2
    strategy dp2-fsdp2-tp2
    >>> describe_data(cfg, job.batch_fn)
    ('data     text: global batch 32 x 16 tokens', 512)
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
    processes = f" in {hosts} processes" if hosts > 1 else ""
    return [f"devices  {job.mesh.size} x {dev.platform} ({dev.device_kind}){processes}",
            "mesh     " + " x ".join(f"{k}={v}" for k, v in sizes.items()),
            f"strategy {job.strategy.name(sizes)}"]


def model_line(m: Any, hf: Any, layout: Any) -> str:
    """The model line: its name (with ``model.target``, or ``model.hf``'s family and directory) and its
    number of parameters.

    Args:
      m: the model section.
      hf: ``model.hf``'s opened checkpoint (:attr:`jaxpar.config.Job.hf`), or None.
      layout: the train state's layout.

    Returns:
      The line.
    """
    label = f"{m.name} ({m.target})" if m.target is not None else m.name
    if hf is not None:
        label = f"{m.name} ({hf.family} from {m.hf})" if hf.has_weights else \
            f"{m.name} ({hf.family} of {m.hf}'s config.json, no *.safetensors: random weights)"
    return f"model    {label}: {sum(a.size for a in jax.tree.leaves(layout.shapes)):,} parameters"


def state_line(layout: Any) -> str:
    """``jaxpar train``'s line of the train state's bytes per device: parameters, optimizer, and the state
    parts a codec (its residuals) or relaxed synchronisation (its replicas or history) adds.

    Args:
      layout: the train state's layout.

    Returns:
      The line.
    """
    from jaxpar._text import format_bytes
    from jaxpar.parallel._zero import spec_shards

    nbytes, sizes, extra = layout.analytic_bytes(), dict(layout.mesh.shape), ""
    total = nbytes["total"]
    for name, label in (("codec", "codec state"), ("sync", "relaxed-sync state")):
        part = layout.part(name)
        specs = jax.tree.leaves(part.specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
        n = sum(a.size * a.dtype.itemsize // spec_shards(spec, sizes)
                for a, spec in zip(jax.tree.leaves(part.shapes), specs))
        total += n
        extra += f", {label} {format_bytes(n)}" if n else ""
    return (f"state    {format_bytes(total)} per device (params {format_bytes(nbytes['params'])}, "
            f"optimizer {format_bytes(nbytes['opt'])}{extra})")


def program_lines(job: Job, compiled: Mapping[str, Any]) -> list[str]:
    """``jaxpar inspect``'s lines of the compiled programs: when each runs and the batch it takes.

    Args:
      job: the job.
      compiled: :meth:`jaxpar.config.Job.compile`'s programs.

    Returns:
      One line per program.
    """
    k, lines = job.steps_per_call, []
    measuring = next((p for p in job.parts if p.every), None)
    for name, c in compiled.items():
        when = {"step": f"{k} optimizer steps per call" if k > 1 else "every step",
                "measure": measuring and f"every {measuring.every} steps: also measures the "
                                         f"{measuring.name.replace('_', ' ')}",
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


def traced_line(out_dir: Path, profile: tuple[int, int] | None) -> str | None:
    """The closing line of a ``jaxpar train`` run with ``train.profile``: where its trace is (None: no trace,
    e.g. a resumed run that started past the steps).

    Args:
      out_dir: the run's ``train.out_dir``.
      profile: the traced steps ``(A, B)``, or None.

    Returns:
      The line, or None.
    """
    if not profile or not (out_dir / "trace" / "steps.json").exists():
        return None
    return (f"profile  steps {profile[0]} .. {profile[1] - 1} traced -> {out_dir / 'trace'} (tensorboard --logdir "
            f"{out_dir / 'trace'}, or ui.perfetto.dev; tables: jaxpar profile, docs/profiling.md)")

