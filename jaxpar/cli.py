"""The ``jaxpar`` command line: the only place (with :mod:`jaxpar.config`) that reads a config.

Usage::

    jaxpar train CONFIG [key=value ...] [--print-config] [--resume]
                 [--coordinator HOST:PORT --num-processes N --process-id I] [--local-devices K]
    jaxpar schedule --kind 1f1b --stages 4 --microbatches 8 [--virtual V] [--png PATH] [--timed]
    jaxpar plan [--config CONFIG | --layers L --hidden H --heads A --seq S --vocab V --batch B]
                [--cluster PRESET|PATH] [--devices N] [--top K] [--json] [--verify]
    jaxpar inspect CONFIG [key=value ...] [--cluster PRESET|PATH]

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

__all__ = ["main", "build_parser", "setup_devices", "start_processes", "run_train", "run_schedule", "run_plan",
           "run_inspect"]


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
    model_fn = C.build_model_fn(cfg.model, cfg.train.seed)
    tx, schedule = C.build_optimizer(cfg.optimizer, cfg.train.steps, global_batch=cfg.data.batch_size,
                                     model_fn=model_fn, updates_per_step=_updates_per_step(cfg, strategy),
                                     freeze_variance_step=C.frozen_variance_step(strategy))
    loss_fn = C.build_loss_fn(cfg.model)
    ramp = C.build_ramp(cfg.data)      # an adaptive ramp decides during the run; batch_fn reads it
    batch_fn, eval_batches = C.build_data(cfg.data, seq_len=cfg.model.seq_len, vocab=cfg.model.vocab,
                                          eval_batches=cfg.train.eval_batches, ramp=ramp)
    out_dir = Path(cfg.train.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.yaml").write_text(to_yaml(cfg))

    sizes = dict(mesh.shape)
    devs = jax.devices()
    print(f"job      {cfg.name}  ->  {out_dir}")
    print(f"devices  {len(devs)} x {devs[0].platform} ({devs[0].device_kind})")
    print("mesh     " + " x ".join(f"{k}={v}" for k, v in sizes.items()))
    print(f"strategy {strategy.name(sizes)}")
    state, layout = init_train_state(model_fn, tx, mesh, strategy)
    noise = cfg.logging.noise_scale
    if noise.every is not None:        # the noise scale's moving averages live in the state (checkpointed)
        from .train.noise_scale import with_noise_scale

        state, layout = with_noise_scale(state, layout)
    nbytes = layout.analytic_bytes()
    n_params = sum(a.size for a in jax.tree.leaves(layout.shapes))
    label = cfg.model.name if cfg.model.target is None else f"{cfg.model.name} ({cfg.model.target})"
    print(f"model    {label}: {n_params:,} parameters")
    from .analysis.memory import format_bytes

    comm = _comm_bytes(layout)     # codec residuals, or the replicas of relaxed sync (state.comm)
    extra = f", codec / replicas {format_bytes(comm)}" if comm else ""
    print(f"state    {format_bytes(nbytes['total'] + comm)} per device (params {format_bytes(nbytes['params'])}, "
          f"optimizer {format_bytes(nbytes['opt'])}{extra})")
    tokens = _describe_data(cfg, batch_fn)

    step = make_train_step(loss_fn, tx, layout, strategy, clip_norm=cfg.optimizer.clip_norm, lr_schedule=schedule,
                           skip_nonfinite=True, noise_scale_every=noise.every, noise_scale_ema=noise.ema,
                           steps_per_call=cfg.parallel.steps_per_call)
    evaluate = make_eval_fn(loss_fn, layout, strategy, eval_batches) if eval_batches else None
    return _train_with_checkpoints(cfg, state, layout, step, batch_fn, eval_batches, evaluate, n_params,
                                   title=f"{cfg.name}: {strategy.name(sizes)}", tokens_per_batch=tokens, ramp=ramp)


def _comm_bytes(layout) -> int:
    """Bytes per device of ``state.comm`` (codec residuals, relaxed-sync replicas)."""
    import jax
    from jax.sharding import PartitionSpec

    from .zero import spec_shards

    sizes = dict(layout.mesh.shape)
    specs = jax.tree.leaves(layout.comm, is_leaf=lambda x: isinstance(x, PartitionSpec))
    return sum(a.size * a.dtype.itemsize // spec_shards(spec, sizes)
               for a, spec in zip(jax.tree.leaves(layout.comm_shapes), specs))


def _updates_per_step(cfg, strategy) -> int:
    """Optimizer updates per train step: ``microbatches / update_every`` per stage for PipeDream weight
    stashing (``parallel.schedule: pipedream`` on a pipeline), else 1."""
    if strategy.schedule == "pipedream" and cfg.mesh.pipe > 1:
        return max(1, strategy.microbatches // strategy.update_every)
    return 1


def _describe_data(cfg, batch_fn) -> int | None:
    """Print the data line; return the tokens per global batch (None: the batch holds no tokens).

    The GPT's batches hold ``batch_size x model.seq_len`` tokens; for a model of your own, a
    batch of ``data.target`` with a 2-D integer ``tokens`` leaf holds that many.
    """
    import numpy as np

    from .config import describe_batch

    d, gpt_tokens = cfg.data, cfg.data.batch_size * cfg.model.seq_len
    if d.batch_ramp.get("adaptive"):    # the batch changes: no fixed tokens per batch (records carry batch_size)
        r = d.batch_ramp
        print(f"data     {d.kind}: adaptive global batch {r['sizes'][0]}, growing among {list(r['sizes'])} toward "
              f"{r.get('factor', 1.0)} x the noise scale, decided every {r['every']} steps "
              f"(x {cfg.model.seq_len} tokens for the GPT)")
        return None
    if d.batch_ramp:
        ramp = ", ".join(f"{b} from step {s}" for b, s in zip(d.batch_ramp["sizes"], d.batch_ramp["steps"]))
        print(f"data     {d.kind}: global batch ramp {ramp} (x {cfg.model.seq_len} tokens for the GPT)")
        return None
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
                            title: str, tokens_per_batch: int | None, ramp=None) -> int:
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
        if hasattr(ramp, "load_state_dict"):      # an adaptive ramp's decisions so far
            ramp.load_state_dict(restored.meta.get("batch_ramp"))
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
                               ramp=ramp, steps_per_call=cfg.parallel.steps_per_call, log=log)
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


def _plan_model(args: argparse.Namespace):
    """The :class:`jaxpar.cost.ModelSpec` of ``--config`` (its model and ``data.batch_size``) or of the numbers."""
    from . import cost
    from .config import ConfigError

    if args.config:
        from .config import load_config

        cfg = load_config(args.config, [])
        m, batch = cfg.model, args.batch or cfg.data.batch_size
        if m.target is not None:
            from .config import build_model_fn

            return cost.from_nnx(build_model_fn(m), layers=args.layers or 1, hidden=args.hidden or 1,
                                 heads=args.heads or 1, seq=args.seq or 1, vocab=args.vocab or 1, batch=batch,
                                 name=m.name)
        return cost.gpt(m.layers, m.embed, m.heads, m.seq_len, m.vocab, batch, mlp=m.mlp, name=cfg.name)
    missing = [k for k in ("layers", "hidden", "heads", "seq", "vocab", "batch") if not getattr(args, k)]
    if missing:
        raise ConfigError(f"jaxpar plan needs --config CONFIG or the model's sizes; missing "
                          f"{', '.join('--' + k for k in missing)}.")
    return cost.gpt(args.layers, args.hidden, args.heads, args.seq, args.vocab, args.batch)


def run_plan(args: argparse.Namespace) -> int:
    """``jaxpar plan``: rank every plan of the model on the cluster (:func:`jaxpar.cost.plan`);
    ``--verify`` compiles the top plans on simulated CPU devices and compares memory and bytes."""
    from . import cost
    from .config import ConfigError

    try:
        cluster = cost.load_cluster(args.cluster, num_devices=args.devices)
        model = _plan_model(args)
        result = cost.plan(model, cluster, top=args.top, dtype=args.dtype, precision=args.precision)
    except (cost.ClusterError, cost.PlanError) as e:
        raise ConfigError(str(e)) from None
    if args.json:
        print(json.dumps({"cluster": cluster.name, "devices": cluster.num_devices, "model": model.name,
                          "parameters": model.n_params, "considered": result.considered,
                          "ranked": [e.row() for e in result.ranked[: args.top]],
                          "rejected": [{"plan": r.plan.name() if r.plan else None, "reason": r.reason}
                                       for r in result.rejected[: args.top]]}, indent=2))
    else:
        print(f"model    {model.name}: {model.n_params:,} parameters, batch {model.batch} x {model.seq}")
        print(f"cluster  {cluster.name}: {cluster.num_devices} devices ({cluster.nodes} x {cluster.devices_per_node})")
        print(f"plans    {result.considered} considered, {len(result.ranked)} fit, {len(result.rejected)} rejected")
        print(result.table(args.top))
        if result.rejected:
            print()
            print(result.rejected_table(min(args.top, 5)))
    if args.verify:
        _verify_plans(model, cluster, result.ranked[: args.top])
    return 0


def _verify_plans(model, cluster, estimates) -> None:
    """``--verify``: compile each plan's train step AOT on simulated CPU devices (jaxpar's GPT, fp32 Adam;
    nothing runs) and print predicted vs compiled argument bytes, peak memory and bytes per mesh axis."""
    from .analysis.memory import format_bytes, render_table
    from .config import ConfigError
    from .cost.memory import memory_per_device
    from .cost.verify import compile_and_compare

    n = cluster.num_devices
    if n > 256:
        raise ConfigError(f"--verify simulates the cluster's {n} devices on the CPU; at most 256 (use --devices).")
    setup_devices(n)
    import time

    print(f"\nverify   {len(estimates)} plans compiled ahead of time on {n} simulated CPU devices (jaxpar's GPT, "
          f"fp32 parameters and Adam moments; the prediction below uses the same precision)")
    rows = []
    for e in estimates:
        p = e.plan
        t0 = time.perf_counter()
        r = compile_and_compare(model, p)
        mem = memory_per_device(model, p.sizes, zero=p.zero, microbatches=p.microbatches, schedule=p.schedule,
                                virtual=p.virtual, remat=p.remat, sequence_parallel=p.sequence_parallel,
                                precision="fp32", activation_bytes=4)
        a = r["arguments"]
        peak = r["peak_bytes"]
        worst = max((v["error"] for v in r["axes"].values()), default=0.0)
        rows.append([p.name(), format_bytes(a["predicted"]), format_bytes(a["compiled"]), f"{a['error']:.2%}",
                     format_bytes(mem.total), format_bytes(peak), f"{mem.total / peak:.2f}",
                     " ".join(f"{ax}:{v['predicted'] / v['compiled']:.3f}" if v["compiled"] else f"{ax}:-"
                              for ax, v in r["axes"].items()) or "-", f"{worst:.1%}",
                     f"{time.perf_counter() - t0:.0f}"])
    print(render_table(["plan", "args predicted", "args compiled", "args error", "peak predicted", "peak compiled",
                        "peak ratio", "bytes per axis predicted/compiled (xla-cpu)", "worst axis error",
                        "compile s"], rows, right=[False] + [True] * 6 + [False, True, True]))


def _inspect_devices(cfg) -> int:
    """Devices the config trains on: ``train.devices``, else the product of its mesh sizes."""
    from .config import ConfigError

    if cfg.train.devices > 0:
        return cfg.train.devices
    sizes = [getattr(cfg.mesh, a) for a in ("data", "fsdp", "tensor", "pipe")]
    if any(s == -1 for s in sizes):
        raise ConfigError("jaxpar inspect: mesh has a -1 axis and train.devices=0, so the device count is unknown; "
                          "set train.devices=N (e.g. train.devices=8) or give every mesh axis a size.")
    n = 1
    for s in sizes:
        n *= s
    return n


def _abstract_layout(model_fn, tx, mesh, strategy):
    """``init_train_state``'s layout, traced with ``jax.eval_shape``: nothing is allocated or run."""
    import jax

    from .train.state import init_train_state

    box = {}

    def init():
        state, box["layout"] = init_train_state(model_fn, tx, mesh, strategy)
        return state

    jax.eval_shape(init)
    return box["layout"]


