"""The config schema: one frozen dataclass per YAML section, the keys of the built-in GPT and of a
model of your own, and the allowed names of the fields that take one of a few values.

The dataclasses hold plain values only; :mod:`jaxpar.config._checks` checks them and
:mod:`jaxpar.config._build` turns them into the library's objects. A key that an object of the library
takes has that object's default (:class:`jaxpar.models.GPTConfig`, :class:`jaxpar.Strategy`,
:func:`jaxpar.optimizers.muon`): no default is written twice.
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from dataclasses import dataclass, field
from typing import Any

from jaxpar.data import _windows as data_lib
from jaxpar.errors import ConfigError
from jaxpar.models import GPTConfig
from jaxpar.optimizers import MUON_ADAM_DEFAULTS, muon
from jaxpar.run._checkpoint import Checkpointer
from jaxpar.step import noise_scale
from jaxpar.strategy import Strategy, option_types


def _defaults(fn) -> dict[str, Any]:
    """``fn``'s keyword defaults."""
    return {k: p.default for k, p in inspect.signature(fn).parameters.items()}


#: The defaults of :func:`jaxpar.optimizers.muon`, :class:`jaxpar.run.Checkpointer` and
#: :func:`jaxpar.step.noise_scale`, by keyword.
MUON_DEFAULTS, CHECKPOINT_DEFAULTS, NOISE_DEFAULTS = map(_defaults, (muon, Checkpointer, noise_scale))


def _model_fields() -> list[tuple]:
    """The ``model`` section's fields: a model of your own's (``target``, ``kwargs``, ``loss``), each
    :class:`jaxpar.models.GPTConfig` field with its default (``moe`` as a mapping of
    :class:`jaxpar.models.MoESettings`'s options, ``{}``: dense MLPs), and ``hf``."""
    hints = typing.get_type_hints(GPTConfig)
    gpt = [(f.name, hints[f.name], field(default=f.default)) for f in dataclasses.fields(GPTConfig) if f.name != "moe"]
    return [("name", str, field(default="gpt")), ("target", str | None, field(default=None)),
            ("kwargs", dict[str, Any], field(default_factory=dict)), ("loss", str | None, field(default=None)),
            *gpt, ("moe", dict[str, Any], field(default_factory=dict)), ("hf", str | None, field(default=None)),
            ("loss_chunks", int, field(default=1))]


#: The ``model`` section, written by :func:`_model_fields` (the GPT's keys from :class:`jaxpar.models.GPTConfig`).
ModelConfig = dataclasses.make_dataclass("ModelConfig", _model_fields(), frozen=True)
ModelConfig.__module__ = __name__
ModelConfig.__doc__ = """Either the built-in GPT (``name: gpt`` and the :class:`jaxpar.models.GPTConfig` fields;
``moe``: ``{experts: 8, top_k: 2, ...}``, :class:`jaxpar.models.MoESettings`), a model of your own: ``target``
(``'pkg.mod:Class'`` or ``'path/to/file.py:Class'``), called as ``target(**kwargs, rngs=nnx.Rngs(train.seed))``
-> ``nnx.Module``, and ``loss`` (``loss(model, batch) -> scalar``), or a Hugging Face checkpoint: ``hf`` (its
directory; the model is its :class:`jaxpar.models.Decoder`, started from its weights, with ``remat``,
``scan_layers``, ``loss_chunks`` (:class:`jaxpar.models.DecoderConfig`'s) and ``seq_len``, the data's windows,
only). With ``target`` or ``hf``, ``name`` is only a label (default: the class's / the directory's name). Under
``mesh.pipe > 1`` the model is cut at its stacked blocks (:mod:`jaxpar.parallel.pipeline._cut`)."""

#: Keys of the built-in GPT (an error with ``model.target``) and of a user model (an error without it).
GPT_KEYS = tuple(f.name for f in dataclasses.fields(GPTConfig))
USER_MODEL_KEYS = ("target", "kwargs", "loss")
#: Keys that may stand beside ``model.hf`` (the rest of the model comes from the checkpoint).
HF_MODEL_KEYS = ("name", "hf", "seq_len", "remat", "scan_layers", "loss_chunks")


