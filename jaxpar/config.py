"""Job configuration: typed frozen dataclasses, YAML with ``base:`` inheritance, dotted overrides,
checks that name the offending key, and the builders that turn a config into library objects.

This module and :mod:`jaxpar.cli` are the only places that read a config; everything
below them takes a ``Mesh``, rules and plain values.

Example::

    >>> cfg = load_config("configs/quickstart.yaml", ["mesh.tensor=1", "mesh.data=4"])   # doctest: +SKIP
    >>> cfg.mesh                                                                         # doctest: +SKIP
    MeshConfig(data=4, fsdp=2, tensor=1, pipe=1)
    >>> load_config("configs/quickstart.yaml", ["model.embedd=64"])                      # doctest: +SKIP
    ConfigError: overrides: unknown key 'model.embedd'; allowed keys under 'model': name, vocab, ...
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import optax
from flax import nnx
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from .mesh import MeshError, MeshSpec, make_mesh
from .models.gpt import GPT, REMAT_POLICIES, GPTConfig, lm_loss
from .pipeline.schedules import SCHEDULE_KINDS
from .strategy import COMPUTE_DTYPES, Strategy
from .train import data as data_lib
from .zero import ZERO_STAGES

__all__ = [
    "ConfigError", "ModelConfig", "MeshConfig", "ParallelConfig", "OptimizerConfig", "DataConfig",
    "TrainConfig", "CheckpointConfig", "LoggingConfig", "JobConfig", "ModelEntry", "MODELS", "OPTIMIZERS", "SCHEDULES", "DATA_KINDS", "NONFINITE_MODES",
    "load_config", "merge_layers", "parse_overrides", "to_yaml", "check",
    "build_mesh", "build_strategy", "build_optimizer", "build_model_fn", "build_loss_fn", "build_data",
]


class ConfigError(ValueError):
    """A configuration is invalid; the message names the key (e.g. ``mesh.tensor``)."""


# ----------------------------------------------------------------------------- schema
@dataclass(frozen=True)
class ModelConfig:
    """``name`` picks an entry of :data:`MODELS`; the rest are :class:`GPTConfig` fields."""

    name: str = "gpt"
    vocab: int = 256
    seq_len: int = 64
    embed: int = 64
    heads: int = 4
    layers: int = 2
    mlp: int | None = None          # None: 4 * embed
    remat: str = "none"
    scan_layers: bool = True
    init_std: float = 0.02


@dataclass(frozen=True)
class MeshConfig:
    """Mesh axis sizes; one may be -1 (the rest of the devices)."""

    data: int = 1
    fsdp: int = 1
    tensor: int = 1
    pipe: int = 1


@dataclass(frozen=True)
class ParallelConfig:
    """See :class:`jaxpar.Strategy`."""

    zero: int = 0
    sequence_parallel: bool = False
    microbatches: int = 1           # accumulation steps; with mesh.pipe > 1 the pipeline's micro-batches
    compute_dtype: str = "float32"
    schedule: str = "1f1b"          # mesh.pipe > 1: gpipe | 1f1b | interleaved | zb-h1
    virtual_stages: int = 1         # interleaved: model chunks per stage
    stage_layers: tuple[int, ...] | None = None   # layers per virtual stage (uneven); null = even


@dataclass(frozen=True)
class OptimizerConfig:
    """``adamw`` decays weights decoupled; ``adam`` / ``sgd`` add ``weight_decay * w`` to the gradient."""

    name: str = "adamw"
    lr: float = 1e-3
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    momentum: float = 0.9           # sgd only (0 = plain SGD)
    warmup_steps: int = 0
    schedule: str = "cosine"        # after warm-up: constant | cosine | linear (to min_lr_ratio * lr)
    min_lr_ratio: float = 0.1
    clip_norm: float | None = 1.0   # None: no clipping


@dataclass(frozen=True)
class DataConfig:
    """``text``: bytes of ``paths`` (files / globs; empty = Python stdlib sources). ``tokens``: one
    pre-tokenized ``.bin`` (``token_dtype``) or ``.npy`` file in ``paths``. ``batch_size`` is global."""

    kind: str = "text"
    paths: tuple[str, ...] = ()
    max_bytes: int = data_lib.DEFAULT_MAX_BYTES
    token_dtype: str = "uint16"     # kind=tokens, .bin files
    batch_size: int = 32
    seed: int = 0
    eval_fraction: float = 0.05


@dataclass(frozen=True)
class TrainConfig:
    """``devices > 0``: simulate that many CPU devices; 0: use the devices JAX has.
    ``eval_every=0``: evaluate only at the end; ``eval_batches=0``: never. ``out_dir`` empty: ``runs/<name>``."""

    steps: int = 100
    log_every: int = 10
    eval_every: int = 0
    eval_batches: int = 4
    seed: int = 0
    devices: int = 0
    out_dir: str = ""
    progress: str = "auto"          # auto | bar | lines | none
    on_nonfinite: str = "skip"      # skip: drop the update of a step with a non-finite loss / grad norm; stop: error


@dataclass(frozen=True)
class CheckpointConfig:
    """Orbax checkpoints. ``dir`` empty: ``<train.out_dir>/checkpoints``. A checkpoint is written every
    ``every`` steps (0: only at the end), at the end, and on SIGTERM / SIGINT; the last ``keep`` are kept.
    ``resume`` (or ``jaxpar train --resume``) continues from the latest good checkpoint in ``dir``."""

    enabled: bool = True
    dir: str = ""
    every: int = 0
    keep: int = 3
    async_save: bool = True         # write in a background thread (``async`` is a Python keyword)
    resume: bool = False


@dataclass(frozen=True)
class LoggingConfig:
    """Metrics go to ``<train.out_dir>/metrics.jsonl`` and, with ``tensorboard``, to ``<train.out_dir>/tb``.
    ``peak_flops``: peak FLOP/s of one device (e.g. 989e12 for an H100's dense bf16); null: no MFU.
    ``samples``: greedy text samples of ``sample_tokens`` tokens written at the end (0: none)."""

    tensorboard: bool = True
    peak_flops: float | None = None
    samples: int = 3
    sample_tokens: int = 64


@dataclass(frozen=True)
class JobConfig:
    """The whole job. ``name`` defaults to the config file's stem."""

    name: str = ""
    model: ModelConfig = field(default_factory=ModelConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)


# ----------------------------------------------------------------------------- registries
@dataclass(frozen=True)
class ModelEntry:
    """``build(model_cfg, seed) -> model_fn`` and the model's ``loss(model, batch)``."""

    build: Callable[[ModelConfig, int], Callable[[], nnx.Module]]
    loss: Callable


def _gpt_config(cfg: ModelConfig) -> GPTConfig:
    return GPTConfig(vocab=cfg.vocab, seq_len=cfg.seq_len, embed=cfg.embed, heads=cfg.heads, layers=cfg.layers,
                     mlp=cfg.mlp, remat=cfg.remat, scan_layers=cfg.scan_layers, init_std=cfg.init_std)


def _build_gpt(cfg: ModelConfig, seed: int) -> Callable[[], nnx.Module]:
    gpt_cfg = _gpt_config(cfg)
    return lambda: GPT(gpt_cfg, rngs=nnx.Rngs(seed))


def _adamw(c: OptimizerConfig, lr):
    return optax.adamw(lr, b1=c.b1, b2=c.b2, eps=c.eps, weight_decay=c.weight_decay)


def _adam(c: OptimizerConfig, lr):
    return optax.adam(lr, b1=c.b1, b2=c.b2, eps=c.eps)


def _sgd(c: OptimizerConfig, lr):
    return optax.sgd(lr, momentum=c.momentum or None)


MODELS: dict[str, ModelEntry] = {"gpt": ModelEntry(_build_gpt, lm_loss)}
OPTIMIZERS: dict[str, Callable] = {"adamw": _adamw, "adam": _adam, "sgd": _sgd}
SCHEDULES = ("constant", "cosine", "linear")
DATA_KINDS = ("synthetic", "text", "tokens")
PROGRESS_MODES = ("auto", "bar", "lines", "none")
NONFINITE_MODES = ("skip", "stop")


# ----------------------------------------------------------------------------- loading
def _hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _type_name(tp) -> str:
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    if typing.get_origin(tp) is tuple:
        return f"a list of {_type_name(args[0])}"
    if len(args) == 1 and type(None) in typing.get_args(tp):
        return f"{_type_name(args[0])} or null"
    return getattr(tp, "__name__", str(tp))


def _lookup_type(key: str):
    cls = tp = JobConfig
    for part in key.split("."):
        hints = _hints(cls) if dataclasses.is_dataclass(cls) else {}
        if part not in hints:
            return None
        tp = cls = hints[part]
    return tp


def _check_keys(node: Any, cls, prefix: str, source: str) -> None:
    """Unknown keys and non-mapping sections, named by their dotted path."""
    hints = _hints(cls)
    where = f"under '{prefix}'" if prefix else "at the top level"
    if not isinstance(node, Mapping):
        raise ConfigError(f"{source}: '{prefix}' must be a mapping with keys {', '.join(hints)}; "
                          f"got {node!r}.")
    for key, value in node.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if key not in hints:
            raise ConfigError(f"{source}: unknown key '{path}'; allowed keys {where}: {', '.join(hints)}.")
        if dataclasses.is_dataclass(hints[key]):
            _check_keys(value, hints[key], path, source)


def parse_overrides(items: Sequence[str]) -> dict:
    """``["mesh.tensor=2", "optimizer.lr=3e-4"]`` -> nested dict (values parsed as YAML)."""
    for item in items:
        key = item.split("=", 1)[0].strip()
        if "=" not in item or not key:
            raise ConfigError(f"override {item!r}: expected key=value with a dotted key, e.g. mesh.tensor=2.")
        if key == "base":
            raise ConfigError(f"override {item!r}: 'base' is only allowed inside a YAML file.")
    try:
        return OmegaConf.to_container(OmegaConf.from_dotlist(list(items)), resolve=False)
    except OmegaConfBaseException as e:
        raise ConfigError(f"overrides: {str(e).splitlines()[0]}") from None


def merge_layers(layers: Sequence[tuple[str, Mapping]], name: str = "") -> JobConfig:
    """Merge ``(source, mapping)`` layers, later wins, onto the :class:`JobConfig` schema; then :func:`check`."""
    merged: DictConfig = OmegaConf.structured(JobConfig)
    OmegaConf.set_readonly(merged, False)
    for source, layer in layers:
        _check_keys(layer, JobConfig, "", source)
        try:
            merged = OmegaConf.merge(merged, layer)
        except OmegaConfBaseException as e:
            key = getattr(e, "full_key", None) or "?"
            tp = _lookup_type(key)
            expected = f"; expected {_type_name(tp)}" if tp is not None else ""
            reason = str(e).splitlines()[0].rstrip(".")
            raise ConfigError(f"{source}: invalid value for '{key}': {reason}{expected}.") from None
    try:
        cfg: JobConfig = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        raise ConfigError(f"config: '{getattr(e, 'full_key', '?')}': {str(e).splitlines()[0]}") from None
    if not cfg.name and name:
        cfg = dataclasses.replace(cfg, name=name)
    if not cfg.train.out_dir:
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, out_dir=f"runs/{cfg.name or 'job'}"))
    if not cfg.checkpoint.dir:
        cfg = dataclasses.replace(cfg, checkpoint=dataclasses.replace(
            cfg.checkpoint, dir=str(Path(cfg.train.out_dir) / "checkpoints")))
    check(cfg)
    return cfg


