"""A config for the cost model: its model as a :class:`jaxpar.cost.ModelSpec` (:func:`cost_model`; ``model.hf``'s
``config.json`` or a ``model.target`` that builds a jaxpar :class:`~jaxpar.models.Decoder` through its
:class:`jaxpar.models.DecoderConfig`, :func:`decoder_config_of`), Muon's settings, and the planner's view of the
job on a mesh (:func:`config_view`), or why the cost model predicts nothing (:func:`unpredicted`).

Example::

    >>> from jaxpar.config._schema import ModelConfig
    >>> decoder_config_of(ModelConfig()) is None          # jaxpar's GPT: cost.gpt describes it
    True
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Mapping

from jaxpar.compat._settings import FLUSH_SCHEDULES
from jaxpar.config._schema import ConfigError, JobConfig, ModelConfig
from jaxpar.strategy import Strategy


def decoder_config_of(m: ModelConfig, model_fn: Any = None):
    """The :class:`jaxpar.models.DecoderConfig` of ``model.hf`` (its ``config.json``: no weights read) or of a
    ``model.target`` that builds a :class:`jaxpar.models.Decoder` (``model_fn``, default the target's, traced
    with ``nnx.eval_shape``: nothing allocated), for the cost model (:func:`jaxpar.cost.from_decoder_config`).

    Args:
      m: the model section.
      model_fn: the model factory of ``model.target`` (None: built from ``m``).

    Returns:
      The config, or None for jaxpar's GPT and a model of your own.

    Raises:
      ConfigError: ``model.hf``'s ``config.json`` is missing or unsupported, named by ``model.hf``.
    """
    if m.hf is not None:
        from jaxpar.hf import HFConfigError, decoder_config, read_config

        try:
            return decoder_config(read_config(Path(m.hf)), remat=m.remat, scan_layers=m.scan_layers,
                                  loss_chunks=m.loss_chunks)
        except HFConfigError as e:
            raise ConfigError(f"model.hf={m.hf!r}: {e}") from None
    if m.target is None:
        return None
    from flax import nnx

    from jaxpar.config._build import build_model_fn
    from jaxpar.models import Decoder

    with nnx.use_eager_sharding(False):
        model = nnx.eval_shape(model_fn or build_model_fn(m))
    return model.cfg if isinstance(model, Decoder) else None


def cost_model(cfg: JobConfig, model_fn: Callable | None = None, *, batch: int | None = None,
               layers: int | None = None, hidden: int | None = None, heads: int | None = None,
               seq: int | None = None, vocab: int | None = None):
    """The :class:`jaxpar.cost.ModelSpec` of the config's model and global batch.

    Args:
      cfg: the config.
      model_fn: the model factory of a model of your own (``Job.model_fn``; None: built from the config);
        the GPT and ``model.hf`` need none.
      batch: the global batch (default ``data.batch_size``).
      layers, hidden, heads, seq, vocab: a model of your own: the sizes the cost model cannot read from
        its parameters (default 1); ``seq`` also a decoder's (default ``model.seq_len``).

    Returns:
      The model spec: :func:`jaxpar.cost.gpt` of the GPT's keys; :func:`jaxpar.cost.from_decoder_config` of
      ``model.hf``'s ``config.json`` (no weights read) or of a ``model.target`` that builds a
      :class:`jaxpar.models.Decoder`; else :func:`jaxpar.cost.from_nnx` of the model with the sizes given.
    """
    from jaxpar import cost
    m, batch = cfg.model, batch or cfg.data.batch_size
    if m.target is not None or m.hf is not None:
        if (decoder := decoder_config_of(m, model_fn)) is not None:
            return cost.from_decoder_config(decoder, seq=seq or m.seq_len, batch=batch, name=m.name)
        return cost.from_nnx(model_fn, layers=layers or 1, hidden=hidden or 1, heads=heads or 1, seq=seq or 1,
                             vocab=vocab or 1, batch=batch, name=m.name)
    moe = {}
    if m.moe:             # model.moe (the GPT's MoESettings): its experts, routing and layers
        from jaxpar.config._build import build_moe

        s = build_moe(m.moe)
        moe = dict(experts=s.experts, top_k=s.top_k, capacity_factor=s.capacity_factor, moe_every=s.every,
                   shared_mlp=s.shared_mlp)
    return cost.gpt(m.layers, m.embed, m.heads, m.seq_len, m.vocab, batch, mlp=m.mlp, name=cfg.name, **moe)


def unpredicted(cfg: JobConfig, strategy: Strategy, mesh_sizes: Mapping[str, int]) -> str | None:
    """Why the cost model predicts nothing for this job (None: it does): a model of your own (``model.target``
    that builds no :class:`jaxpar.models.Decoder`), or a pipeline schedule it does not know.

    Args:
      cfg: the config.
      strategy: its strategy (read for a pipeline of ``mesh_sizes`` only).
      mesh_sizes: the mesh's axis sizes.

    Returns:
      The reason, or None.
    """
    if cfg.model.target is not None and decoder_config_of(cfg.model) is None:
        return (f"the cost model describes jaxpar's GPT and Decoder (model.hf) only; model.target={cfg.model.target!r} "
                "is a model of your own")
    if mesh_sizes.get("pipe", 1) > 1 and strategy.schedule not in FLUSH_SCHEDULES:
        return (f"the cost model knows the pipeline schedules {', '.join(FLUSH_SCHEDULES)}, not "
                f"parallel.schedule={strategy.schedule!r}")
    return None


def muon_settings(cfg: JobConfig) -> dict | None:
    """``optimizer.muon``'s ``ns_steps`` and ``placement`` for the cost model (None: another optimizer)."""
    m = cfg.optimizer.muon
    return dict(ns_steps=m.ns_steps, placement=m.placement) if cfg.optimizer.name == "muon" else None


def config_view(cfg: JobConfig, mesh_sizes: Mapping[str, int], strategy: Strategy, cluster: str, *,
                platform: str = "cpu") -> tuple[Any, str | None]:
    """The cost model's view of the config's job on a mesh (:func:`jaxpar.plan.planner_view`), or why there is none.

    Args:
      cfg: the config.
      mesh_sizes: the mesh's axis sizes.
      strategy: its strategy.
      cluster: a cluster preset or YAML path.
      platform: the compiler's platform (``cpu``, ``cuda``, ``tpu``).

    Returns:
      ``(view, None)``, or ``(None, why)`` (:func:`unpredicted`).
    """
    from jaxpar.plan import planner_view

    if (why := unpredicted(cfg, strategy, mesh_sizes)) is not None:
        return None, why
    return planner_view(cost_model(cfg), mesh_sizes, strategy, cluster, remat=cfg.model.remat, muon=muon_settings(cfg),
                        platform=platform), None
