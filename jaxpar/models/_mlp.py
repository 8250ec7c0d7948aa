"""An MLP classifier built from ``nnx.Linear`` layers annotated with logical axes.

Residual blocks pair a column-parallel ``embed -> mlp`` layer with a
row-parallel ``mlp -> embed`` layer (Megatron): one reduction per block.

Example::

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> with nnx.use_eager_sharding(False):      # no mesh here (jaxpar places the state when training)
    ...     model = MLPClassifier(features=4, embed=8, mlp=8, classes=3, depth=2, rngs=nnx.Rngs(0))
    >>> model.up[0].kernel.out_sharding, model.down[0].kernel.out_sharding   # column / row parallel
    (('embed', 'mlp'), ('mlp', 'embed'))
    >>> logits = model(jnp.ones((5, 4)))
    >>> logits.shape, logits.dtype
    ((5, 3), dtype('float32'))
    >>> float(classifier_loss(model, {"x": jnp.ones((5, 4)), "y": jnp.zeros((5,), jnp.int32)})) > 0
    True
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.rules import constrain


def _linear(n_in, n_out, logical, rngs):
    return nnx.Linear(n_in, n_out, rngs=rngs,
                      kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), logical),
                      bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), logical[1:]))


class MLPClassifier(nnx.Module):
    """``features -> embed``, ``depth`` residual MLP blocks, ``embed -> classes``."""

    def __init__(self, features: int, embed: int, mlp: int, classes: int, depth: int = 2, *, rngs: nnx.Rngs):
        with nnx.use_eager_sharding(False):
            self.inp = _linear(features, embed, (None, "embed"), rngs)
            self.up = nnx.List([_linear(embed, mlp, ("embed", "mlp"), rngs) for _ in range(depth)])
            self.down = nnx.List([_linear(mlp, embed, ("mlp", "embed"), rngs) for _ in range(depth)])
            self.out = _linear(embed, classes, ("embed", "classes"), rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = constrain(self.inp(x), ("batch", "embed"))
        for up, down in zip(self.up, self.down):
            u = constrain(jax.nn.relu(up(h)), ("batch", "mlp"))
            h = constrain(h + down(u), ("batch", "embed"))
        return self.out(h).astype(jnp.float32)


def classifier_loss(model, batch: dict[str, jax.Array]) -> jax.Array:
    """Mean softmax cross-entropy; ``batch = {'x': f32[B, F], 'y': int[B]}``.

    Args:
      model: the classifier (``model(x)`` gives ``f32[B, classes]`` logits).
      batch: the inputs and labels.

    Returns:
      The scalar loss.
    """
    logp = jax.nn.log_softmax(model(batch["x"]), axis=-1)
    return -jnp.take_along_axis(logp, batch["y"][:, None], axis=-1).mean()