def _yaml_chain(path: Path, seen: tuple[Path, ...] = ()) -> list[tuple[str, dict]]:
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} not found.")
    if path.resolve() in seen:
        chain = " -> ".join(str(p) for p in seen + (path.resolve(),))
        raise ConfigError(f"{path}: 'base' inheritance cycle: {chain}.")
    try:
        raw = OmegaConf.load(path)
    except Exception as e:  # yaml.YAMLError and OmegaConf errors
        raise ConfigError(f"{path}: cannot parse YAML: {e}") from None
    data = OmegaConf.to_container(raw, resolve=False) if raw is not None else {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping (model:, mesh:, ...).")
    base = data.pop("base", None)
    chain: list[tuple[str, dict]] = []
    if base is not None:
        if not isinstance(base, str) or not base:
            raise ConfigError(f"{path}: 'base' must be a path to another YAML file (relative to this one).")
        chain = _yaml_chain(path.parent / base, seen + (path.resolve(),))
    return chain + [(str(path), data)]


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> JobConfig:
    """Load ``path`` (following ``base:``), apply dotted ``overrides``, check, and return a :class:`JobConfig`."""
    path = Path(path)
    layers = _yaml_chain(path)
    if overrides:
        layers.append(("overrides", parse_overrides(overrides)))
    return merge_layers(layers, name=path.stem)


def to_yaml(cfg: JobConfig) -> str:
    """The resolved config as YAML (loadable again with :func:`load_config`)."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


# ----------------------------------------------------------------------------- semantic checks
def _choice(problems: list[str], key: str, value: Any, allowed: Sequence[Any]) -> None:
    if value not in allowed:
        problems.append(f"{key}={value!r}: unknown value; allowed: {', '.join(map(str, allowed))}.")


def _at_least(problems: list[str], key: str, value: Any, low: float) -> None:
    if value is not None and value < low:
        problems.append(f"{key}={value!r}: must be >= {low}.")


def _mesh_problems(cfg: JobConfig, num_devices: int | None) -> list[str]:
    m, problems = cfg.mesh, []
    sizes = {"data": m.data, "fsdp": m.fsdp, "tensor": m.tensor, "pipe": m.pipe}
    for axis, size in sizes.items():
        if size < 1 and size != -1:
            problems.append(f"mesh.{axis}={size}: must be a positive int or -1 (the rest of the devices).")
    fill = [a for a, s in sizes.items() if s == -1]
    if len(fill) > 1:
        problems.append(f"mesh: only one axis may be -1, got {', '.join('mesh.' + a for a in fill)}.")
    if problems:
        return problems
    if num_devices is not None:
        try:
            sizes = MeshSpec(**sizes).sizes(num_devices)
        except MeshError as e:
            return [f"mesh (mesh.data x mesh.fsdp x mesh.tensor x mesh.pipe = {_fmt(sizes)}): {e} "
                    f"(train.devices={cfg.train.devices})"]
    elif fill:
        return []  # the rest needs the device count
    problems += _pipeline_problems(cfg, sizes["pipe"])
    t, model, dp = sizes["tensor"], cfg.model, sizes["data"] * sizes["fsdp"]
    dims = [("model.heads", model.heads), ("model.mlp (default 4 x model.embed)", model.mlp or 4 * model.embed),
            ("model.vocab", model.vocab)]
    if cfg.parallel.sequence_parallel:
        dims.append(("model.seq_len (sequence parallel)", model.seq_len))
    for key, size in dims:
        if size % t:
            problems.append(f"{key}={size} is not divisible by mesh.tensor={t}.")
    k = cfg.parallel.microbatches
    if k >= 1 and cfg.data.batch_size % (dp * k):
        problems.append(f"data.batch_size={cfg.data.batch_size} is not divisible by mesh.data x mesh.fsdp x "
                        f"parallel.microbatches = {sizes['data']} x {sizes['fsdp']} x {k} = {dp * k}.")
    return problems


def _pipeline_problems(cfg: JobConfig, p: int) -> list[str]:
    par, layers = cfg.parallel, cfg.model.layers
    _choice(problems := [], "parallel.schedule", par.schedule, SCHEDULE_KINDS)
    if problems or p == 1:
        return problems
    v, m = par.virtual_stages, par.microbatches
    if par.sequence_parallel and cfg.mesh.tensor > 1:
        problems.append(f"parallel.sequence_parallel=true with mesh.pipe={p} is not supported (XLA's "
                        "sequence-parallel resharding would deadlock inside a pipeline stage); set it to false.")
    if v > 1 and par.schedule != "interleaved":
        problems.append(f"parallel.virtual_stages={v} needs parallel.schedule=interleaved (got {par.schedule}).")
    if par.schedule in ("1f1b", "zb-h1") and m < p:
        problems.append(f"parallel.microbatches={m} < mesh.pipe={p}: {par.schedule} needs at least one "
                        f"micro-batch per stage; use parallel.microbatches >= {p} or parallel.schedule=gpipe.")
    if par.schedule == "interleaved" and m % p:
        problems.append(f"parallel.microbatches={m} is not a multiple of mesh.pipe={p} (interleaved).")
    if par.stage_layers is None and layers % (p * v):
        problems.append(f"model.layers={layers} is not divisible by mesh.pipe x parallel.virtual_stages = "
                        f"{p * v}; change the layer count or give parallel.stage_layers (one count per "
                        "virtual stage).")
    if par.stage_layers is not None and (len(par.stage_layers) != p * v or sum(par.stage_layers) != layers
                                         or min(par.stage_layers) < 1):
        problems.append(f"parallel.stage_layers={list(par.stage_layers)} needs {p * v} positive counts "
                        f"(mesh.pipe x parallel.virtual_stages) summing to model.layers={layers}.")
    return problems


def _fmt(sizes: Mapping[str, int]) -> str:
    return " x ".join(str(v) for v in sizes.values())


def check(cfg: JobConfig, num_devices: int | None = None) -> None:
    """Raise :class:`ConfigError` listing every impossible setting (with ``num_devices``: also the mesh)."""
    p: list[str] = []
    m, par, opt, d, tr = cfg.model, cfg.parallel, cfg.optimizer, cfg.data, cfg.train
    _choice(p, "model.name", m.name, tuple(MODELS))
    for key in ("vocab", "seq_len", "embed", "heads", "layers"):
        _at_least(p, f"model.{key}", getattr(m, key), 1)
    _at_least(p, "model.mlp", m.mlp, 1)
    if m.heads >= 1 and m.embed % m.heads:
        p.append(f"model.embed={m.embed} is not divisible by model.heads={m.heads}.")
    _choice(p, "model.remat", m.remat, REMAT_POLICIES)
    _choice(p, "parallel.zero", par.zero, ZERO_STAGES)
    _at_least(p, "parallel.microbatches", par.microbatches, 1)
    _choice(p, "parallel.compute_dtype", par.compute_dtype, tuple(COMPUTE_DTYPES))
    _choice(p, "optimizer.name", opt.name, tuple(OPTIMIZERS))
    _choice(p, "optimizer.schedule", opt.schedule, SCHEDULES)
    if opt.lr <= 0:
        p.append(f"optimizer.lr={opt.lr!r}: must be > 0.")
    for key in ("b1", "b2"):
        if not 0 <= getattr(opt, key) < 1:
            p.append(f"optimizer.{key}={getattr(opt, key)!r}: must be in [0, 1).")
    for key in ("weight_decay", "momentum", "warmup_steps", "eps"):
        _at_least(p, f"optimizer.{key}", getattr(opt, key), 0)
    if not 0 <= opt.min_lr_ratio <= 1:
        p.append(f"optimizer.min_lr_ratio={opt.min_lr_ratio!r}: must be in [0, 1].")
    if opt.clip_norm is not None and opt.clip_norm <= 0:
        p.append(f"optimizer.clip_norm={opt.clip_norm!r}: must be > 0, or null for no clipping.")
    _choice(p, "data.kind", d.kind, DATA_KINDS)
    _choice(p, "data.token_dtype", d.token_dtype, data_lib.TOKEN_DTYPES)
    _at_least(p, "data.batch_size", d.batch_size, 1)
    _at_least(p, "data.max_bytes", d.max_bytes, 1)
    if not 0 <= d.eval_fraction < 1:
        p.append(f"data.eval_fraction={d.eval_fraction!r}: must be in [0, 1).")
    if d.kind == "text" and m.vocab < 256:
        p.append(f"model.vocab={m.vocab}: byte-level text (data.kind=text) needs model.vocab >= 256.")
    if d.kind == "text" and tr.eval_batches > 0 and d.eval_fraction <= 0:
        p.append("data.eval_fraction=0 leaves no held-out text; set it > 0 or train.eval_batches=0.")
    for key, low in (("steps", 1), ("log_every", 1), ("eval_every", 0), ("eval_batches", 0), ("devices", 0)):
        _at_least(p, f"train.{key}", getattr(tr, key), low)
    _choice(p, "train.progress", tr.progress, PROGRESS_MODES)
    _choice(p, "train.on_nonfinite", tr.on_nonfinite, NONFINITE_MODES)
    ck, lg = cfg.checkpoint, cfg.logging
    _at_least(p, "checkpoint.every", ck.every, 0)
    _at_least(p, "checkpoint.keep", ck.keep, 1)
    if ck.resume and not ck.enabled:
        p.append("checkpoint.resume=true needs checkpoint.enabled=true (resuming also keeps saving).")
    if lg.peak_flops is not None and lg.peak_flops <= 0:
        p.append(f"logging.peak_flops={lg.peak_flops!r}: must be > 0 (FLOP/s of one device), or null for no MFU.")
    _at_least(p, "logging.samples", lg.samples, 0)
    _at_least(p, "logging.sample_tokens", lg.sample_tokens, 1)
    if not p:
        p.extend(_mesh_problems(cfg, num_devices))
    if p:
        raise ConfigError("invalid config:\n  " + "\n  ".join(p))


# ----------------------------------------------------------------------------- builders
def build_mesh(cfg: MeshConfig, devices: Sequence[Any] | None = None):
    """``jax.sharding.Mesh`` from the mesh section (``devices``: default all)."""
    try:
        return make_mesh(MeshSpec(data=cfg.data, fsdp=cfg.fsdp, tensor=cfg.tensor, pipe=cfg.pipe), devices)
    except MeshError as e:
        raise ConfigError(f"mesh: {e}") from None


def build_strategy(cfg: ParallelConfig) -> Strategy:
    return Strategy(zero=cfg.zero, sequence_parallel=cfg.sequence_parallel, microbatches=cfg.microbatches,
                    compute_dtype=cfg.compute_dtype, schedule=cfg.schedule, virtual_stages=cfg.virtual_stages,
                    stage_layers=cfg.stage_layers)


def build_schedule(cfg: OptimizerConfig, total_steps: int) -> Callable:
    """Linear warm-up from 0 over ``warmup_steps``, then constant / cosine / linear decay to ``min_lr_ratio * lr``."""
    warm = min(cfg.warmup_steps, total_steps)
    rest = max(1, total_steps - warm)
    end = cfg.lr * cfg.min_lr_ratio
    after = {"constant": lambda: optax.constant_schedule(cfg.lr),
             "cosine": lambda: optax.cosine_decay_schedule(cfg.lr, rest, alpha=cfg.min_lr_ratio),
             "linear": lambda: optax.linear_schedule(cfg.lr, end, rest)}[cfg.schedule]()
    if warm == 0:
        return after
    return optax.join_schedules([optax.linear_schedule(0.0, cfg.lr, warm), after], [warm])


def build_optimizer(cfg: OptimizerConfig, total_steps: int) -> tuple[optax.GradientTransformation, Callable]:
    """``(tx, schedule)``. Clipping is done by the train step (``clip_norm``), not by ``tx``."""
    if cfg.name not in OPTIMIZERS:
        raise ConfigError(f"optimizer.name={cfg.name!r}: unknown optimizer; allowed: {', '.join(OPTIMIZERS)}.")
    schedule = build_schedule(cfg, total_steps)
    tx = OPTIMIZERS[cfg.name](cfg, schedule)
    if cfg.name != "adamw" and cfg.weight_decay:
        tx = optax.chain(optax.add_decayed_weights(cfg.weight_decay), tx)
    return tx, schedule


def build_model_fn(cfg: ModelConfig, seed: int = 0) -> Callable[[], nnx.Module]:
    """A zero-argument model factory for :func:`jaxpar.init_train_state`."""
    if cfg.name not in MODELS:
        raise ConfigError(f"model.name={cfg.name!r}: unknown model; allowed: {', '.join(MODELS)}.")
    return MODELS[cfg.name].build(cfg, seed)


def build_loss_fn(cfg: ModelConfig) -> Callable:
    if cfg.name not in MODELS:
        raise ConfigError(f"model.name={cfg.name!r}: unknown model; allowed: {', '.join(MODELS)}.")
    return MODELS[cfg.name].loss


def build_data(cfg: DataConfig, *, seq_len: int, vocab: int, eval_batches: int
               ) -> tuple[Callable[[int], dict], list[dict]]:
    """``(batch_fn(step) -> host batch, fixed eval batches)`` for the data section."""
    kw = dict(batch_size=cfg.batch_size, seq_len=seq_len)
    if cfg.kind == "synthetic":
        evals = [data_lib.synthetic_batch(i, vocab=vocab, seed=cfg.seed, eval=True, **kw)
                 for i in range(eval_batches)]
        return partial(data_lib.synthetic_batch, vocab=vocab, seed=cfg.seed, **kw), evals
    if cfg.kind not in ("text", "tokens"):
        raise ConfigError(f"data.kind={cfg.kind!r}: unknown; allowed: {', '.join(DATA_KINDS)}.")
    if cfg.kind == "tokens" and len(cfg.paths) != 1:
        raise ConfigError(f"data.kind=tokens needs exactly one token file in data.paths (a .bin or .npy), "
                          f"got data.paths={list(cfg.paths)}.")
    try:
        if cfg.kind == "tokens":
            corpus = data_lib.load_tokens(cfg.paths[0], dtype=cfg.token_dtype)
        else:
            corpus = data_lib.load_bytes(list(cfg.paths) or None, max_bytes=cfg.max_bytes)
        train, held = data_lib.split_holdout(corpus, cfg.eval_fraction)
        evals = (data_lib.eval_windows(held, num_batches=eval_batches, **kw) if eval_batches else [])
        data_lib.text_batch(train, 0, seed=cfg.seed, **kw)  # fail now, not mid-run
    except (ValueError, OSError) as e:
        raise ConfigError(f"data (data.kind={cfg.kind}, data.paths={list(cfg.paths)}, data.max_bytes="
                          f"{cfg.max_bytes}, data.eval_fraction={cfg.eval_fraction}): {e}") from None
    if cfg.kind == "text":
        return partial(data_lib.text_batch, train, seed=cfg.seed, **kw), evals
    batch_fn = data_lib.token_batch_fn(train, vocab, f"token file {cfg.paths[0]!r}", seed=cfg.seed, **kw)
    try:   # fail now, not mid-run
        batch_fn(0)
        for i, b in enumerate(evals):
            data_lib.check_token_ids(b, vocab, f"token file {cfg.paths[0]!r}, eval batch {i},")
    except ValueError as e:
        raise ConfigError(f"data.paths: {e}") from None
    return batch_fn, evals