@dataclass(frozen=True)
class MeshConfig:
    """Mesh axis sizes; one may be -1 (the rest of the devices)."""

    data: int = 1
    fsdp: int = 1
    tensor: int = 1
    pipe: int = 1
    replica: int = 1                # K model replicas (outermost axis), kept in step by parallel.sync
    context: int = 1                # context parallelism: the sequence split over a 'context' axis (parallel.context)
    expert: int = 1                 # expert parallelism: model.moe's experts split over an 'expert' axis


#: :class:`jaxpar.Strategy`'s fields that the ``parallel`` section does not hold, and where they are set instead.
NOT_IN_YAML = {"extra_rules": "Python rules of a model of your own", "local_clip": "parallel.compression.local_clip"}
#: The YAML type of a field whose :class:`jaxpar.Strategy` type YAML cannot hold (``"auto"`` is the planner's).
_YAML_TYPES = {"stage_layers": tuple[int, ...] | None}


def _parallel_fields() -> list[tuple]:
    """The ``parallel`` section's fields: each :class:`jaxpar.Strategy` field with its default, an option
    object (an option class's, :func:`jaxpar.strategy.option_types`, or a kind's, typed ``Any``: ``compression``,
    ``sync``) as a mapping of its options (``{}``: None), and ``steps_per_call``, the step's."""
    hints = typing.get_type_hints(Strategy)
    out = []
    for f in dataclasses.fields(Strategy):
        if f.name in NOT_IN_YAML:
            continue
        if hints[f.name] is Any or f.name in option_types():
            out.append((f.name, dict[str, Any], field(default_factory=dict)))
        else:
            out.append((f.name, _YAML_TYPES.get(f.name, hints[f.name]), field(default=f.default)))
    return out + [("steps_per_call", int, field(default=1))]      # optimizer steps per compiled call


#: The ``parallel`` section, written by :func:`_parallel_fields` from :class:`jaxpar.Strategy`: a new field
#: of the strategy is a YAML key with its default, built by :func:`jaxpar.config.build_strategy`.
ParallelConfig = dataclasses.make_dataclass("ParallelConfig", _parallel_fields(), frozen=True)
ParallelConfig.__module__ = __name__
ParallelConfig.__doc__ = "See :class:`jaxpar.Strategy`: its fields (option objects as mappings) and ``steps_per_call``."


@dataclass(frozen=True)
class LRScalingConfig:
    """The peak ``optimizer.lr`` was tuned at ``base_batch``; with ``data.batch_size = B`` it becomes
    ``lr * B / base_batch`` (``linear``, Goyal et al.), ``lr * sqrt(B / base_batch)`` (``sqrt``) or
    stays (``none``). Warm-up and decay apply to the scaled peak (see :func:`jaxpar.optimizers.scaled_lr`)."""

    rule: str = "none"              # linear | sqrt | none
    base_batch: int = 256


@dataclass(frozen=True)
class TrustMaskConfig:
    """``lars`` / ``lamb``: which parameters get weight decay and a trust ratio. Default: those of
    rank >= 2 per layer (not biases, not norm scales); ``include`` / ``exclude``: regexes searched
    in the parameter path (``blocks/ln1_scale``) forcing them in / out (see :func:`jaxpar.optimizers.trust_mask`)."""

    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()