def _abstract_batch(cfg, mesh, batch_fn=None):
    """``ShapeDtypeStruct``s of one global batch, split over the data axes: ``tokens`` / ``targets``
    ``[data.batch_size, model.seq_len]`` int32, or the shapes of ``data.target``'s first batch."""
    import jax
    import numpy as np

    from .batch import batch_sharding

    sh = batch_sharding(mesh)
    if batch_fn is not None:
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype, sharding=sh),
                            batch_fn(0))
    spec = jax.ShapeDtypeStruct((cfg.data.batch_size, cfg.model.seq_len), np.int32, sharding=sh)
    return {"tokens": spec, "targets": spec}


def _spec_str(spec) -> str:
    return "(" + ", ".join("-" if d is None else d if isinstance(d, str) else "x".join(d) for d in spec) + ")"


def sharding_table(layout) -> str:
    """Per-parameter table: shape, logical names, mesh axes of parameters / gradients / optimizer
    moments, and the parameter's fp32 bytes on one device."""
    import math

    import jax
    from jax.sharding import PartitionSpec

    from .analysis.memory import format_bytes, render_table
    from .rules import path_str

    is_spec = lambda x: isinstance(x, PartitionSpec) or x is None   # noqa: E731
    flat = lambda t: [(path_str(p), v) for p, v in jax.tree_util.tree_flatten_with_path(t, is_leaf=is_spec)[0]]  # noqa: E731
    sizes = dict(layout.mesh.shape)
    logical, params = dict(flat(layout.logical)), dict(flat(layout.params))
    grads, opt = dict(flat(layout.grads)), dict(flat(layout.opt_param_specs))
    rows = []
    for name, a in flat(layout.shapes):
        spec = params.get(name) or PartitionSpec()
        pieces = math.prod(sizes[ax] for d in spec if d is not None for ax in ((d,) if isinstance(d, str) else d))
        rows.append([name, "x".join(map(str, a.shape)) or "()", _spec_str(logical.get(name) or ()),
                     _spec_str(spec), _spec_str(grads.get(name) or ()), _spec_str(opt.get(name) or ()),
                     format_bytes(a.size * a.dtype.itemsize / pieces)])
    return render_table(["parameter", "shape", "logical", "params", "grads", "opt moments", "bytes/device"], rows,
                        right=[False] * 6 + [True])


