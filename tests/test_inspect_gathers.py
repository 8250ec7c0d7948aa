"""``jaxpar inspect`` on a step whose parameters the data axes shard: the bytes it all-gathers, weights against
activations, and the warning with its fix when XLA gathers a model's unconstrained activations instead of
its weights (a user's model: a wide MLP on a small batch under FSDP8)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

from conftest import need_devices
import jaxpar
from jaxpar.plan import gather_lines


class Wide(nnx.Module):
    """256 -> 1024 -> 256: 2 MiB of weights against 8 KiB of activations per layer on 8 rows."""

    def __init__(self, rngs: nnx.Rngs, pin: bool):
        init, wp = nnx.initializers.lecun_normal(), nnx.with_partitioning
        self.pin = pin
        self.up = nnx.Linear(256, 1024, use_bias=False, rngs=rngs, kernel_init=wp(init, ("embed", "mlp")))
        self.down = nnx.Linear(1024, 256, use_bias=False, rngs=rngs, kernel_init=wp(init, ("mlp", "embed")))

    def __call__(self, x):
        pin = (lambda a, names: jaxpar.constrain(a, names)) if self.pin else (lambda a, names: a)
        return pin(self.down(pin(jax.nn.relu(self.up(pin(x, ("batch", "embed")))), ("batch", "mlp"))), ("batch", "embed"))


def loss(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


@need_devices(8)
@pytest.mark.parametrize("pin", [False, True])
def test_inspect_says_what_an_fsdp_step_gathers(pin):
    mesh = jaxpar.make_mesh({"fsdp": 8}, devices=jax.devices()[:8])
    layout = jaxpar.state_layout(lambda: Wide(nnx.Rngs(0), pin), optax.sgd(0.1), mesh)
    step = jaxpar.make_train_step(loss, optax.sgd(0.1), layout)
    batch = {k: jax.ShapeDtypeStruct((8, 256), jnp.float32) for k in ("x", "y")}
    lines = gather_lines(layout, step.lower(layout.abstract_state(), batch).compile())
    if pin:      # the activations stay split over the batch: the two weights are gathered (forward, backward)
        assert lines[0].startswith("gathers  weights 2.0 MiB, activations 0 B") and len(lines) == 1, lines
    else:        # XLA gathers the 8 x 256 activations (twice) instead of the weights
        assert lines[0].startswith("gathers  weights 0 B, activations 16.0 KiB"), lines
        assert lines[1].startswith("warning  the step gathers more activation bytes than weight bytes")
        assert "jaxpar.constrain(x, ('batch', 'length', 'embed'))" in lines[1]
    assert gather_lines(jaxpar.state_layout(lambda: Wide(nnx.Rngs(0), pin), optax.sgd(0.1),
                                            jaxpar.make_mesh({"data": 8}, devices=jax.devices()[:8])), None) == []