@dataclass(frozen=True)
class MuonConfig:
    """``muon``: Muon on the matrices (routed by logical names; ``routing``: ``{path regex: muon | adam}``
    overrides), AdamW on the rest with ``optimizer.b1`` / ``b2`` / ``eps``, ``adam_lr`` (null: ``optimizer.lr``)
    and ``adam_weight_decay``; ``placement``: where Newton-Schulz runs on sharded matrices (``auto``: the cost
    model's exact choice per matrix group; ``gather``, ``owner``, ``local``) (see :func:`jaxpar.optimizers.muon`)."""

    momentum: float = MUON_DEFAULTS["momentum"]
    nesterov: bool = MUON_DEFAULTS["nesterov"]
    ns_steps: int = MUON_DEFAULTS["ns_steps"]
    consistent_rms: float | None = MUON_DEFAULTS["consistent_rms"]
    adam_lr: float | None = MUON_ADAM_DEFAULTS["lr"]
    adam_weight_decay: float = MUON_ADAM_DEFAULTS["weight_decay"]
    routing: dict[str, str] = field(default_factory=dict)
    placement: str = MUON_DEFAULTS["placement"]


@dataclass(frozen=True)
class OptimizerConfig:
    """``adamw`` decays weights decoupled; ``adam`` / ``sgd`` add ``weight_decay * w`` to the gradient.
    ``lars`` (``momentum``, ``trust_coefficient``) and ``lamb`` (``b1``, ``b2``, ``eps``) decay and scale
    by the trust ratio only the parameters of ``trust_mask`` (:mod:`jaxpar.optimizers`)."""

    name: str = "adamw"
    lr: float = 1e-3
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    momentum: float = 0.9           # sgd only (0 = plain SGD)
    warmup_steps: int = 0
    lr_schedule: str = "cosine"     # after warm-up: constant | cosine | linear (to min_lr_ratio * lr)
    min_lr_ratio: float = 0.1
    clip_norm: float | None = 1.0   # None: no clipping
    lr_scaling: LRScalingConfig = field(default_factory=LRScalingConfig)
    trust_coefficient: float = 0.001   # lars only (lamb: 1)
    trust_mask: TrustMaskConfig = field(default_factory=TrustMaskConfig)
    muon: MuonConfig = field(default_factory=MuonConfig)


@dataclass(frozen=True)
class DataConfig:
    """``text``: bytes of ``paths`` (files / globs; empty = Python stdlib sources), or with ``tokenizer``
    (``hf``: the ``model.hf`` checkpoint's; or a directory / ``tokenizer.json`` file) their tokens, each
    file a document with BOS / EOS only where ``bos`` / ``eos`` say. ``tokens``: one
    pre-tokenized ``.bin`` (``token_dtype``) or ``.npy`` file in ``paths``. ``synthetic``: arithmetic
    token sequences. ``import``: your own ``target(step, *, batch_size, seed, **kwargs) -> dict of arrays``
    (``'pkg.mod:fn'`` or ``'path/to/file.py:fn'``). ``documents``: ``sources`` (JSONL, Parquet, ArrayRecord,
    Hugging Face ``save_to_disk`` directories, token files) mixed by weight, tokenized by ``tokenizer``
    (from ``cache``, or on the fly) and packed (:mod:`jaxpar.config._documents`). ``batch_size`` is global."""

    kind: str = "text"
    paths: tuple[str, ...] = ()
    max_bytes: int = data_lib.DEFAULT_MAX_BYTES
    token_dtype: str = "uint16"     # kind=tokens, .bin files
    tokenizer: str | None = None    # kind=text: hf (model.hf's tokenizer) | a directory or tokenizer.json; null: bytes
    bos: bool | str = "auto"        # with tokenizer: BOS before each document; auto: as its post-processor says
    eos: bool | str = "auto"        # with tokenizer: EOS after each document; auto: as its post-processor says
    target: str | None = None       # kind=import
    kwargs: dict[str, Any] = field(default_factory=dict)   # kind=import
    batch_size: int = 32
    seed: int = 0
    eval_fraction: float = 0.05
    # global batch sizes growing during training, e.g. {sizes: [32, 64, 128], steps: [0, 100, 200]}
    # (the first size is batch_size; see jaxpar.run._ramp); {} = batch_size throughout
    batch_ramp: dict[str, Any] = field(default_factory=dict)
    # kind=documents (jaxpar.config._documents, docs/data.md): sources mixed by weight, packed rows
    sources: list[dict[str, Any]] = field(default_factory=list)   # [{path, format, text_field, weight}, ...]
    cache: str | None = None        # the token cache's directory (jaxpar data prepare); null: tokenize on the fly
    pack: str = "best_fit"          # best_fit | first_fit | none
    pack_window: int = 64           # rows packed together
    pack_fill: float = 0.99         # the share of a pack window the documents fill
    on_malformed: str = "error"     # error | skip (a malformed record is skipped and counted)
    prefetch: int = 2               # steps built ahead in a background thread
    repeat: bool = False            # a source may be drawn for more than one epoch (each reshuffled)