def _planner_view(cfg, mesh_sizes: dict, strategy, cluster_name: str):
    """``(model, plan, estimate)`` of the cost model for the config's GPT and strategy (None for other models)."""
    from . import cost
    from .cost.plan import evaluate

    if cfg.model.target is not None:
        return None
    m = cfg.model
    model = cost.gpt(m.layers, m.embed, m.heads, m.seq_len, m.vocab, cfg.data.batch_size, mlp=m.mlp, name=cfg.name)
    remat = {"none": "none", "full": "full"}.get(m.remat, "selective")
    plan = cost.Plan(pipe=mesh_sizes.get("pipe", 1), data=mesh_sizes.get("data", 1), fsdp=mesh_sizes.get("fsdp", 1),
                     tensor=mesh_sizes.get("tensor", 1), zero=strategy.zero if mesh_sizes.get("data", 1) > 1 else 0,
                     sequence_parallel=strategy.sequence_parallel, schedule=strategy.schedule,
                     virtual=strategy.virtual_stages, microbatches=strategy.microbatches, remat=remat)
    n = plan.devices
    cluster = cost.load_cluster(cluster_name)
    cluster = cluster.with_devices(n) if n <= cluster.devices_per_node or n % cluster.devices_per_node == 0 else \
        cost.load_cluster(cluster_name, nodes=1)
    dtype = "float32" if strategy.compute_dtype == "float32" else "bfloat16"
    if dtype not in cluster.peak_flops:
        dtype = next(iter(cluster.peak_flops))
    est = evaluate(model, plan, cluster, dtype=dtype, precision="fp32", lowering="xla-cpu")
    return model, plan, est


