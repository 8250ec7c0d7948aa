"""A user's own Flax NNX classifier for Muon (tests/test_muon_user_model.py; a YAML file names it by path).

``SeqNet``: a 1-D conv stem whose kernel and bias carry no names, two unstacked residual MLP blocks of
``nnx.Linear`` layers whose kernels are annotated with ``nnx.with_partitioning`` and whose biases are not,
an unannotated ``nnx.LayerNorm`` and a head over ``classes``. ``loss(model, batch)`` is the mean softmax
cross-entropy of ``{'x': f32[B, L, C], 'y': i32[B]}``; ``batches`` makes such batches (a pure function of
``(seed, step, eval)``).
"""
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


def _linear(n_in, n_out, names, rngs):
    return nnx.Linear(n_in, n_out, kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), names),
                      rngs=rngs)


class Block(nnx.Module):
    def __init__(self, embed, mlp, rngs):
        self.up = _linear(embed, mlp, ("embed", "mlp"), rngs)
        self.down = _linear(mlp, embed, ("mlp", "embed"), rngs)

    def __call__(self, h):
        return h + self.down(jax.nn.gelu(self.up(h)))


class SeqNet(nnx.Module):
    def __init__(self, channels=4, embed=16, mlp=32, classes=4, *, rngs: nnx.Rngs):
        self.stem = nnx.Conv(channels, embed, kernel_size=(3,), rngs=rngs)
        self.block1 = Block(embed, mlp, rngs)
        self.block2 = Block(embed, mlp, rngs)
        self.norm = nnx.LayerNorm(embed, rngs=rngs)
        self.head = _linear(embed, classes, ("embed", "classes"), rngs)

    def __call__(self, x):
        h = self.block2(self.block1(self.stem(x)))
        return self.head(self.norm(h).mean(axis=1))


def loss(model, batch):
    logp = jax.nn.log_softmax(model(batch["x"]).astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(logp, batch["y"][:, None], axis=-1).mean()


def batches(step, *, batch_size, seed=0, eval=False, length=8, channels=4, classes=4):
    """Noisy copies of ``classes`` fixed random sequences, labelled by which."""
    prototypes = np.random.default_rng(seed).normal(size=(classes, length, channels))
    rng = np.random.default_rng([seed, step, int(eval)])
    y = rng.integers(0, classes, batch_size)
    x = prototypes[y] + rng.normal(scale=0.5, size=(batch_size, length, channels))
    return {"x": x.astype(np.float32), "y": y.astype(np.int32)}