@dataclass(frozen=True)
class TrainConfig:
    """``devices > 0``: simulate that many CPU devices; 0: use the devices JAX has.
    ``eval_every=0``: evaluate only at the end; ``eval_batches=0``: never. ``out_dir`` empty: ``runs/<name>``.
    ``profile: {steps: [A, B]}``: trace the steps ``A .. B-1`` with ``jax.profiler`` into ``<out_dir>/trace``
    (docs/profiling.md); ``{}``: none."""

    steps: int = 100
    log_every: int = 10
    eval_every: int = 0
    eval_batches: int = 4
    seed: int = 0
    devices: int = 0
    out_dir: str = ""
    progress: str = "auto"          # auto | bar | lines | none
    on_nonfinite: str = "skip"      # skip: drop the update of a step with a non-finite loss / grad norm; stop: error
    step_timeout: str = "10x"       # a hung step ends the run: seconds, Nx (N x the median step, >= 300 s), Nx:S, 0
    profile: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class CheckpointConfig:
    """Orbax checkpoints. ``dir`` empty: ``<train.out_dir>/checkpoints``. A checkpoint is written every
    ``every`` steps (0: only at the end), at the end, and on SIGTERM / SIGINT; the last ``keep`` are kept.
    ``resume`` (or ``jaxpar train --resume``) continues from the latest good checkpoint in ``dir``."""

    enabled: bool = True
    dir: str = ""
    every: int = CHECKPOINT_DEFAULTS["every"]
    keep: int = CHECKPOINT_DEFAULTS["keep"]
    async_save: bool = CHECKPOINT_DEFAULTS["async_save"]   # in a background thread (``async`` is a Python keyword)
    resume: bool = False


@dataclass(frozen=True)
class NoiseScaleConfig:
    """The gradient noise scale ``B_simple`` (McCandlish et al. 2018) measured every ``every`` steps from
    each data-parallel replica's gradient and the global one (null: never), with moving averages of
    decay ``ema`` (:mod:`jaxpar.step._noise_scale`); logged as ``noise_scale`` and ``noise_scale.png``."""

    every: int | None = None
    ema: float = NOISE_DEFAULTS["ema"]


@dataclass(frozen=True)
class LoggingConfig:
    """Metrics go to ``<train.out_dir>/metrics.jsonl`` and, with ``tensorboard``, to ``<train.out_dir>/tb``.
    ``peak_flops``: peak FLOP/s of one device (e.g. 989e12 for an H100's dense bf16); null: no MFU.
    ``samples``: greedy text samples of ``sample_tokens`` tokens written at the end (0: none; the GPT and
    ``model.hf`` only; decoded by ``data.tokenizer`` when there is one)."""

    tensorboard: bool = True
    peak_flops: float | None = None
    samples: int = 3
    sample_tokens: int = 64
    noise_scale: NoiseScaleConfig = field(default_factory=NoiseScaleConfig)


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


LR_SCHEDULES = ("constant", "cosine", "linear")
DATA_KINDS = ("synthetic", "text", "tokens", "documents", "import")
PROGRESS_MODES = ("auto", "bar", "lines", "none")
NONFINITE_MODES = ("skip", "stop")
#: Keys that were renamed: old dotted key -> new one.
RENAMED = {"optimizer.schedule": "optimizer.lr_schedule"}
#: Keys holding ``module:attr`` import paths (a ``.py`` module part is a file, relative to the config file).
IMPORT_KEYS = (("model", "target"), ("model", "loss"), ("data", "target"))