def run_inspect(config: str, overrides: Sequence[str], *, cluster: str = "cpu_sim") -> int:
    """``jaxpar inspect``: compile the config's train step ahead of time (simulated CPU devices when
    the config's devices are not there) and print the per-parameter sharding table, the collectives
    per mesh axis and the memory report, next to the cost model's prediction. No step runs."""
    from .config import ConfigError, load_config

    cfg = load_config(config, list(overrides))
    n = _inspect_devices(cfg)
    setup_devices(n)

    import jax

    from . import config as C
    from .analysis.hlo import collectives_table
    from .train.step import make_train_step

    C.check(cfg, num_devices=jax.device_count())
    mesh = C.build_mesh(cfg.mesh, devices=jax.devices()[:n])
    strategy = C.build_strategy(cfg.parallel)
    model_fn = C.build_model_fn(cfg.model, cfg.train.seed)
    tx, schedule = C.build_optimizer(cfg.optimizer, cfg.train.steps, global_batch=cfg.data.batch_size,
                                     model_fn=model_fn, freeze_variance_step=C.frozen_variance_step(strategy))
    loss_fn = C.build_loss_fn(cfg.model)
    batch_fn = None
    if cfg.data.kind == "import":
        batch_fn, _ = C.build_data(cfg.data, seq_len=cfg.model.seq_len, vocab=cfg.model.vocab, eval_batches=0)
    layout = _abstract_layout(model_fn, tx, mesh, strategy)
    step = make_train_step(loss_fn, tx, layout, strategy, clip_norm=cfg.optimizer.clip_norm, lr_schedule=schedule,
                           skip_nonfinite=True)
    sizes = dict(mesh.shape)
    devs = jax.devices()
    n_params = sum(a.size for a in jax.tree.leaves(layout.shapes))
    print(f"job      {cfg.name} (dry run: compiled ahead of time, no step runs)")
    print(f"devices  {n} x {devs[0].platform} ({devs[0].device_kind})")
    print("mesh     " + " x ".join(f"{k}={v}" for k, v in sizes.items()))
    print(f"strategy {strategy.name(sizes)}")
    print(f"model    {cfg.model.name if cfg.model.target is None else cfg.model.target}: {n_params:,} parameters")
    compiled = step.lower(layout.abstract_state(), _abstract_batch(cfg, mesh, batch_fn)).compile()

    print("\nparameters (mesh axes per dimension; '-' replicated)")
    print(sharding_table(layout))
    print("\ncollectives of the compiled step")
    from .analysis.hlo import collectives

    colls = collectives(compiled, mesh) if n > 1 else []
    print(collectives_table(colls) if colls else "(none)")
    _print_planner_view(cfg, compiled, mesh, strategy, cluster)
    return 0


