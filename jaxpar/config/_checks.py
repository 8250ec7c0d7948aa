"""Semantic checks: :func:`check` lists every impossible setting of a :class:`JobConfig`.

It builds the library's objects (``GPTConfig``, ``Strategy``, ``MeshSpec``, the pipeline schedule,
the stage partition) and reports their errors under the YAML keys, as it does the library's ranges of
the optimizer's options (:func:`jaxpar.optimizers.hyperparameter_problem`) and of ``clip_norm``
(:func:`jaxpar.step._update.clip_norm_problem`, what ``make_train_step`` checks); it resolves the
import paths of a user model, loss and data function and checks their signatures (nothing is called). The combinations
of features, and what each feature needs, are the library's: the problems of the compatibility table
(:mod:`jaxpar.compat`) rendered with :data:`YAML_NAMES`; so are context parallelism's sequence and head rules
(:mod:`jaxpar.config._context_checks`). Only checks that span sections (batch size vs. mesh axes, model sizes
vs. ``mesh.tensor``, a ``parallel.context`` without a ``context`` axis) and the YAML's own keys, types and
paths are written out here.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
import re
from typing import Any, Callable, Sequence

from jaxpar.compat import LIBRARY_NAMES
from jaxpar.data._tokens import TOKEN_DTYPES
from jaxpar.errors import LoopError, RampError, int_problem
from jaxpar.mesh import MeshError
from jaxpar.optimizers import hyperparameter_problem
from jaxpar.step._update import clip_norm_problem
from jaxpar.parallel.pipeline._partition import PartitionError, check_stage_layers, uniform_layers
from jaxpar.parallel.pipeline._schedules import get_schedule
from jaxpar.run._watchdog import parse_step_timeout
from jaxpar.config._build import MODELS, build_gpt_config, build_strategy, mesh_error, mesh_spec
from jaxpar.config._optimizer_section import OPTIMIZERS, lr_scaling_problems, muon_problems
from jaxpar.config._context_checks import context_problems
from jaxpar.config._data_section import build_ramp
from jaxpar.config._hf_model import hf_problems, tokenizer_problems
from jaxpar.config._documents import documents_problems
from jaxpar.config._imports import call_problem, resolve_import
from jaxpar.config._schema import (DATA_KINDS, LR_SCHEDULES, NONFINITE_MODES, PROGRESS_MODES, USER_MODEL_KEYS,
                                   ConfigError, DataConfig, JobConfig, MeshConfig, ModelConfig, OptimizerConfig,
                                   ParallelConfig)


def choice(problems: list[str], key: str, value: Any, allowed: Sequence[Any]) -> None:
    """A problem unless ``value`` is one of ``allowed``: each check appends a line naming the YAML key.

    >>> p = []
    >>> choice(p, "data.pack", "tight", ("best_fit", "first_fit", "none")); at_least(p, "data.batch_size", 0, 1)
    >>> p
    ["data.pack='tight': unknown value; allowed: best_fit, first_fit, none.", 'data.batch_size=0: must be >= 1.']

    Args:
      problems: the list the problem is appended to.
      key: the YAML key, dotted (``data.pack``).
      value: its value.
      allowed: the values it may take.
    """
    if value not in allowed:
        problems.append(f"{key}={value!r}: unknown value; allowed: {', '.join(map(str, allowed))}.")


def at_least(problems: list[str], key: str, value: Any, low: float) -> None:
    """A problem unless ``value`` is ``None`` or ``>= low``.

    Args:
      problems: the list the problem is appended to.
      key: the YAML key, dotted (``data.batch_size``).
      value: its value, or None (not set).
      low: the smallest allowed value.
    """
    if value is not None and value < low:
        problems.append(f"{key}={value!r}: must be >= {low}.")


def collect(problems: list[str], build: Callable[[], Any]) -> Any:
    """Build something, keeping its error as a problem.

    Args:
      problems: the list a :class:`ConfigError`'s message is appended to.
      build: a function of no arguments that builds the object or raises :class:`ConfigError`.

    Returns:
      ``build()``, or None when it raised.
    """
    try:
        return build()
    except ConfigError as e:
        problems.append(str(e))
        return None


_RESERVED_DATA_KWARGS = ("step", "batch_size", "seed", "eval", "rows")


def data_problems(cfg: JobConfig) -> list[str]:
    """What is wrong with ``cfg.data`` (and how it fits the model, for ``data.kind: documents``).

    Args:
      cfg: the whole config.

    Returns:
      One line per problem, each naming its YAML key; empty when there is none.
    """
    d, p = cfg.data, []
    choice(p, "data.kind", d.kind, DATA_KINDS)
    choice(p, "data.token_dtype", d.token_dtype, TOKEN_DTYPES)
    at_least(p, "data.batch_size", d.batch_size, 1)
    at_least(p, "data.max_bytes", d.max_bytes, 1)
    if not 0 <= d.eval_fraction < 1:
        p.append(f"data.eval_fraction={d.eval_fraction!r}: must be in [0, 1).")
    for key in ("bos", "eos"):
        if not (isinstance(value := getattr(d, key), bool) or value == "auto"):
            p.append(f"data.{key}={value!r}: choose true, false or auto (what the tokenizer's own post-processor "
                     "adds, as transformers' tokenizer(text) does).")
    if d.kind == "import":
        _import_problems(p, d)
    return p + documents_problems(cfg)


def _import_problems(p: list[str], d: DataConfig) -> None:
    if d.target is None:
        p.append("data.target: missing; data.kind=import needs the batch function, 'package.module:batches' or "
                 "'path/to/file.py:batches', called as batches(step, batch_size=, seed=, **data.kwargs).")
        return
    for key in _RESERVED_DATA_KWARGS:
        if key in d.kwargs:
            fix = f"set data.{key} instead" if key in ("batch_size", "seed") else "jaxpar passes it"
            p.append(f"data.kwargs.{key}: reserved ({fix}); remove it.")
    if (fn := collect(p, lambda: resolve_import(d.target, "data.target"))) is not None and not any(
            k in d.kwargs for k in _RESERVED_DATA_KWARGS):
        if why := call_problem(fn, 0, batch_size=d.batch_size, seed=d.seed, **d.kwargs):
            p.append(f"data.target={d.target!r}: is called as batches(step, batch_size=data.batch_size, "
                     f"seed=data.seed, **data.kwargs), which does not fit it: {why}.")

def _mesh_sizes(cfg: JobConfig, num_devices: int | None) -> dict[str, int]:
    """``MeshSpec.sizes`` (checked against ``num_devices``; without it only the sizes themselves)."""
    spec = mesh_spec(cfg.mesh)
    try:
        if num_devices is None:
            known = math.prod(s for s in spec.requested().values() if isinstance(s, int) and s > 0)
            return spec.sizes(known)      # -1 resolves to 1 here: callers must not use it
        return spec.sizes(num_devices)
    except MeshError as e:
        devices = (f" (train.devices={cfg.train.devices}; 0 = the devices JAX has)"
                   if num_devices is not None else "")
        raise ConfigError(mesh_error(e, cfg.mesh) + devices) from None


def _schedule_problem(par: ParallelConfig, p: int) -> str | None:
    try:
        get_schedule(par.schedule, p, par.microbatches, par.virtual_stages)
    except ValueError as e:
        return (f"parallel.schedule={par.schedule!r} with mesh.pipe={p}, parallel.microbatches={par.microbatches}, "
                f"parallel.virtual_stages={par.virtual_stages}: {e}")
    return None


def _stage_layers_problem(par: ParallelConfig, layers: int | None, p: int) -> str | None:
    """``uniform_layers`` / ``check_stage_layers`` relabelled; ``layers=None`` (a user model): count only."""
    v = par.virtual_stages
    try:
        if par.stage_layers is not None:
            check_stage_layers(par.stage_layers, sum(par.stage_layers) if layers is None else layers, p, v)
        elif layers is not None:
            uniform_layers(layers, p * v)
    except PartitionError as e:
        msg = re.sub(r"(?<![\w.])stage_layers\b", "parallel.stage_layers", str(e))
        model = f"model.layers={layers}, " if layers is not None else ""
        return f"{model}mesh.pipe={p} x parallel.virtual_stages={v}: {msg}"
    return None


#: ``optimizer.*`` key -> the name :func:`jaxpar.optimizers.hyperparameter_problem` checks it under.
_HYPERPARAMETER_KEYS = {"lr": "learning_rate", "b1": "b1", "b2": "b2", "eps": "eps", "weight_decay": "weight_decay",
                        "momentum": "momentum", "trust_coefficient": "trust_coefficient"}


def _optimizer_problems(p: list[str], opt: OptimizerConfig) -> None:
    choice(p, "optimizer.name", opt.name, tuple(OPTIMIZERS))
    choice(p, "optimizer.lr_schedule", opt.lr_schedule, LR_SCHEDULES)
    for key, name in _HYPERPARAMETER_KEYS.items():          # the library's ranges (jaxpar.optimizers)
        if (why := hyperparameter_problem(name, getattr(opt, key))) is not None:
            p.append(f"optimizer.{key}={getattr(opt, key)!r}: {why}.")
    at_least(p, "optimizer.warmup_steps", opt.warmup_steps, 0)
    if not 0 <= opt.min_lr_ratio <= 1:
        p.append(f"optimizer.min_lr_ratio={opt.min_lr_ratio!r}: must be in [0, 1].")
    if (why := clip_norm_problem(opt.clip_norm)) is not None:                # make_train_step's check
        p.append(f"optimizer.clip_norm={opt.clip_norm!r}: {why.replace('None', 'null')}.")
    p.extend(lr_scaling_problems(opt.lr_scaling))
    if opt.name == "muon":
        p.extend(muon_problems(opt))
    elif opt.muon != (default := type(opt.muon)()):
        set_keys = [f.name for f in dataclasses.fields(opt.muon)
                    if getattr(opt.muon, f.name) != getattr(default, f.name)]
        p.append(f"optimizer.muon.{set_keys[0]}={getattr(opt.muon, set_keys[0])!r}: optimizer.muon is only used by "
                 f"optimizer.name=muon (here {opt.name!r}); remove optimizer.muon (the override ~optimizer.muon) or "
                 "choose muon.")
    for key in ("include", "exclude"):
        patterns = getattr(opt.trust_mask, key)
        if patterns and opt.name not in ("lars", "lamb"):
            p.append(f"optimizer.trust_mask.{key}={list(patterns)!r}: only used by optimizer.name=lars or lamb "
                     f"(here {opt.name!r}); remove it (~optimizer.trust_mask.{key}) or choose one of them.")
        for pattern in patterns:
            try:
                re.compile(pattern)
            except re.error as e:
                p.append(f"optimizer.trust_mask.{key}: {pattern!r} is not a valid regular expression ({e}); "
                         "write a Python regex searched in the parameter path, e.g. 'ln.*_scale$'.")




def _onebit_adam_problems(strategy, opt: OptimizerConfig) -> list[str]:
    """``parallel.compression.optimizer_momentum`` (1-bit Adam): Adam with that b1, no clip after the exchange."""
    b1 = getattr(strategy.compression, "optimizer_momentum", 0.0)
    if not b1:
        return []
    key, p = f"parallel.compression.optimizer_momentum={b1}", []
    if opt.name not in ("adam", "adamw"):
        p.append(f"{key} compresses Adam's first moment (1-bit Adam), but optimizer.name={opt.name!r}; use "
                 "optimizer.name: adamw (or adam).")
    elif opt.b1 != b1:
        p.append(f"{key} but optimizer.b1={opt.b1}: Adam's first moment must be the one compressed; set both to "
                 "the same value.")
    b2 = getattr(strategy.compression, "precondition", 0.0)
    if b2 and opt.name in ("adam", "adamw") and opt.b2 != b2:
        p.append(f"parallel.compression.precondition={b2} but optimizer.b2={opt.b2}: top-k ranks Adam's moment by "
                 "Adam's own second moment; set both to the same value.")
    return p


def _user_model_problems(p: list[str], m: ModelConfig) -> None:
    """Import paths and call signatures of a user model (nothing is called)."""
    target = collect(p, lambda: resolve_import(m.target, "model.target"))
    if target is not None:
        if "rngs" in m.kwargs:
            p.append("model.kwargs.rngs: set by jaxpar (nnx.Rngs(train.seed)); remove it.")
        elif why := call_problem(target, **m.kwargs, rngs=None):
            p.append(f"model.kwargs={m.kwargs}: model.target={m.target!r} is called as "
                     f"target(**model.kwargs, rngs=nnx.Rngs(train.seed)), which does not fit it: {why}.")
    if m.loss is None:
        p.append(f"model.loss: missing; with model.target={m.target!r} name the loss function, "
                 "'package.module:loss' or 'path/to/file.py:loss', called as loss(model, batch) -> scalar.")
    elif (loss := collect(p, lambda: resolve_import(m.loss, "model.loss"))) is not None:
        if why := call_problem(loss, None, None):
            p.append(f"model.loss={m.loss!r}: is called as loss(model, batch) -> scalar, which does not fit it: "
                     f"{why}.")


def _model_problems(p: list[str], cfg: JobConfig) -> Any:
    """Problems of the model section (and how it fits the data); the ``GPTConfig`` or None."""
    m, d, tr = cfg.model, cfg.data, cfg.train
    p.extend(tokenizer_problems(cfg) + (hf_problems(cfg) if m.hf is not None else []))   # .hf_model
    if m.hf is not None:
        return None
    if m.loss_chunks != 1:
        p.append(f"model.loss_chunks={m.loss_chunks}: the loss in pieces is model.hf's Decoder's; the built-in GPT "
                 "and a model of your own compute theirs whole (a loss of your own may call "
                 "jaxpar.parallel.linear_cross_entropy). Remove model.loss_chunks.")
    if m.target is not None:
        _user_model_problems(p, m)
        if d.kind != "import":
            p.append(f"data.kind={d.kind!r} makes token windows of model.seq_len for the built-in GPT; with "
                     f"model.target={m.target!r} use data.kind=import and data.target (your batch function).")
        return None
    choice(p, "model.name", m.name, tuple(MODELS))
    for key in USER_MODEL_KEYS[1:]:
        if getattr(m, key):
            p.append(f"model.{key}={getattr(m, key)!r}: only used with model.target (a model of your own); the "
                     f"built-in model.name={m.name!r} needs none.")
    gpt = collect(p, lambda: build_gpt_config(m))
    if d.kind == "text" and m.vocab < 256 and d.tokenizer is None:
        p.append(f"model.vocab={m.vocab}: byte-level text (data.kind=text) needs model.vocab >= 256.")
    if d.kind == "text" and tr.eval_batches > 0 and d.eval_fraction <= 0:
        p.append("data.eval_fraction=0 leaves no held-out text; set it > 0 or train.eval_batches=0.")
    return gpt


def _mesh_problems(cfg: JobConfig, made: "Built", num_devices: int | None) -> list[str]:
    """Checks across sections that need the mesh sizes (with ``num_devices``: also their product)."""
    try:
        sizes = _mesh_sizes(cfg, num_devices)
    except ConfigError as e:
        return [str(e)]
    if num_devices is None and -1 in (cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor, cfg.mesh.pipe, cfg.mesh.replica):
        return []  # the rest needs the device count
    problems, par, p = [], cfg.parallel, sizes["pipe"]
    if p > 1:
        layers = made.gpt.layers if made.gpt else None
        problems += [why for why in (_schedule_problem(par, p), _stage_layers_problem(par, layers, p)) if why]
    k = par.steps_per_call      # as make_train_step checks it; what it needs of the loop: jaxpar.compat._needs
    if why := int_problem(k, 1):
        problems.append(f"parallel.steps_per_call={k!r}: {why}.")
    t, gpt = sizes["tensor"], made.gpt
    if gpt is not None:
        dims = [("model.heads", gpt.heads), ("model.mlp (default 4 x model.embed)", gpt.mlp_dim),
                ("model.vocab", gpt.vocab)]
        if par.sequence_parallel:
            dims.append(("model.seq_len (sequence parallel)", gpt.seq_len))
        problems += [f"{key}={size} is not divisible by mesh.tensor={t}." for key, size in dims if size % t]
        if gpt.moe is not None and gpt.moe.experts % sizes["expert"]:
            problems.append(f"model.moe.experts={gpt.moe.experts} is not divisible by mesh.expert={sizes['expert']}: "
                            "each expert-parallel rank holds as many experts; choose model.moe.experts a multiple of "
                            "mesh.expert, or a mesh.expert that divides it.")
    if not (num_devices is None and cfg.mesh.context == -1):      # the rules of the context axis (or of none)
        m = cfg.model                    # model.hf's heads: hf_checkpoint; a model.target Decoder's: build_job
        problems += context_problems(cfg, made.strategy, sizes, seq_len=m.seq_len if m.target is None else None,
                                     heads=(gpt.heads, gpt.heads, "model.heads") if gpt is not None else None)
    n, what = _batch_divisor(cfg, sizes)
    if cfg.data.batch_size % n:
        grown = [f"mesh.{a}=-1 is {sizes[a]}" for a in ("data", "fsdp", "replica") if getattr(cfg.mesh, a) == -1]
        whence = f" ({', '.join(grown)}: what the other axes leave of {num_devices} devices)" if grown else ""
        problems.append(f"data.batch_size={cfg.data.batch_size} is not divisible by {what}{whence}.")
    return problems + _ramp_problems(made.ramp, n, what)


def _batch_divisor(cfg: JobConfig, sizes: dict[str, int]) -> tuple[int, str]:
    """What divides the global batch and every size of a ramp (data x fsdp x replica x micro-batches), in YAML keys."""
    n = sizes.get("data", 1) * sizes.get("fsdp", 1) * sizes.get("replica", 1) * cfg.parallel.microbatches
    rep = " x mesh.replica" if sizes.get("replica", 1) > 1 else ""
    return n, f"mesh.data x mesh.fsdp{rep} x parallel.microbatches = {n}"


#: The YAML keys of the fields the compatibility table's messages name that are not a ``mesh`` or ``parallel`` key
#: of the same name (:data:`YAML_NAMES`).
_KEYS_ELSEWHERE = {
    "local_clip": "parallel.compression.local_clip", "explicit_dp": "explicit_dp", "clip_norm": "optimizer.clip_norm",
    "noise_scale_every": "logging.noise_scale.every", "optimizer": "optimizer.name", "pipe_axis": "mesh.pipe",
    "replica_axis": "mesh.replica", "ramp": "data.batch_ramp", "ramp_steps": "data.batch_ramp.steps",
    "steps": "train.steps", "log_every": "train.log_every", "eval_every": "train.eval_every",
    "checkpoint_every": "checkpoint.every", "router_bias_rate": "model.moe.bias_rate",
    "aux_weight": "model.moe.aux_weight", "true": "true", "false": "false", "none": "null",
}


def _yaml_key(field_name: str) -> str | None:
    """The YAML key of a field the compatibility table's messages name: the ``mesh`` or ``parallel`` section's key
    of that name (the schema's), else :data:`_KEYS_ELSEWHERE`'s; None: the loop's arguments YAML has no key for."""
    for section, cls in (("mesh", MeshConfig), ("parallel", ParallelConfig)):
        if field_name in {f.name for f in dataclasses.fields(cls)}:
            return f"{section}.{field_name}"
    return _KEYS_ELSEWHERE.get(field_name)


#: The YAML key of each field that the compatibility table's messages name (the library's names:
#: :data:`jaxpar.compat.LIBRARY_NAMES`, the same keys, less those without a YAML key).
YAML_NAMES = {name: key for name in LIBRARY_NAMES if (key := _yaml_key(name))}


def table_setting(cfg: JobConfig, strategy: Any, sizes: dict[str, int], built_ramp: Any = None) -> Any:
    """The compatibility table's :class:`~jaxpar.compat.Setting` of a config.

    Args:
      cfg: the config.
      strategy: its :class:`~jaxpar.Strategy` (``build_strategy(cfg.parallel)``).
      sizes: its mesh sizes.
      built_ramp: ``data.batch_ramp``'s built ramp (:class:`Built`'s; None: built here, if it builds).

    Returns:
      The setting: the strategy, the mesh, the step's and the loop's options the table reads, and
      the router bias's rate (``model.moe.bias_rate`` > 0 of the GPT: the job adds the bias).
    """
    from jaxpar.compat._table import Setting

    ramp = cfg.data.batch_ramp or {}
    k = cfg.parallel.steps_per_call
    intervals = (("steps", cfg.train.steps), ("log_every", cfg.train.log_every),
                 ("eval_every", cfg.train.eval_every), ("checkpoint_every", cfg.checkpoint.every))
    bias = (cfg.model.moe or {}).get("bias_rate") if cfg.model.name == "gpt" else None   # the job adds a bias then
    on = isinstance(bias, (int, float)) and not isinstance(bias, bool) and bias > 0
    return Setting(strategy, sizes, steps_per_call=k if isinstance(k, int) and k >= 1 else 1,
                   clip_norm=cfg.optimizer.clip_norm, noise_scale_every=cfg.logging.noise_scale.every,
                   ramp=_ramp_kind(cfg, sizes, built_ramp or collect([], lambda: build_ramp(cfg.data))),
                   ramp_steps=tuple(s for s in ramp.get("steps") or () if isinstance(s, int)),
                   intervals=tuple((key, v) for key, v in intervals if isinstance(v, int)),
                   router_bias_rate=bias if on else None)


def _ramp_kind(cfg: JobConfig, sizes: dict[str, int], ramp: Any) -> str | None:
    """``"adaptive"`` or ``"fixed"`` for a ``data.batch_ramp`` (``ramp``: built) that the mesh can run; ``None``
    without one, or for one that does not build or divide (:func:`_ramp_problems` reports it)."""
    if ramp is None or _ramp_problems(ramp, *_batch_divisor(cfg, sizes)):
        return None
    return "adaptive" if cfg.data.batch_ramp.get("adaptive") is True else "fixed"


def _table_problems(cfg: JobConfig, made: Built, num_devices: int | None) -> list[str]:
    """The compatibility table's refusals and needs (:mod:`jaxpar.compat._table`) of this config, under
    its YAML keys. A ``-1`` mesh size that no device count resolves counts as 1 for the pairs (fewer
    features on); the needs then wait for the device count."""
    from jaxpar.compat._table import needs, problems

    try:
        sizes = _mesh_sizes(cfg, num_devices)
    except ConfigError:
        return []          # the mesh itself is reported elsewhere
    setting = table_setting(cfg, made.strategy, sizes, made.ramp)
    found = problems(setting)
    if num_devices is not None or -1 not in dataclasses.astuple(cfg.mesh):
        found += needs(setting)
    return [p.render(YAML_NAMES) for p in found]


def _ramp_problems(ramp: Any, n: int, what: str) -> list[str]:
    """Every size of ``data.batch_ramp``'s built ramp divisible like ``data.batch_size`` (what an adaptive
    ramp needs is the table's: :mod:`jaxpar.compat._needs`)."""
    try:
        if ramp is not None:
            ramp.check_divisible(n, what)
    except RampError as e:
        return [f"data.batch_ramp: {str(e).removeprefix('batch ramp: ')}"]
    return []


def _noise_scale_problems(p: list[str], cfg: JobConfig) -> None:
    """``logging.noise_scale.every`` / ``ema`` themselves."""
    ns = cfg.logging.noise_scale
    if ns.every is not None and (why := int_problem(ns.every, 1)):
        p.append(f"logging.noise_scale.every={ns.every!r}: {why} (measure every that many steps), or null to "
                 "measure nothing.")
    if not 0 <= ns.ema < 1:
        p.append(f"logging.noise_scale.ema={ns.ema!r}: must be in [0, 1), the decay of the moving averages per "
                 "measurement (0: none; e.g. 0.95).")


@dataclass(frozen=True)
class Built:
    """The library objects :func:`check` builds of a config, and its problems that need no device count.

    Built once per :func:`check`: :func:`jaxpar.config.build_job` runs on them.
    ``strategy``: the :class:`~jaxpar.Strategy`; ``gpt``: the GPT's ``GPTConfig`` (None for another
    model); ``ramp``: ``data.batch_ramp``'s ramp (None without one); each None also when it did not build.
    """

    strategy: Any
    gpt: Any
    ramp: Any
    problems: tuple[str, ...]


def _build(cfg: JobConfig) -> Built:
    """Build the library's objects of ``cfg`` and list the problems that need no device count."""
    p: list[str] = []
    opt, tr = cfg.optimizer, cfg.train
    gpt = _model_problems(p, cfg)
    strategy = collect(p, lambda: build_strategy(cfg.parallel))
    _optimizer_problems(p, opt)
    if strategy is not None:
        p.extend(_onebit_adam_problems(strategy, opt))
    p.extend(data_problems(cfg))
    ramp = collect(p, lambda: build_ramp(cfg.data))
    for key, low in (("steps", 1), ("log_every", 1), ("eval_every", 0), ("eval_batches", 0), ("devices", 0)):
        at_least(p, f"train.{key}", getattr(tr, key), low)
    choice(p, "train.progress", tr.progress, PROGRESS_MODES)
    choice(p, "train.on_nonfinite", tr.on_nonfinite, NONFINITE_MODES)
    try:
        parse_step_timeout(tr.step_timeout, "train.step_timeout")
    except LoopError as e:
        p.append(str(e))
    ck, lg = cfg.checkpoint, cfg.logging
    for key, value, low in (("checkpoint.every", ck.every, 0), ("checkpoint.keep", ck.keep, 1),
                            ("logging.samples", lg.samples, 0), ("logging.sample_tokens", lg.sample_tokens, 1)):
        at_least(p, key, value, low)
    if ck.resume and not ck.enabled:
        p.append("checkpoint.resume=true needs checkpoint.enabled=true (resuming also keeps saving).")
    if lg.peak_flops is not None and lg.peak_flops <= 0:
        p.append(f"logging.peak_flops={lg.peak_flops!r}: must be > 0 (FLOP/s of one device), or null for no MFU.")
    _noise_scale_problems(p, cfg)
    return Built(strategy, gpt, ramp, tuple(p))


def check(cfg: JobConfig, num_devices: int | None = None) -> Built:
    """Raise :class:`ConfigError` listing every impossible setting (with ``num_devices``: also the mesh on them).

    Builds the library's objects (``GPTConfig``, ``Strategy``, the batch ramp) once and reports their errors
    under the YAML keys, with the mesh's (``MeshSpec``, the pipeline schedule, the stage partition) and the
    compatibility table's; resolves the import paths of a user model, loss and data function (imports them,
    calls nothing). Then, with ``num_devices`` and no problem yet, :func:`check_on_devices`.

    Args:
      cfg: the loaded config.
      num_devices: the device count the mesh must fill (None: the mesh is not checked).

    Returns:
      The :class:`Built` objects, for :func:`jaxpar.config.build_job`.
    """
    made = _build(cfg)
    p = list(made.problems)
    if made.strategy is not None:
        p.extend(_table_problems(cfg, made, None))
        if not p:
            p.extend(_mesh_problems(cfg, made, None))
    if p and cfg.train.devices > 0:          # a mesh that train.devices cannot hold comes first:
        try:                                 # the other problems may follow from it
            _mesh_sizes(cfg, None)           # its own sizes' error is already in p
            _mesh_sizes(cfg, cfg.train.devices)
        except ConfigError as e:
            p = [str(e)] + [line for line in p if line != str(e)]
    _raise(p)
    if num_devices is not None:
        check_on_devices(cfg, made, num_devices)
    return made


def check_on_devices(cfg: JobConfig, made: Built, num_devices: int) -> None:
    """Raise :class:`ConfigError` listing what :func:`check`'s config cannot do on ``num_devices`` devices: the mesh's
    product and ``-1`` sizes, and the compatibility table and the batch on the sizes they give.

    Args:
      cfg: a config :func:`check` passed.
      made: what it built.
      num_devices: the device count the mesh must fill.
    """
    if made.strategy is not None:
        p = _table_problems(cfg, made, num_devices)
        _raise(p or _mesh_problems(cfg, made, num_devices))


def _raise(problems: list[str]) -> None:
    if problems:
        raise ConfigError("invalid config:\n  " + "\n  ".join(problems))
