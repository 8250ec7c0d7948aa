"""Training from a Hugging Face checkpoint in one call: the layout, the weights read into it, the state.

>>> import jax, optax, tempfile
>>> from flax import nnx
>>> import jaxpar
>>> from jaxpar.hf import export, train_state
>>> from jaxpar.models import Decoder, DecoderConfig, decoder_loss
>>> cfg = DecoderConfig(vocab=16, embed=8, layers=2, heads=2, kv_heads=1, head_dim=4, mlp=12, qk_norm=True)
>>> with nnx.use_eager_sharding(False):
...     params = nnx.to_pure_dict(nnx.state(Decoder(cfg, rngs=nnx.Rngs(0)), nnx.Param))
>>> path = tempfile.mkdtemp() + "/ckpt"
>>> export(params, path, config=cfg, family="qwen3")
>>> mesh = jaxpar.make_mesh({"data": 2, "fsdp": 2}, devices=jax.devices()[:4])
>>> tx = optax.adamw(1e-3)
>>> state, layout, ckpt = train_state(path, tx, mesh, jaxpar.Strategy(zero=3))
>>> step = jaxpar.make_train_step(decoder_loss, tx, layout)
>>> batch = jaxpar.shard_batch({"tokens": jax.numpy.zeros((4, 8), "int32"), "targets": jax.numpy.ones((4, 8), "int32")},
...                            mesh)
>>> state, metrics = step(state, batch)
>>> int(state.step), ckpt.family
(1, 'qwen3')
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jaxpar.strategy import Strategy
from jaxpar.step._init import init_train_state, state_layout
from jaxpar.hf._reader import Checkpoint, open_checkpoint


def load(checkpoint: str | Path | Checkpoint, layout: Any) -> Any:
    """The checkpoint's parameters in ``layout``'s shardings (a :class:`~jaxpar.StateLayout`).

    Args:
      checkpoint: a checkpoint directory, or an opened :class:`Checkpoint`.
      layout: the state's layout (:func:`jaxpar.state_layout`).

    Returns:
      The parameter dict, each array in ``NamedSharding(layout.mesh, spec)``.
    """
    ckpt = checkpoint if isinstance(checkpoint, Checkpoint) else open_checkpoint(checkpoint)
    return ckpt.load(layout.mesh, layout.params)


def train_state(path: str | Path, tx: Any, mesh: Any, strategy: Strategy = Strategy(), *, seed: int = 0,
                **overrides: Any) -> tuple[Any, Any, Checkpoint]:
    """The train state of the checkpoint's model under ``strategy`` on ``mesh``, starting from its weights.

    Args:
      path: the checkpoint directory.
      tx: the optax optimizer (its state starts fresh).
      mesh: the device mesh.
      strategy: what to do with the mesh axes.
      seed: the seed of the model's random initialisation (only traced: every weight comes from the files).
      **overrides: :class:`~jaxpar.models.DecoderConfig` fields (``remat``, ``scan_layers``).

    Returns:
      ``(state, layout, checkpoint)``: as :func:`jaxpar.init_train_state`, and the opened checkpoint
      (for :func:`jaxpar.hf.export` and the tokenizer).
    """
    ckpt = open_checkpoint(path, **overrides)
    layout = state_layout(ckpt.model_fn(seed), tx, mesh, strategy)
    state, layout = init_train_state(ckpt.model_fn(seed), tx, mesh, strategy, params=load(ckpt, layout))
    return state, layout, ckpt