def _print_planner_view(cfg, compiled, mesh, strategy, cluster: str) -> None:
    """``jaxpar inspect``'s table: the cost model's bytes per axis, arguments, temporaries and peak
    next to the compiled step's (for a pipelined plan, counted on the busiest stage)."""
    from .analysis.memory import format_bytes, memory_report, render_table
    from .cost.verify import compiled_bytes_per_axis

    sizes = dict(mesh.shape)
    rep = memory_report(compiled)
    view = _planner_view(cfg, sizes, strategy, cluster)
    got = compiled_bytes_per_axis(compiled, mesh, view[1] if view else None) if mesh.size > 1 else {}
    print(f"\nplanner  cost model (jaxpar.cost, lowering xla-cpu, cluster {cluster}) vs the compiled step, per device")
    headers, right = ["", "predicted", "compiled", "predicted / compiled"], [False, True, True, True]
    if view is None:
        rows = [[f"bytes over {a} per step", "-", format_bytes(g), "-"] for a, g in sorted(got.items())]
        rows += [["arguments (state + batch)", "-", format_bytes(rep.argument_bytes), "-"],
                 ["temporaries", "-", format_bytes(rep.temp_bytes), "-"],
                 ["peak (args + outputs + temps - aliased)", "-", format_bytes(rep.peak_bytes), "-"]]
        print(render_table(headers, rows, right=right))
        print("time     not predicted: the cost model describes the built-in GPT only (model.target is set)")
        return
    from .cost.memory import argument_bytes
    from .cost.time import bytes_per_axis, comms

    model, plan, est = view
    pred = bytes_per_axis(comms(model, plan, lowering="xla-cpu", compute_bytes=4, grad_bytes=4))
    args, mem, t = argument_bytes(model, plan.sizes, plan.zero), est.memory, est.time
    rows = [[f"bytes over {a} per step", format_bytes(pred.get(a, 0.0)), format_bytes(got.get(a, 0.0)),
             _ratio(pred.get(a, 0.0), got.get(a, 0.0))] for a in sorted(set(pred) | set(got))]
    rows += [["arguments (state + batch)", format_bytes(args), format_bytes(rep.argument_bytes),
              _ratio(args, rep.argument_bytes)],
             ["temporaries (model: activations + logits)", format_bytes(mem.activations + mem.logits),
              format_bytes(rep.temp_bytes), _ratio(mem.activations + mem.logits, rep.temp_bytes)],
             ["peak (args + outputs + temps - aliased)", format_bytes(mem.total), format_bytes(rep.peak_bytes),
              _ratio(mem.total, rep.peak_bytes)]]
    print(render_table(headers, rows, right=right))
    print(f"time     predicted {t.total * 1e3:.1f} ms per step on {cluster} (compute {t.compute * 1e3:.1f}, "
          f"data {t.data * 1e3:.1f}, tensor {t.tensor * 1e3:.1f}, pipeline {t.pipeline * 1e3:.1f}, update "
          f"{t.optimizer * 1e3:.1f}; bubble {t.bubble:.3f}); plan {plan.name()}")


