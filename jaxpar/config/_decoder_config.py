"""The :class:`jaxpar.models.DecoderConfig` behind a config's model, for the cost model: ``model.hf``'s
``config.json`` (no weights read), or the config of a ``model.target`` that builds a jaxpar
:class:`~jaxpar.models.Decoder` (traced, nothing allocated). :func:`jaxpar.config._plan_command.cost_model`
describes either with :func:`jaxpar.cost.from_decoder_config`.

Example::

    >>> from jaxpar.config._schema import ModelConfig
    >>> decoder_config_of(ModelConfig()) is None          # jaxpar's GPT: cost.gpt describes it
    True
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jaxpar.config._schema import ConfigError, ModelConfig


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
            return decoder_config(read_config(Path(m.hf)), remat=m.remat, scan_layers=m.scan_layers)
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
