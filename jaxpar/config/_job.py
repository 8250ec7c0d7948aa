"""The job builder: one config -> what ``jaxpar train``, ``jaxpar inspect`` and ``jaxpar plan`` run.

:func:`build_job` builds the mesh, the strategy, the model and its loss, the optimizer and its
learning-rate schedule, the train step's options and the data once, into a :class:`Job`; the
commands take what they need from it, so ``inspect`` compiles exactly the step that ``train``
runs (:meth:`Job.train_step`, :meth:`Job.abstract_batch`, :meth:`Job.compile`). A :class:`Job`
holds library objects and plain values; the config object is read only here (and by the commands,
:mod:`jaxpar.commands`, which print the lines about a job: :mod:`jaxpar.commands._lines`).

Example::

    >>> from pathlib import Path
    >>> from jaxpar.config import load_config
    >>> quickstart = Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml"
    >>> cfg = load_config(quickstart, ["model.layers=1", "model.embed=32", "model.seq_len=16"])
    >>> job = build_job(cfg, data=False)          # no data read: the batches are the GPT's token windows
    >>> job.strategy.name(dict(job.mesh.shape)), job.updates_per_step
    ('dp2-fsdp2-tp2', 1)
    >>> sorted(job.step_options)
    ['clip_norm', 'skip_nonfinite', 'steps_per_call']
    >>> layout = job.state_layout()               # traced only: nothing is allocated
    >>> compiled = job.compile(layout)            # the programs train runs, compiled ahead of time
    >>> sorted(compiled), compiled["step"].in_avals[0][1]["tokens"]
    (['step'], ShapedArray(int32[32,16]))
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar.batch import batch_sharding
from jaxpar.config._build import build_loss_fn, build_mesh, build_model_fn, gpt_model_fn, strategy_message
from jaxpar.config._checks import Built, check
from jaxpar.config._context_checks import context_problems
from jaxpar.config._cost_model import decoder_config_of
from jaxpar.config._data_section import build_data
from jaxpar.config._hf_model import build_tokenizer, hf_length_problems, hf_mesh_problems, open_hf
from jaxpar.config._optimizer_section import build_optimizer, frozen_variance_step
from jaxpar.config._schema import ConfigError, JobConfig
from jaxpar.data._packing import BATCH_KEYS
from jaxpar.errors import Fp8Error
from jaxpar.run._checkpoint import Checkpointer
from jaxpar.run._loop import make_eval_fn
from jaxpar.run._metrics import flops_per_token
from jaxpar.run._resume import RunOptions
from jaxpar.run._sample import SampleOptions
from jaxpar.run._summary import LogOptions
from jaxpar.step import noise_scale, router_bias
from jaxpar.step._init import init_train_state, param_layout, state_layout
from jaxpar.strategy import Strategy


@dataclass(frozen=True)
class Job:
    """What a config builds: library objects and plain values (see the module docstring).

    ``mesh`` and ``tx`` are ``None`` for a job built without devices (``build_job(..., mesh=False)``:
    ``jaxpar plan`` needs the model only); ``run.lr_schedule`` is ``tx``'s learning-rate schedule.
    ``step_options``: :func:`jaxpar.make_train_step`'s keyword options. ``updates_per_step``: optimizer
    updates per train step (:func:`updates_per_step`). ``token_batches``: the batches are the GPT's
    token windows (``tokens`` / ``targets`` ``[global_batch, seq_len]`` int32), else ``batch_fn``'s.
    ``run``, ``log``, ``checkpoint``, ``meta`` and ``gpt_sizes`` describe ``jaxpar train``'s run
    (:mod:`jaxpar.run._resume`). ``hf``: ``model.hf``'s opened :class:`jaxpar.hf.Checkpoint`, whose
    weights the state starts from (None: another model); ``tokenizer``: ``data.tokenizer``'s.
    """

    name: str
    strategy: Strategy
    model_fn: Callable[[], Any]
    loss_fn: Callable
    global_batch: int
    seq_len: int
    token_batches: bool = True
    packed_batches: bool = False              # data.kind=documents: segment ids, positions, loss mask and weights
    mesh: Any = None
    tx: Any = None
    params: Any = None                        # jaxpar.param_layout: the model traced once on the mesh
    updates_per_step: int = 1
    step_options: Mapping[str, Any] = field(default_factory=dict)
    batch_fn: Callable[[int], Any] | None = None
    eval_batches: Sequence[Any] = ()
    ramp: Any = None
    run: Any = None                          # jaxpar.run._resume.RunOptions
    log: Mapping[str, Any] = field(default_factory=dict)          # LogOptions fields
    checkpoint: Mapping[str, Any] | None = None                    # Checkpointer arguments (None: no checkpoints)
    meta: Mapping[str, Any] = field(default_factory=dict)         # checkpoint_meta's arguments, less the mesh
    gpt_sizes: Mapping[str, int] | None = None                     # the GPT's sizes for MFU (None: another model)
    parts: Sequence[Any] = ()                 # the state's feature parts (init_train_state(parts=...))
    hf: Any = None                            # jaxpar.hf.Checkpoint of model.hf
    tokenizer: Any = None                     # jaxpar.hf.Tokenizer of data.tokenizer

    @property
    def steps_per_call(self) -> int:
        """Optimizer steps per call of the train step (``parallel.steps_per_call``)."""
        return self.step_options.get("steps_per_call", 1)

    def state_layout(self):
        """The train state's layout (:func:`jaxpar.state_layout` with the job's parts), without creating the state."""
        return state_layout(self.model_fn, self.tx, self.mesh, self.strategy, parts=self.parts,
                            param_layout=self.params)

    def init_state(self, *, weights: bool = True):
        """The train state created sharded (:func:`jaxpar.init_train_state`) with the job's parts (the MoE
        router bias of ``model.moe.bias_rate``, the noise scale of ``logging.noise_scale``: they are
        checkpointed). With ``model.hf`` the parameters are the checkpoint's, read straight into their
        layout (:meth:`jaxpar.hf.Checkpoint.load`), and the optimizer state is fresh; a ``model.hf``
        directory with ``config.json`` only starts from random weights.

        Args:
          weights: False leaves the parameters random also with ``model.hf`` (a resumed run restores its own).

        Returns:
          ``(state, layout)``.
        """
        load = self.hf is not None and self.hf.has_weights and weights      # config.json only: random weights
        params = self.hf.load(self.mesh, self.state_layout().params) if load else None
        return init_train_state(self.model_fn, self.tx, self.mesh, self.strategy, params=params, parts=self.parts,
                                param_layout=self.params)

    def train_step(self, layout):
        """The train step ``jaxpar train`` runs.

        Args:
          layout: the train state's layout (:meth:`state_layout`, or the one :meth:`init_state` returns).

        Returns:
          :func:`jaxpar.make_train_step`'s step with the job's loss, optimizer, strategy and options.

        Raises:
          Fp8Error: ``parallel.fp8`` on devices without FP8 GEMMs, or covering no matmul of the model, named
            by its YAML keys (:func:`~jaxpar.config._build.strategy_message`).
        """
        from jaxpar.step._compose import make_train_step

        try:
            return make_train_step(self.loss_fn, self.tx, layout, self.strategy, **self.step_options)
        except Fp8Error as e:          # the library's check of Strategy.fp8 on the model and the devices
            raise Fp8Error(strategy_message(e)) from None

    def eval_fn(self, layout):
        """The eval function of the job's eval batches.

        Args:
          layout: the train state's layout (:meth:`state_layout`, or the one :meth:`init_state` returns).

        Returns:
          ``evaluate(state) -> mean loss`` over the eval batches; None without them.
        """
        if not self.eval_batches:
            return None
        return make_eval_fn(self.loss_fn, layout, self.strategy, self.eval_batches)

    def abstract_batch(self):
        """``ShapeDtypeStruct``s of what one call of the train step takes: a global batch split over
        the data axes, or with ``steps_per_call`` K the K batches stacked ``[K, B, ...]``."""
        sharding, lead = batch_sharding(self.mesh), ()
        if self.steps_per_call > 1:
            sharding, lead = NamedSharding(self.mesh, PartitionSpec(None, *sharding.spec)), (self.steps_per_call,)
        if self.token_batches:
            shape = (*lead, self.global_batch, self.seq_len)
            spec = jax.ShapeDtypeStruct(shape, np.int32, sharding=sharding)
            if not self.packed_batches:
                return {"tokens": spec, "targets": spec}
            weights = jax.ShapeDtypeStruct(shape, np.float32, sharding=sharding)
            return {**{key: spec for key in BATCH_KEYS}, "loss_weights": weights}
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct((*lead, *np.shape(a)), np.asarray(a).dtype,
                                                           sharding=sharding), self.batch_fn(0))

    def compile(self, layout, step: Any = None) -> dict[str, Any]:
        """The programs of :meth:`train_step`, compiled ahead of time from abstract state (nothing runs).

        Args:
          layout: the train state's layout (:meth:`state_layout`, or the one :meth:`init_state` returns).
          step: a step of :meth:`train_step` that already ran (its programs are JAX's cached ones: no new
            compile); None: a new one.

        Returns:
          ``{name: compiled}`` for every program the step runs: ``"step"`` (with ``steps_per_call`` K:
          the program of K steps on K stacked batches), ``"measure"`` (the step that also measures the
          noise scale), and relaxed sync's ``"warm"`` and ``"outer"`` (the replicas' sync; it takes
          the state only).
        """
        step = self.train_step(layout) if step is None else step
        lowered = step.lower_all(layout.abstract_state(), self.abstract_batch())
        return {name: program.compile() for name, program in lowered.items()}

    def log_options(self, layout, tokens_per_batch: int | None):
        """The loop's logging options.

        Args:
          layout: the train state's layout (:meth:`state_layout`, or the one :meth:`init_state` returns).
          tokens_per_batch: tokens per global batch, for tokens/s and MFU (None: not fixed).

        Returns:
          A :class:`~jaxpar.run.LogOptions`: the job's settings, its title, and the FLOPs per
          token of jaxpar's GPT for MFU (None for a model of your own).
        """
        flops = None      # FLOPs per token: known for the GPT (its tables: token and position); none for your own model
        if (g := self.gpt_sizes) is not None:
            flops = flops_per_token(sum(a.size for a in jax.tree.leaves(layout.shapes)), layers=g["layers"],
                                    seq_len=g["seq_len"], embed=g["embed"], tables=(g["vocab"] + g["seq_len"]) * g["embed"])
        return LogOptions(**self.log, title=f"{self.name}: {self.strategy.name(dict(self.mesh.shape))}",
                          tokens_per_batch=tokens_per_batch, flops_per_token=flops)

    def checkpointer(self, layout=None):
        """The run's checkpointer.

        Args:
          layout: the train state's layout (its saves then record the layout of the state's feature
            parts), or None.

        Returns:
          A :class:`~jaxpar.run.Checkpointer`, or None when checkpoints are off.
        """
        if self.checkpoint is None:
            return None
        return Checkpointer(**self.checkpoint, layout=layout)


def updates_per_step(strategy: Strategy, mesh_sizes: Mapping[str, int]) -> int:
    """Optimizer updates per train step.

    Args:
      strategy: the job's strategy.
      mesh_sizes: the resolved mesh's axis sizes (a ``-1`` in the config already replaced).

    Returns:
      ``microbatches / update_every`` for PipeDream weight stashing (``schedule='pipedream'`` on a
      pipeline: every stage updates that often per step), else 1.

    Example:
      >>> updates_per_step(Strategy(schedule="pipedream", microbatches=4, update_every=2), {"pipe": 2, "data": 4})
      2
      >>> updates_per_step(Strategy(schedule="pipedream", microbatches=4), {"data": 8})
      1
    """
    if strategy.schedule == "pipedream" and mesh_sizes.get("pipe", 1) > 1:
        return max(1, strategy.microbatches // strategy.update_every)
    return 1


def build_job(cfg: JobConfig, devices: Sequence[Any] | None = None, *, mesh: bool = True, data: bool = True,
              made: Built | None = None) -> Job:
    """The :class:`Job` of a loaded config.

    Args:
      cfg: the config (:func:`jaxpar.config.load_config`).
      devices: the mesh's devices (default: all of JAX's); the config is checked against JAX's device count.
      mesh: build the mesh, the optimizer and the step's options; ``False`` (``jaxpar plan``): the
        model, loss and strategy only, without devices.
      data: read the data (batch function, eval batches, batch ramp); ``False`` (``jaxpar inspect``):
        only a ``data.target`` of your own is built, for the batch shapes.
      made: what :func:`jaxpar.config.check` built of ``cfg``, already checked on these devices (None: checked here).

    Returns:
      The job.

    Raises:
      ConfigError: a setting that the library refuses, named by its YAML key; also a ``model.hf``
        checkpoint that cannot be imported or that ``mesh.tensor`` does not divide, and a
        ``data.tokenizer`` that cannot be read or does not fit the model's vocabulary.
    """
    if made is None:
        made = check(cfg, num_devices=(jax.device_count() if devices is None else len(devices)) if mesh else None)
    device_mesh = build_mesh(cfg.mesh, devices) if mesh else None
    strategy, m, d = made.strategy, cfg.model, cfg.data
    hf = hf_checkpoint(cfg, dict(device_mesh.shape) if mesh else None, strategy)
    model_fn = (hf.model_fn(cfg.train.seed) if hf is not None else gpt_model_fn(made.gpt, cfg.train.seed)
                if made.gpt is not None else build_model_fn(m, cfg.train.seed))
    vocab, vocab_key = (hf.config.vocab, "model.hf's vocab_size") if hf is not None else (m.vocab, "model.vocab")
    tokenizer = build_tokenizer(d, m.hf, vocab, vocab_key) if d.tokenizer else None
    base = dict(name=cfg.name, strategy=strategy, model_fn=model_fn, global_batch=d.batch_size, hf=hf,
                seq_len=m.seq_len, token_batches=d.kind != "import", packed_batches=d.kind == "documents",
                parts=_parts(cfg, made.gpt, mesh), tokenizer=tokenizer, loss_fn=build_loss_fn(m))
    if not mesh:
        return Job(**base)
    _target_decoder_problems(cfg, dict(device_mesh.shape), model_fn, strategy)
    per_step = updates_per_step(strategy, dict(device_mesh.shape))
    params = param_layout(model_fn, device_mesh, strategy)      # the model traced once
    tx, schedule = build_optimizer(cfg.optimizer, cfg.train.steps, global_batch=d.batch_size, params=params,
                                   updates_per_step=per_step, freeze_variance_step=frozen_variance_step(strategy))
    options = dict(clip_norm=cfg.optimizer.clip_norm, skip_nonfinite=True, steps_per_call=cfg.parallel.steps_per_call)
    return Job(mesh=device_mesh, tx=tx, updates_per_step=per_step, step_options=options, params=params, **base,
               **_data(cfg, data, vocab, tokenizer, made.ramp), **_run(cfg, tokenizer, schedule))


def hf_checkpoint(cfg: JobConfig, mesh_sizes: Mapping[str, int] | None, strategy: Any = None):
    """``model.hf``'s opened checkpoint (its ``config.json`` and safetensors headers).

    Args:
      cfg: the checked config.
      mesh_sizes: the mesh's axis sizes, to check the checkpoint's sizes against ``mesh.tensor`` and its heads
        against ``mesh.context`` (None: not checked).
      strategy: the config's :class:`~jaxpar.Strategy` (:class:`Built`), with ``mesh_sizes``.

    Returns:
      The :class:`jaxpar.hf.Checkpoint`, or None without ``model.hf``; a missing or unfit one raises ``ConfigError``.
    """
    if cfg.model.hf is None:
        return None
    where = Path(cfg.model.hf)
    if not where.is_dir():
        what = "is a file, not a directory" if where.exists() else "does not exist"
        raise ConfigError(f"model.hf={cfg.model.hf!r}: {where.absolute()} {what}; give the directory of a Hugging Face "
                          "checkpoint (config.json and *.safetensors files), e.g. one downloaded with "
                          "`huggingface-cli download MODEL --local-dir DIR`.")
    hf = open_hf(cfg.model)
    problems = hf_length_problems(hf, cfg.model.hf, cfg.model.seq_len)
    if mesh_sizes:
        problems += hf_mesh_problems(hf, cfg.model.hf, mesh_sizes.get("tensor", 1))
        problems += _model_heads_problems(cfg, strategy, mesh_sizes, hf.config, f"model.hf={cfg.model.hf!r}: its "
                                                                                "num_attention_heads")
    if problems:
        raise ConfigError("invalid config:\n  " + "\n  ".join(problems))
    return hf


def _model_heads_problems(cfg: JobConfig, strategy: Any, mesh_sizes: Mapping[str, int], decoder: Any,
                          key: str) -> list[str]:
    """Context parallelism's rule of the heads (:func:`~jaxpar.config._context_checks.context_problems`) for a
    model whose heads :func:`check` does not know: ``model.hf``'s (its ``config.json``) or a ``model.target``
    :class:`jaxpar.models.Decoder`'s (its ``DecoderConfig``).

    Args:
      cfg: the checked config.
      strategy: its :class:`~jaxpar.Strategy`.
      mesh_sizes: the mesh's axis sizes.
      decoder: the model's :class:`jaxpar.models.DecoderConfig` (None: not a Decoder, nothing checked).
      key: where the heads come from, for the message.

    Returns:
      The problems.
    """
    if decoder is None or mesh_sizes.get("context", 1) <= 1:
        return []
    return context_problems(cfg, strategy, mesh_sizes, seq_len=None,
                            heads=(decoder.heads, decoder.kv_heads, key))


def _target_decoder_problems(cfg: JobConfig, mesh_sizes: Mapping[str, int], model_fn: Callable, strategy: Any) -> None:
    """Raise :class:`ConfigError` for a ``model.target`` Decoder whose heads the ``context`` axis cannot split
    (its config traced with ``nnx.eval_shape``, only on a ``context`` axis)."""
    if cfg.model.target is None or mesh_sizes.get("context", 1) <= 1:
        return
    problems = _model_heads_problems(cfg, strategy, mesh_sizes, decoder_config_of(cfg.model, model_fn),
                                     f"model.target={cfg.model.target!r}: its DecoderConfig.heads")
    if problems:
        raise ConfigError("invalid config:\n  " + "\n  ".join(problems))


def _parts(cfg: JobConfig, gpt: Any, measured: bool) -> list:
    """The state's parts: the GPT's (``gpt``: its ``GPTConfig``) aux-loss-free balancing bias
    (``model.moe.bias_rate > 0``) and, in a job with devices (``measured``), the noise scale
    (``logging.noise_scale.every``)."""
    noise, parts = cfg.logging.noise_scale, []
    if gpt is not None and gpt.moe is not None and gpt.moe.bias_rate:
        parts.append(router_bias((gpt.layers // gpt.moe.every, gpt.moe.experts), rate=gpt.moe.bias_rate))
    if measured and noise.every is not None:
        parts.append(noise_scale(every=noise.every, ema=noise.ema))
    return parts


def _data(cfg: JobConfig, read: bool, vocab: int, tokenizer: Any, ramp: Any) -> dict:
    """The job's data: ``batch_fn``, ``eval_batches`` and ``ramp`` (without ``read``: ``data.target``'s
    batch function only, for its shapes). ``vocab``: the model's; ``tokenizer``: ``data.tokenizer``'s;
    ``ramp``: the checked ``data.batch_ramp`` (the job's own copy: an adaptive ramp decides during the run)."""
    d, m = cfg.data, cfg.model
    if not read:
        if d.kind != "import":
            return {}
        return {"batch_fn": build_data(d, seq_len=m.seq_len, vocab=vocab, eval_batches=0)[0]}
    ramp = copy.deepcopy(ramp)      # batch_fn reads it
    batch_fn, evals = build_data(d, seq_len=m.seq_len, vocab=vocab, eval_batches=cfg.train.eval_batches,
                                 ramp=ramp, tokenizer=tokenizer, steps=cfg.train.steps)
    return {"batch_fn": batch_fn, "eval_batches": evals, "ramp": ramp}


def _run(cfg: JobConfig, tokenizer: Any = None, schedule: Callable | None = None) -> dict:
    """The settings of ``jaxpar train``'s run: ``run`` (with the learning-rate ``schedule``), ``log``,
    ``checkpoint``, ``meta``, ``gpt_sizes`` (the samples decoded by ``tokenizer`` when there is one)."""
    m, tr, ck, lg = cfg.model, cfg.train, cfg.checkpoint, cfg.logging
    samples = SampleOptions(lg.samples, m.seq_len, lg.sample_tokens, cfg.data.kind == "text" and tokenizer is None,
                            tokenizer and tokenizer.decode) if m.target is None else None
    run = RunOptions(steps=tr.steps, out_dir=Path(tr.out_dir), eval_every=tr.eval_every, on_nonfinite=tr.on_nonfinite,
                     steps_per_call=cfg.parallel.steps_per_call, resume=ck.resume, data_seed=cfg.data.seed,
                     samples=samples, lr_schedule=schedule)
    log = dict(log_every=tr.log_every, out_dir=Path(tr.out_dir), progress=tr.progress, tensorboard=lg.tensorboard,
               peak_flops=lg.peak_flops)
    checkpoint = dict(directory=ck.dir, every=ck.every, keep=ck.keep, async_save=ck.async_save) if ck.enabled else None
    meta = {"name": cfg.name, "seed": tr.seed, "model": m.name,      # jaxpar.run._resume.checkpoint_meta's
            "data": {"kind": cfg.data.kind, "seed": cfg.data.seed, "batch_size": cfg.data.batch_size}}
    if tokenizer is not None:       # jaxpar sample checks its tokenizer against it (jaxpar.data.check_tokenizer)
        meta["tokenizer"] = {"fingerprint": tokenizer.fingerprint(), "vocab_size": tokenizer.vocab_size}
    gpt = m.target is None and m.hf is None
    sizes = dict(vocab=m.vocab, seq_len=m.seq_len, embed=m.embed, layers=m.layers) if gpt else None
    return dict(run=run, log=log, checkpoint=checkpoint, meta=meta, gpt_sizes=sizes)