def _ratio(p: float, g: float) -> str:
    return f"{p / g:.3f}" if g else ("-" if not p else "inf")


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

    p = sub.add_parser("plan", help="rank parallel plans with the cost model (nothing runs)",
                       description="Enumerate pipe x data x fsdp x tensor x ZeRO x schedule x micro-batches x "
                                   "remat on a cluster preset and rank them by predicted step time.")
    p.add_argument("--config", help="plan for this training config's model and global batch")
    p.add_argument("--cluster", default="h100", help="preset in configs/clusters/ or a YAML path (default h100)")
    p.add_argument("--devices", type=int, help="number of devices (default: the preset's)")
    for k in ("layers", "hidden", "heads", "seq", "vocab", "batch"):
        p.add_argument(f"--{k}", type=int, help=f"model {k} (without --config; --batch also overrides it)")
    p.add_argument("--dtype", default="bfloat16", help="compute dtype for the peak FLOP/s (bfloat16)")
    p.add_argument("--precision", default="mixed", help="bytes per parameter: fp32, mixed, megatron, mixed-fp32-accum")
    p.add_argument("--top", type=int, default=10, help="how many plans to show (10)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--verify", action="store_true", help="compile the top plans on simulated CPU devices and "
                                                         "compare predicted and compiled memory and bytes")

    p = sub.add_parser("inspect", help="dry run: compile a config's train step and show its shardings, "
                                       "collectives and memory next to the cost model's prediction",
                       description="Compile CONFIG's train step ahead of time (on simulated CPU devices of the "
                                   "config's device count when they are not there); no training step runs.")
    p.add_argument("config", help="YAML config file, e.g. configs/quickstart.yaml")
    p.add_argument("overrides", nargs="*", default=[], metavar="key=value", help="dotted overrides")
    p.add_argument("--cluster", default="cpu_sim", help="cluster preset for the prediction (default cpu_sim)")
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
    if extra and (args.command not in ("train", "inspect") or any(x.startswith("-") for x in extra)):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command in ("train", "inspect"):
        args.overrides = [*args.overrides, *extra]
    try:
        if args.command == "train":
            return run_train(args.config, args.overrides, print_config=args.print_config, resume=args.resume,
                             dist={k: getattr(args, k) for k in ("coordinator", "num_processes", "process_id",
                                                                 "local_devices", "heartbeat_timeout")})
        if args.command == "plan":
            return run_plan(args)
        if args.command == "inspect":
            try:
                return run_inspect(args.config, args.overrides, cluster=args.cluster)
            except Exception as e:
                from .cost import ClusterError, PlanError

                if isinstance(e, (ClusterError, PlanError)):
                    raise ConfigError(str(e)) from None
                raise
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
