"""The ``jaxpar`` command line: the only place (with :mod:`jaxpar.config`) that reads a config.

Usage::

    jaxpar train CONFIG [key=value ...] [--print-config] [--resume | --overwrite]
                 [--coordinator HOST:PORT --num-processes N --process-id I] [--local-devices K] [--step-timeout S]
    jaxpar check CONFIG [key=value ...] [--target h100:1x8] [--resume | --overwrite]   (jaxpar.commands)
    jaxpar schedule --kind 1f1b --stages 4 --microbatches 8 [--virtual V] [--png PATH] [--timed]
    jaxpar plan [--config CONFIG [key=value ...] | --layers L --hidden H --heads A --seq S --vocab V --batch B]
                [--cluster PRESET|PATH] [--devices N] [--target h100:2x8] [--top K] [--json] [--verify]
    jaxpar inspect CONFIG [key=value ...] [--cluster PRESET|PATH] [--target h100:2x8|tpu-v5e:4x4|...]
    jaxpar export CONFIG [key=value ...] --hf OUT [--step N] [--overwrite] [--dtype bfloat16|float32]
    jaxpar sample CONFIG [key=value ...] --prompt TEXT [--tokens N] [--step N]   (jaxpar.commands)
    jaxpar data prepare|show CONFIG [key=value ...] [--force | --steps A:B]     (jaxpar.commands)
    jaxpar profile CONFIG [key=value ...] [--steps A:B] [--cluster PRESET|PATH]  (jaxpar.commands)
    jaxpar calibrate [--out configs/clusters/cpu_sim.yaml] [--reps 9]          (jaxpar.devices.calibrate)
    jaxpar calibrate --device [--base h100] [--out FILE]      (jaxpar.devices.calibrate_device: one accelerator)

Example::

    $ jaxpar train configs/quickstart.yaml train.steps=50 optimizer.lr=1e-3
    $ jaxpar train configs/tp.yaml --print-config
    $ jaxpar train configs/quickstart.yaml train.steps=600 --resume   # continue from the latest checkpoint
    $ jaxpar train configs/quickstart.yaml --overwrite       # a new run; the earlier one moves aside
    $ jaxpar schedule --kind interleaved --stages 4 --microbatches 8 --virtual 2

``main(argv)`` returns the exit status (0 ok, 2 invalid config / arguments), so it
can be called in-process: ``main(["train", "configs/quickstart.yaml", "train.steps=3"])``.
A thin shell: :func:`jaxpar.config.build_job` builds what ``train``, ``inspect`` and ``plan`` run. While a command
runs (:func:`command_output`), XLA's C++ warnings are held back (``TF_CPP_MIN_LOG_LEVEL=0`` shows them) and
jaxpar's warnings print as ``XWarning: message``, without the source line that raised them.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import warnings
from typing import Iterator, Sequence

__all__ = ["main", "build_parser"]
_DIST = ("coordinator", "num_processes", "process_id", "local_devices", "heartbeat_timeout")
#: the commands that take key=value overrides (plan: of its --config)
_OVERRIDES = ("train", "check", "inspect", "export", "sample", "data", "profile", "plan")


def _run_schedule(args: argparse.Namespace) -> int:
    """``jaxpar schedule``: a pipeline schedule's tick x stage table, its bubble fraction and peak in-flight
    micro-batches, and with ``--png`` its Gantt chart.

    >>> _run_schedule(argparse.Namespace(kind="1f1b", stages=2, microbatches=2, virtual=1, png=None, timed=False))
    1f1b p=2 m=2 v=1 ticks=6 bubble=0.3333 peak_in_flight=(2, 1)
    s0 | F0 F1 .  B0 .  B1
    s1 | .  F0 B0 F1 B1 .
    bubble fraction 0.3333; peak in-flight micro-batches per stage (2, 1)
    0
    """
    from jaxpar.parallel.pipeline._schedules import bubble_fraction, get_schedule, peak_in_flight, to_text

    s = get_schedule(args.kind, args.stages, args.microbatches, args.virtual)
    print(to_text(s))
    print(f"bubble fraction {bubble_fraction(s):.4f}; peak in-flight micro-batches per stage {peak_in_flight(s)}")
    if args.png:
        from jaxpar.parallel.pipeline._render import render_png

        print(f"wrote {render_png(s, args.png, timed=args.timed)}")
    return 0


def _run_config_command(args: argparse.Namespace) -> int:
    """``jaxpar check``, ``inspect``, ``export``, ``sample`` and ``data``: the commands that read a config."""
    from jaxpar.commands import inspect_config, run_check, run_export, run_prepare, run_profile, run_sample, run_show
    from jaxpar.config import load_config

    if args.command == "profile":
        return run_profile(args.config, args.overrides, steps=args.steps, cluster=args.cluster,
                           dist={k: getattr(args, k) for k in _DIST})
    if args.command == "export":
        return run_export(args.config, args.overrides, args.hf, step=args.step, overwrite=args.overwrite,
                          dtype=args.dtype)
    if args.command == "sample":
        return run_sample(args.config, args.overrides, args.prompt, tokens=args.tokens, step=args.step)
    if args.command == "data" and args.data_command == "prepare":
        return run_prepare(args.config, args.overrides, force=args.force)
    if args.command == "data":
        return run_show(args.config, args.overrides, steps=args.steps, chars=args.chars,
                        dist={k: getattr(args, k) for k in _DIST})
    if args.command == "check":
        return run_check(args.config, args.overrides, target=args.target, resume=args.resume,
                         overwrite=args.overwrite)
    cfg = load_config(args.config, list(args.overrides))
    return inspect_config(cfg, cluster=args.cluster, target=args.target)   # compile the step ahead of time


def _add_process_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("many processes", "default: detected from SLURM (srun), Open MPI (mpirun) or a "
                             "Kubernetes Indexed Job; else one process. See docs/multihost.md.")
    g.add_argument("--coordinator", metavar="HOST:PORT", help="process 0's address (same on every process)")
    g.add_argument("--num-processes", type=int, metavar="N", help="number of processes in the job")
    g.add_argument("--process-id", type=int, metavar="I", help="this process's id, 0..N-1")
    g.add_argument("--local-devices", type=int, metavar="K", help="simulated CPU devices in this process")
    g.add_argument("--heartbeat-timeout", type=int, metavar="S",
                   help="seconds without heartbeats before a process counts as dead and the job ends (100)")


def _config_parser(sub, name: str, summary: str, description: str | None) -> argparse.ArgumentParser:
    """A command of ``sub`` that takes ``CONFIG [key=value ...]``."""
    p = sub.add_parser(name, help=summary, description=description)
    p.set_defaults(command_parser=p)
    p.add_argument("config", help="YAML config file, e.g. configs/quickstart.yaml (a run's own: <train.out_dir>/"
                                  "config.yaml)")
    p.add_argument("overrides", nargs="*", default=[], metavar="key=value",
                   help="dotted overrides, e.g. mesh.tensor=2; ~key drops a key of the YAML (its default holds)")
    return p


def _add_config_commands(sub) -> None:
    """``train``, ``check``, ``inspect``, ``export``, ``sample`` and ``profile``."""
    p = _config_parser(sub, "train", "train a model from a YAML config",
                       "Train from CONFIG (YAML, may name a 'base:' YAML) with dotted overrides.")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    p.add_argument("--resume", action="store_true",
                   help="continue from the latest good checkpoint in checkpoint.dir (same as checkpoint.resume=true)")
    p.add_argument("--overwrite", action="store_true", help="start a new run where train.out_dir holds another: "
                   "move that run (its files and checkpoints) aside to <train.out_dir>.old-N first; nothing is deleted")
    p.add_argument("--step-timeout", metavar="SPEC", help="end a hung run: a step with no progress "
                   "for SPEC (seconds, e.g. 600; or 10x, 10 times the median step time, at least 300 s; 10x:60, at "
                   "least 60 s; 0: never) stops every process with its Python stacks in <train.out_dir>/hang-p<I>.txt "
                   "and exit status 124 (default: train.step_timeout, 10x)")
    _add_process_options(p)
    p = _config_parser(sub, "check", "check what jaxpar train would refuse: the config on its devices, the data "
                       "files, the run directory, the train step built; nothing compiled or run",
                       "Run every check of CONFIG that needs no compiled program, in jaxpar train's order: the "
                       "config's, the devices train would find (train.devices=0: JAX's own; --target: the target's "
                       "count, simulated), the mesh on them, the data files (data.paths, data.sources; not read), the "
                       "run directory (an earlier run in train.out_dir; with --resume, a complete checkpoint), the "
                       "train state's layout and the train step's options.")
    p.add_argument("--target", help="check the mesh on a GPU / TPU target's device count: h100:1x8, 2xh100:8 "
                                    "(docs/targets.md; jaxpar inspect --target compiles for it)")
    p.add_argument("--resume", action="store_true", help="check as jaxpar train --resume: a complete checkpoint")
    p.add_argument("--overwrite", action="store_true", help="check as jaxpar train --overwrite: an earlier run "
                                                            "in train.out_dir would be moved aside")
    p = _config_parser(sub, "inspect", "dry run: compile a config's train step and show its shardings, collectives "
                       "and memory next to the cost model's prediction", "Compile CONFIG's train step ahead of time "
                       "(on simulated CPU devices of the config's device count when they are not there); no training "
                       "step runs.")
    p.add_argument("--cluster", help="cluster preset for the prediction (default: the target's, else cpu_sim)")
    p.add_argument("--target", help="compile with the real compiler of a GPU / TPU target, without the hardware: "
                                    "h100:2x8 (hosts x GPUs), tpu-v5e:4x4, 2xtpu-v5e:16x16 (docs/targets.md)")
    p = _config_parser(sub, "export", "write a run's weights as a Hugging Face checkpoint (model.hf)",
                       "Restore CONFIG's run (its latest jaxpar checkpoint, or --step N; before any, model.hf's "
                       "imported weights) and write them as a Hugging Face checkpoint.")
    p.add_argument("--hf", required=True, metavar="OUT", help="the directory to write (new or empty)")
    p.add_argument("--step", type=int, metavar="N", help="the jaxpar checkpoint of step N (default: the latest)")
    p.add_argument("--overwrite", action="store_true", help="replace the checkpoint files of a non-empty OUT")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), help="the tensors' dtype (default: the source's)")
    p = _config_parser(sub, "sample", "continue a prompt greedily with a run's weights", "Greedy continuation of "
                       "--prompt by CONFIG's run (its latest checkpoint, or --step N; before any, model.hf's imported "
                       "weights), decoded and printed.")
    p.add_argument("--prompt", required=True, help="the text to continue")
    p.add_argument("--tokens", type=int, metavar="N", help="new tokens (default: logging.sample_tokens)")
    p.add_argument("--step", type=int, metavar="N", help="the jaxpar checkpoint of step N (default: the latest)")
    p = _config_parser(sub, "profile", "trace a few steps and show each one's time by compute and collective next "
                       "to the cost model", "Train CONFIG's steps 0 .. B-1 into <train.out_dir>/profile (no "
                       "checkpoints), trace A .. B-1 with jax.profiler (TensorBoard and Perfetto open it) and print "
                       "a table per traced step: compute, each collective kind per mesh axis, host transfer, data "
                       "wait, idle, beside the cost model's terms (docs/profiling.md).")
    p.add_argument("--steps", default="2:4", metavar="A:B", help="trace the steps A .. B-1 (default 2:4)")
    p.add_argument("--cluster", help="cluster preset or YAML of the cost model's terms (default: cpu_sim on the CPU, "
                                     "h100 on GPUs)")
    _add_process_options(p)


def _add_tool_commands(sub) -> None:
    """``schedule``, ``plan``, ``data`` and ``calibrate``."""
    p = sub.add_parser("schedule", help="print a pipeline schedule table",
                       description="Build a pipeline schedule and print its tick x stage table.")
    p.add_argument("--kind", required=True, help="gpipe, 1f1b, interleaved or zb-h1")
    p.add_argument("--stages", type=int, required=True, help="pipeline stages p")
    p.add_argument("--microbatches", type=int, required=True, help="micro-batches m")
    p.add_argument("--virtual", type=int, default=1, help="model chunks per stage (interleaved only)")
    p.add_argument("--png", help="also write a Gantt chart PNG here")
    p.add_argument("--timed", action="store_true", help="PNG: draw the cost-model timeline, not unit ticks")
    p = sub.add_parser("plan", help="rank parallel plans with the cost model (nothing runs)",
                       usage="jaxpar plan [--config CONFIG [key=value ...] | --layers N --hidden N --heads N --seq N "
                             "--vocab N --batch N] [options]",
                       description="Enumerate pipe x data x fsdp x tensor x ZeRO x schedule x micro-batches x "
                                   "remat on a cluster preset and rank them by predicted step time.")
    p.add_argument("--config", help="plan for this training config's model and global batch; key=value overrides "
                                    "of it may follow (e.g. parallel.fp8.recipe=tensorwise), as for jaxpar train")
    p.add_argument("--cluster", help="preset in configs/clusters/ or a YAML path (default: the target's, else h100)")
    p.add_argument("--target", help="plan for a GPU / TPU target (h100:2x8, tpu-v5e:4x4): its devices and cluster; "
                                    "--verify then compiles with its real compiler (docs/targets.md)")
    p.add_argument("--devices", type=int, help="number of devices (default: the preset's)")
    g = p.add_argument_group("the model's sizes", "without --config: jaxpar's GPT of these sizes (all needed). With "
                             "--config: --batch replaces its global batch, and the others give a model of your own "
                             "(model.target) the sizes the cost model cannot read from its parameters")
    for k, what in (("layers", "layers"), ("hidden", "model width"), ("heads", "attention heads"),
                    ("seq", "sequence length"), ("vocab", "vocabulary size"), ("batch", "global batch, in sequences")):
        g.add_argument(f"--{k}", type=int, metavar="N", help=what)
    p.add_argument("--dtype", help="compute dtype of the peak FLOP/s (default: the config's, else bfloat16)")
    p.add_argument("--precision", help="bytes per parameter: fp32, mixed, megatron, mixed-fp32-accum (default: "
                   "mixed; fp32, jaxpar's own, with --config)")
    p.add_argument("--contexts", type=lambda v: tuple(int(x) for x in v.split(",")),
                   help="context-parallel degrees to search, e.g. 1,2,4,8 (default: all divisors from 8k tokens, "
                   "none below); --context-methods ring,all_gather,ulysses (all)")
    p.add_argument("--context-methods", type=lambda v: tuple(v.split(",")), default=("ring", "all_gather", "ulysses"))
    p.add_argument("--top", type=int, default=10, help="how many plans to show (10)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--write", metavar="FILE", help="write --config with the chosen plan's overrides as a new YAML file")
    p.add_argument("--choose", type=int, default=1, metavar="N", help="the plan --write writes, by rank (1)")
    p.add_argument("--verify", action="store_true", help="compile the top plans on simulated CPU devices and "
                                                         "compare predicted and compiled memory and bytes")
    p = sub.add_parser("data", help="prepare a token cache, or show the batches a run sees",
                       description="Work with data.kind=documents corpora (docs/data.md).")
    inner = p.add_subparsers(dest="data_command", required=True, metavar="ACTION")
    q = _config_parser(inner, "prepare", "tokenize data.sources into data.cache, once", None)
    q.add_argument("--force", action="store_true", help="tokenize again even where the cache is up to date")
    q = _config_parser(inner, "show", "print each global batch's sha256, packing efficiency and a decoded row", None)
    q.add_argument("--steps", default="0:4", metavar="A:B", help="the steps A .. B-1 (default 0:4)")
    q.add_argument("--chars", type=int, default=160, metavar="N", help="characters of the decoded row (160)")
    _add_process_options(q)
    p = sub.add_parser("calibrate", help="measure this machine's simulated CPU mesh for the cost model",
                       description="Time collectives, a matmul chain and a streaming kernel on 8 simulated CPU "
                                   "devices, fit the cost model's link and compute rates, and write the cluster "
                                   "description jaxpar plan / inspect / profile use on the CPU (docs/planning.md).")
    p.add_argument("--out", default=None, help="the YAML to write (default configs/clusters/cpu_sim.yaml)")
    p.add_argument("--reps", type=int, default=9, help="interleaved rounds per measurement (9; about 50 s on 2 cores)")
    p.add_argument("--device", action="store_true", help="measure the attached accelerator instead (one GPU): its "
                   "GEMM efficiency curve and memory bandwidth, written into a copy of --base's preset "
                   "(jaxpar.devices.calibrate_device); --out then defaults to configs/clusters/<base>_measured.yaml")
    p.add_argument("--base", default="h100", help="with --device: the preset whose links and peaks the file keeps")


def _run_calibrate(args) -> int:
    from jaxpar.devices import calibrate, calibrate_device

    if args.device:
        calibrate_device(args.out or f"configs/clusters/{args.base}_measured.yaml", base=args.base, reps=args.reps)
        return 0
    from jaxpar.devices._distributed import setup_devices

    setup_devices(8)                # the simulated CPU mesh the cpu_sim cluster describes
    calibrate(args.out or "configs/clusters/cpu_sim.yaml", reps=args.reps)
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``jaxpar`` command's argument parser, every command included; each command's own parser is its
    ``command_parser`` default (an error shows that command's usage)."""
    parser = argparse.ArgumentParser(prog="jaxpar", description="Declarative SPMD training on JAX meshes.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_config_commands(sub)
    _add_tool_commands(sub)
    for p in sub.choices.values():       # data's actions (prepare, show): their own (_config_parser's)
        p.set_defaults(command_parser=p)
    return parser


def _unknown_arguments(extra: Sequence[str], command: argparse.ArgumentParser, overrides: bool) -> str:
    """The error for arguments that ``command`` has no option for; where it takes ``key=value`` overrides, an
    option named like a config key (``--steps 10``) is shown as its override (``train.steps=10``)."""
    from jaxpar.config._load import keys_named

    options = [i for i, x in enumerate(extra) if x.startswith("--")]
    if not overrides or not options:
        return f"unrecognized arguments: {' '.join(extra)}"
    hints = []
    for i in options:
        name, eq, value = extra[i][2:].partition("=")
        if not eq and i + 1 < len(extra) and not extra[i + 1].startswith("-") and "=" not in extra[i + 1]:
            value = extra[i + 1]
        hints += [f"{key}={value or 'VALUE'}" for key in keys_named(name.replace("-", "_"))]
    named = ", ".join(extra[i].partition("=")[0] for i in options)
    verb = "is not an option" if len(options) == 1 else "are not options"
    return (f"{named} {verb} of {command.prog} ({command.prog} -h lists them): a config setting is a key=value "
            f"override with its dotted key, e.g. {' or '.join(hints) or 'train.steps=100'}.")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``jaxpar`` script.

    Args:
      argv: the arguments after ``jaxpar`` (None: ``sys.argv[1:]``).

    Returns:
      The exit status: 0 ok, 2 an invalid config or arguments (one line on stderr).
    """
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)   # overrides may follow options: CONFIG --print-config k=v
    if extra and (args.command not in _OVERRIDES or any(x.startswith("-") for x in extra)):
        args.command_parser.error(_unknown_arguments(extra, args.command_parser, args.command in _OVERRIDES))
    if args.command in _OVERRIDES:
        args.overrides = [*getattr(args, "overrides", []), *extra]
    with command_output():
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    """Run the parsed command; a :class:`~jaxpar.errors.JaxparError` is one line on stderr and status 2."""
    from jaxpar.errors import JaxparError

    try:
        if args.command == "train":
            from jaxpar.commands import run_train

            return run_train(args.config, args.overrides, print_config=args.print_config, resume=args.resume,
                              overwrite=args.overwrite, dist={k: getattr(args, k) for k in _DIST},
                              step_timeout=args.step_timeout)
        if args.command == "plan":
            from jaxpar.commands import run_plan

            return run_plan(args)
        if args.command == "schedule":
            return _run_schedule(args)
        if args.command == "calibrate":
            return _run_calibrate(args)
        return _run_config_command(args)
    except JaxparError as e:        # an input jaxpar names as wrong; any other error keeps its traceback
        print(f"jaxpar {args.command}: error: {e}", file=sys.stderr)
        return 2


# ---------------------------------------------------------------------------- what a command prints besides its reports
#: XLA's C++ log level while a command runs: errors only (2), so no compiler warnings (``[SPMD] Involuntary full
#: rematerialization``, ``hlo_rematerialization.cc: Can't reduce memory use``, ``sort_rewriter.cc: Missing deviceless
#: CUB scratch size data``), where ``TF_CPP_MIN_LOG_LEVEL`` is unset or ``import jax``'s own default, 1 (warnings
#: up). ``TF_CPP_MIN_LOG_LEVEL=0`` shows them.
QUIET_XLA = 2


def _absl_min_log_level(level: int) -> None:
    """Set the loaded jaxlib's native log level (the plugins loaded later read ``TF_CPP_MIN_LOG_LEVEL``)."""
    try:
        from jaxlib.utils import absl_set_min_log_level
    except ImportError:             # a jaxlib without it: its level stays
        return
    absl_set_min_log_level(level)


def _format_warning(formatted):
    """``warnings.formatwarning`` that writes jaxpar's warnings as ``XWarning: message``, without the path and
    source line of the call (their messages say what to change); any other warning as ``formatted`` does."""
    package = os.path.dirname(os.path.abspath(__file__)) + os.sep

    def format_warning(message, category, filename, lineno, line=None):
        if category.__module__.split(".")[0] == "jaxpar" or os.path.abspath(filename).startswith(package):
            return f"{category.__name__}: {message}\n"
        return formatted(message, category, filename, lineno, line)

    return format_warning


@contextlib.contextmanager
def command_output() -> Iterator[None]:
    """What a command prints, while it runs: XLA's C++ log lines from errors up only (:data:`QUIET_XLA`; a
    ``TF_CPP_MIN_LOG_LEVEL`` of 0, 2 or 3 is kept), and jaxpar's warnings without their source lines. Both are
    restored after, so ``main`` called in-process leaves the caller's settings as they were."""
    before = os.environ.get("TF_CPP_MIN_LOG_LEVEL")
    quiet = before in (None, "", "1")           # unset, or import jax's setdefault: nobody chose it
    if quiet:
        os.environ["TF_CPP_MIN_LOG_LEVEL"] = str(QUIET_XLA)      # the CUDA plugin and libtpu, loaded later
        _absl_min_log_level(QUIET_XLA)
    formatted = warnings.formatwarning          # only the printing: a recorder (pytest.warns) gets them as ever
    warnings.formatwarning = _format_warning(formatted)
    try:
        yield
    finally:
        warnings.formatwarning = formatted
        if quiet:
            if before is None:
                os.environ.pop("TF_CPP_MIN_LOG_LEVEL", None)
            else:
                os.environ["TF_CPP_MIN_LOG_LEVEL"] = before
            _absl_min_log_level(int(before or 0))


if __name__ == "__main__":
    sys.exit(main())
