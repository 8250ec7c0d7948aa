"""The ``jaxpar`` command line: the only place (with :mod:`jaxpar.config`) that reads a config.

Usage::

    jaxpar train CONFIG [key=value ...] [--print-config] [--resume]
                 [--coordinator HOST:PORT --num-processes N --process-id I] [--local-devices K]
    jaxpar schedule --kind 1f1b --stages 4 --microbatches 8 [--virtual V] [--png PATH] [--timed]

Example::

    $ jaxpar train configs/quickstart.yaml train.steps=50 optimizer.lr=1e-3
    $ jaxpar train configs/tp.yaml --print-config
    $ jaxpar train configs/quickstart.yaml --resume          # continue from the latest checkpoint
    $ jaxpar schedule --kind interleaved --stages 4 --microbatches 8 --virtual 2

``main(argv)`` returns the exit status (0 ok, 2 invalid config / arguments), so it
can be called in-process: ``main(["train", "configs/quickstart.yaml", "train.steps=3"])``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Sequence

__all__ = ["main", "build_parser", "setup_devices", "start_processes", "run_train", "run_schedule"]


def setup_devices(n: int) -> None:
    """Simulate ``n`` CPU devices when ``n > 0`` (``train.devices``); call before JAX's backend starts.

    :func:`jaxpar.mesh.use_devices` with ``detect=False`` decides: a ``JAX_PLATFORMS``
    that names an accelerator keeps its devices, otherwise ``n`` CPU devices. With
    ``n == 0`` JAX picks its own backend (GPU / TPU if present). A backend already up
    with exactly ``n`` devices is fine (e.g. under pytest).

    >>> import jax
    >>> setup_devices(jax.device_count())   # the backend is up with that many devices: nothing to do
    """
    from .config import ConfigError
    from .mesh import use_devices

    if n <= 0:
        return
    try:
        use_devices(n, detect=False)
    except RuntimeError as e:
        raise ConfigError(f"train.devices={n}: {e}") from None


def start_processes(dist: dict, devices: int):
    """Join the other processes (``--coordinator/--num-processes/--process-id`` or SLURM / Open MPI /
    Kubernetes), then set the device count; before JAX's backend starts. With several processes
    ``train.devices`` counts all of them (``--local-devices K``: K per process). See docs/multihost.md."""
    from . import distributed
    from .config import ConfigError

    try:
        info = distributed.resolve(dist.get("coordinator"), dist.get("num_processes"), dist.get("process_id"))
        local = dist.get("local_devices")
        if not info.multiprocess and info.method != "k8s":
            setup_devices(local or devices)
            return info
        if local is None and devices > 0:
            local = distributed.split_devices(devices, info.num_processes) if info.num_processes else None
        info = distributed.initialize(dist.get("coordinator"), dist.get("num_processes"), dist.get("process_id"),
                                      local_device_count=local,
                                      heartbeat_timeout=dist.get("heartbeat_timeout") or 100)
    except distributed.DistributedError as e:
        raise ConfigError(str(e)) from None
    print(f"process  {info.describe()}")
    return info


def run_train(config: str, overrides: Sequence[str], *, print_config: bool = False, resume: bool = False,
              dist: dict | None = None) -> int:
    """``jaxpar train``: load + check the config, build the library objects, train, summarise.

    ``resume`` (``--resume``) sets ``checkpoint.resume=true``. Exit status 0 also
    after SIGTERM / SIGINT (a checkpoint of the current step is saved), 1 when a
    non-finite loss stops the run (``train.on_nonfinite=stop``).
    """
    from .config import load_config, to_yaml

    cfg = load_config(config, [*overrides, *(["checkpoint.resume=true"] if resume else [])])
    if print_config:
        print(to_yaml(cfg), end="")
        return 0
    info = start_processes(dist or {}, cfg.train.devices)   # jax.distributed (if several processes), then devices
    if info.multiprocess:
        from .train.preemption import catch_stop_signals

        catch_stop_signals()      # a SIGTERM during start-up stops every process after the first step

    import jax

    from . import config as C
    from .train.loop import make_eval_fn
    from .train.state import init_train_state
    from .train.step import make_train_step

    C.check(cfg, num_devices=jax.device_count())
    mesh = C.build_mesh(cfg.mesh)
    strategy = C.build_strategy(cfg.parallel)
    tx, schedule = C.build_optimizer(cfg.optimizer, cfg.train.steps)
    loss_fn = C.build_loss_fn(cfg.model)
    batch_fn, eval_batches = C.build_data(cfg.data, seq_len=cfg.model.seq_len, vocab=cfg.model.vocab,
                                          eval_batches=cfg.train.eval_batches)
    out_dir = Path(cfg.train.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.yaml").write_text(to_yaml(cfg))

    sizes = dict(mesh.shape)
    devs = jax.devices()
    print(f"job      {cfg.name}  ->  {out_dir}")
    print(f"devices  {len(devs)} x {devs[0].platform} ({devs[0].device_kind})")
    print("mesh     " + " x ".join(f"{k}={v}" for k, v in sizes.items()))
    print(f"strategy {strategy.name(sizes)}")
    state, layout = init_train_state(C.build_model_fn(cfg.model, cfg.train.seed), tx, mesh, strategy)
    nbytes = layout.analytic_bytes()
    n_params = sum(a.size for a in jax.tree.leaves(layout.shapes))
    label = cfg.model.name if cfg.model.target is None else f"{cfg.model.name} ({cfg.model.target})"
    print(f"model    {label}: {n_params:,} parameters")
    from .analysis.memory import format_bytes

    print(f"state    {format_bytes(nbytes['total'])} per device (params {format_bytes(nbytes['params'])}, "
          f"optimizer {format_bytes(nbytes['opt'])})")
    tokens = _describe_data(cfg, batch_fn)

    step = make_train_step(loss_fn, tx, layout, strategy, clip_norm=cfg.optimizer.clip_norm, lr_schedule=schedule,
                           skip_nonfinite=True)
    evaluate = make_eval_fn(loss_fn, layout, strategy, eval_batches) if eval_batches else None
    return _train_with_checkpoints(cfg, state, layout, step, batch_fn, eval_batches, evaluate, n_params,
                                   title=f"{cfg.name}: {strategy.name(sizes)}", tokens_per_batch=tokens)


def _describe_data(cfg, batch_fn) -> int | None:
    """Print the data line; return the tokens per global batch (None: the batch holds no tokens).

    The GPT's batches hold ``batch_size x model.seq_len`` tokens; for a model of your own, a
    batch of ``data.target`` with a 2-D integer ``tokens`` leaf holds that many.
    """
    import numpy as np

    from .config import describe_batch

    d, gpt_tokens = cfg.data, cfg.data.batch_size * cfg.model.seq_len
    if d.kind != "import":
        print(f"data     {d.kind}: global batch {d.batch_size} x {cfg.model.seq_len} tokens")
        return gpt_tokens
    batch = batch_fn(0)
    print(f"data     {d.kind} {d.target}: global batch {d.batch_size} ({describe_batch(batch)})")
    if cfg.model.target is None:
        return gpt_tokens
    tokens = np.asarray(batch.get("tokens", 0))
    return int(tokens.size) if tokens.ndim == 2 and tokens.dtype.kind in "iu" else None


def _train_with_checkpoints(cfg, state, layout, step, batch_fn, eval_batches, evaluate, n_params: int, *,
                            title: str, tokens_per_batch: int | None) -> int:
    """Resume (``checkpoint.resume``), run :func:`jaxpar.train.loop.train` with checkpoints and metrics, sample."""
    import warnings

    from .train.checkpoint import Checkpointer, CheckpointWarning
    from .train.loop import LogOptions, NonFiniteError, train
    from .train.metrics import flops_per_token, is_main_process

    ck, lg, out_dir, main = cfg.checkpoint, cfg.logging, Path(cfg.train.out_dir), is_main_process()
    ckpt = Checkpointer(ck.dir, every=ck.every, keep=ck.keep, async_save=ck.async_save) if ck.enabled else None
    start = 0
    if ck.resume:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", CheckpointWarning)   # reported below, one line each
                restored = ckpt.restore(layout)
        except BaseException:
            ckpt.close()          # Orbax's background threads must finish before the interpreter exits
            raise
        for s, reason in restored.skipped:
            print(f"jaxpar train: warning: checkpoint step {s} in {ckpt.directory} is unreadable, using step "
                  f"{restored.step} instead: {reason}", file=sys.stderr)
        state, start = restored.state, int(restored.meta["data"]["next_step"])
        saved_seed = restored.meta.get("data", {}).get("seed", cfg.data.seed)
        if saved_seed != cfg.data.seed:
            print(f"jaxpar train: warning: the checkpoint was written with data.seed={saved_seed}, this run has "
                  f"data.seed={cfg.data.seed}: the data order differs from the original run.", file=sys.stderr)
        print(f"resume   step {start} from {restored.path}")
        if start >= cfg.train.steps:
            print(f"done     the checkpoint is at step {start} >= train.steps={cfg.train.steps}; nothing to do")
            ckpt.close()
            return 0
    m = cfg.model
    meta = {"config": cfg.name, "seed": cfg.train.seed, "model": m.name,
            "mesh": dict(layout.mesh.shape), "data": {"kind": cfg.data.kind, "seed": cfg.data.seed,
                                                      "batch_size": cfg.data.batch_size}}
    flops = None      # FLOPs per token: known for the GPT; for a model of your own there is no MFU
    if m.target is None:
        flops = flops_per_token(n_params - (m.vocab + m.seq_len) * m.embed, layers=m.layers, seq_len=m.seq_len,
                                embed=m.embed)
    elif lg.peak_flops:
        print("mfu      not reported: FLOPs per token are known only for the built-in GPT (logging.peak_flops)")
    try:
        log = LogOptions(log_every=cfg.train.log_every, out_dir=out_dir, progress=cfg.train.progress, title=title,
                         tensorboard=lg.tensorboard, tokens_per_batch=tokens_per_batch,
                         flops_per_token=flops, peak_flops=lg.peak_flops)
        state, summary = train(step, state, batch_fn, mesh=layout.mesh, steps=cfg.train.steps - start,
                               start_step=start, eval_fn=evaluate, eval_every=cfg.train.eval_every,
                               checkpointer=ckpt, checkpoint_meta=meta, on_nonfinite=cfg.train.on_nonfinite,
                               log=log)
    except NonFiniteError as e:
        print(f"jaxpar train: error: {e}", file=sys.stderr)
        return 1
    finally:
        if ckpt is not None:
            ckpt.close()
    if main:
        (out_dir / "summary.json").write_text(json.dumps(
            {k: v for k, v in vars(summary).items() if k not in ("losses", "evals")}, indent=2) + "\n")
    print(f"done     {summary.line()}")
    if summary.checkpoint_steps:
        print(f"saved    checkpoints of steps {summary.checkpoint_steps} in {ckpt.directory}")
    if summary.preempted:
        print(f"stopped  by {summary.preempted} after step {summary.end_step}; continue with --resume")
    elif lg.samples and m.target is None:      # text samples: the GPT only
        path = _write_samples(cfg, layout, state, batch_fn, eval_batches, out_dir, write=main)
        if main:
            print(f"samples  {path}")
    if main:
        print(f"wrote    {summary.metrics_path}, {summary.plot_path}")
    return 0


def _write_samples(cfg, layout, state, batch_fn, eval_batches, out_dir: Path, *, write: bool = True) -> str | None:
    """Greedy continuations of a few held-out prompts -> ``<out_dir>/samples.txt`` (bytes for text data).

    Every process calls it (gathering parameters spread over processes is a collective);
    only the one with ``write=True`` (process 0) decodes and writes the file.
    """
    from .train.sample import format_samples, greedy_generate, host_params

    params = host_params(state.params)
    if not write:
        return None

    rows = (eval_batches[0] if eval_batches else batch_fn(0))["tokens"][: cfg.logging.samples]
    plen = max(1, min(16, cfg.model.seq_len // 2))
    text = cfg.data.kind == "text"
    prompts = [bytes(r[:plen].astype("uint8")) if text else [int(t) for t in r[:plen]] for r in rows]
    outs = greedy_generate(layout.graphdef, params, prompts, context=cfg.model.seq_len,
                           new_tokens=cfg.logging.sample_tokens)
    path = out_dir / "samples.txt"
    path.write_text(format_samples(prompts, outs))
    return str(path)


def run_schedule(args: argparse.Namespace) -> int:
    """``jaxpar schedule``: print a pipeline schedule table, its bubble and peak in-flight micro-batches."""
    from .pipeline.schedules import bubble_fraction, get_schedule, peak_in_flight, to_text

    s = get_schedule(args.kind, args.stages, args.microbatches, args.virtual)
    print(to_text(s))
    print(f"bubble fraction {bubble_fraction(s):.4f}; peak in-flight micro-batches per stage {peak_in_flight(s)}")
    if args.png:
        from .pipeline.render import render_png

        print(f"wrote {render_png(s, args.png, timed=args.timed)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxpar", description="Declarative SPMD training on JAX meshes.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("train", help="train a model from a YAML config",
                       description="Train from CONFIG (YAML, may name a 'base:' YAML) with dotted overrides.")
    p.add_argument("config", help="YAML config file, e.g. configs/quickstart.yaml")
    p.add_argument("overrides", nargs="*", default=[], metavar="key=value",
                   help="dotted overrides, e.g. mesh.tensor=2")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    p.add_argument("--resume", action="store_true",
                   help="continue from the latest good checkpoint in checkpoint.dir (same as checkpoint.resume=true)")
    g = p.add_argument_group("many processes", "default: detected from SLURM (srun), Open MPI (mpirun) or a "
                             "Kubernetes Indexed Job; else one process. See docs/multihost.md.")
    g.add_argument("--coordinator", metavar="HOST:PORT", help="process 0's address (same on every process)")
    g.add_argument("--num-processes", type=int, metavar="N", help="number of processes in the job")
    g.add_argument("--process-id", type=int, metavar="I", help="this process's id, 0..N-1")
    g.add_argument("--local-devices", type=int, metavar="K", help="simulated CPU devices in this process")
    g.add_argument("--heartbeat-timeout", type=int, metavar="S",
                   help="seconds without heartbeats before a process counts as dead and the job ends (100)")

    p = sub.add_parser("schedule", help="print a pipeline schedule table",
                       description="Build a pipeline schedule and print its tick x stage table.")
    p.add_argument("--kind", required=True, help="gpipe, 1f1b, interleaved or zb-h1")
    p.add_argument("--stages", type=int, required=True, help="pipeline stages p")
    p.add_argument("--microbatches", type=int, required=True, help="micro-batches m")
    p.add_argument("--virtual", type=int, default=1, help="model chunks per stage (interleaved only)")
    p.add_argument("--png", help="also write a Gantt chart PNG here")
    p.add_argument("--timed", action="store_true", help="PNG: draw the cost-model timeline, not unit ticks")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``jaxpar`` script; returns the exit status."""
    from .config import ConfigError
    from .pipeline.cut import PipelineCutError
    from .rules import RulesError
    from .train.checkpoint import CheckpointError
    from .train.step import ExplicitDPError

    parser = build_parser()
    args, extra = parser.parse_known_args(argv)   # overrides may follow options: CONFIG --print-config k=v
    if extra and (args.command != "train" or any(x.startswith("-") for x in extra)):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command == "train":
        args.overrides = [*args.overrides, *extra]
    try:
        if args.command == "train":
            return run_train(args.config, args.overrides, print_config=args.print_config, resume=args.resume,
                             dist={k: getattr(args, k) for k in ("coordinator", "num_processes", "process_id",
                                                                 "local_devices", "heartbeat_timeout")})
        return run_schedule(args)
    except (ConfigError, RulesError, CheckpointError, PipelineCutError, ExplicitDPError) as e:
        print(f"jaxpar {args.command}: error: {e}", file=sys.stderr)
        return 2
    except ValueError as e:
        if args.command != "schedule":
            raise
        print(f"jaxpar schedule: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
