"""Job configuration: typed frozen dataclasses, YAML with ``base:`` inheritance, dotted overrides,
and the builders that turn a config into the library's own objects (``GPTConfig``, ``Strategy``,
``MeshSpec``, a pipeline schedule, a user's model, loss and data function by import path).

This package and :mod:`jaxpar.cli` are the only places that read a config; everything
below them takes a ``Mesh``, rules and plain values. The library checks its own objects;
:func:`check` builds them and relabels their errors with the YAML key (``GPTConfig.heads``
-> ``model.heads``, ``Strategy.virtual_stages`` -> ``parallel.virtual_stages``). Only checks
that span sections (batch size vs. mesh axes, model sizes vs. ``mesh.tensor``) live here.

Modules, in import order (each imports only those above it):

* :mod:`~jaxpar.config._schema`: the dataclasses of the sections, :class:`ConfigError`, allowed names.
* :mod:`~jaxpar.config._imports`: ``'pkg.mod:attr'`` / ``'file.py:attr'`` -> the object.
* :mod:`~jaxpar.config._hf_model`: ``model.hf`` and ``data.tokenizer``: their checks, the checkpoint and
  tokenizer opened with the errors under the YAML keys.
* :mod:`~jaxpar.config._build`: sections -> mesh, strategy, model factory, loss; the model
  registry; library errors relabelled with YAML keys.
* :mod:`~jaxpar.config._cost_model`: the config for the cost model: its model spec (through the
  :class:`~jaxpar.models.DecoderConfig` behind ``model.hf`` or a ``model.target`` that builds a ``Decoder``) and
  the planner's view of its job (:mod:`jaxpar.plan`).
* :mod:`~jaxpar.config._optimizer_section`: the optimizer section -> optimizer and learning-rate
  schedule; the optimizer registry.
* :mod:`~jaxpar.config._data_section`: the data section -> batch function and eval batches.
* :mod:`~jaxpar.config._checks`: :func:`check`, every impossible setting at once.
* :mod:`~jaxpar.config._load`: YAML, ``base:``, overrides, merging -> a checked :class:`JobConfig`.
* :mod:`~jaxpar.config._job`: a config -> the :class:`Job` that ``jaxpar train``, ``inspect`` and
  ``plan`` run (:func:`build_job`: mesh, strategy, model, loss, optimizer, the train step's options, data).

The commands that run a config, and the lines they print about it, are :mod:`jaxpar.commands`'s.

Example::

    >>> from pathlib import Path
    >>> quickstart = Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml"
    >>> load_config(quickstart, ["mesh.tensor=1", "mesh.data=4"]).mesh
    MeshConfig(data=4, fsdp=2, tensor=1, pipe=1, replica=1, context=1, expert=1)
    >>> load_config(quickstart, ["model.embedd=64"])
    Traceback (most recent call last):
    ...
    jaxpar.errors.ConfigError: overrides: unknown key 'model.embedd'; allowed keys under 'model': ...
"""

from __future__ import annotations

from jaxpar.config._build import (MODELS, ModelEntry, build_gpt_config, build_loss_fn, build_mesh, build_model_fn,
                                  build_strategy)
from jaxpar.config._checks import check
from jaxpar.config._data_section import build_data, build_ramp, describe_batch
from jaxpar.config._imports import resolve_import
from jaxpar.config._job import Job, build_job
from jaxpar.config._load import load_config, merge_layers, parse_overrides, to_yaml
from jaxpar.config._optimizer_section import OPTIMIZERS, build_lr_schedule, build_optimizer, frozen_variance_step
from jaxpar.config._schema import (DATA_KINDS, GPT_KEYS, LR_SCHEDULES, NONFINITE_MODES, USER_MODEL_KEYS, CheckpointConfig,
                                   ConfigError, DataConfig, JobConfig, LoggingConfig, MeshConfig, ModelConfig, OptimizerConfig,
                                   ParallelConfig, TrainConfig)

__all__ = [
    "ConfigError", "ModelConfig", "MeshConfig", "ParallelConfig", "OptimizerConfig", "DataConfig",
    "TrainConfig", "CheckpointConfig", "LoggingConfig", "JobConfig", "ModelEntry", "MODELS", "OPTIMIZERS",
    "LR_SCHEDULES", "DATA_KINDS", "NONFINITE_MODES", "GPT_KEYS", "USER_MODEL_KEYS",
    "load_config", "merge_layers", "parse_overrides", "to_yaml", "check", "resolve_import",
    "build_mesh", "build_strategy", "build_optimizer", "frozen_variance_step", "build_lr_schedule", "build_gpt_config",
    "build_model_fn", "build_loss_fn", "build_data", "build_ramp", "describe_batch", "Job", "build_job",
]
