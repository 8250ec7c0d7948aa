"""jaxpar's side of ``benchmarks/peers/levanter.py``: a worker in jaxpar's venv.

It loads the Hugging Face checkpoint that Levanter's worker wrote from its initial model
(``jaxpar.hf.train_state``: a :class:`jaxpar.models.Decoder` with the same weights), and trains it
with ``jaxpar.make_train_step(decoder_loss, tx, layout, strategy)`` on a mesh of jaxpar's axes
(``data``, ``fsdp``, ``tensor``) with the default strategy (FSDP on ``fsdp``, Megatron tensor
parallelism on ``tensor``). The batch is Levanter's: tokens ``[batch, seq]``, targets the tokens
shifted by one, the last position masked out. Commands: the same as ``_levanter_worker.py``'s.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _worker_protocol as proto  # noqa: E402

sys.path.pop(0)

import time  # noqa: E402
from importlib import metadata  # noqa: E402

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import jaxpar  # noqa: E402
from jaxpar.batch import batch_sharding  # noqa: E402
from jaxpar.hf import decoder_config, read_config, train_state  # noqa: E402
from jaxpar.models import Decoder, decoder_loss  # noqa: E402


def _strategy(rules: list | None) -> jaxpar.Strategy:
    return jaxpar.Strategy(extra_rules=tuple((name, axis) for name, axis in rules or ()))


class Worker:
    def __init__(self):
        self.step = self.state = self.batch = None

    def init(self, model: dict, batch: int, seq: int, tokens: str, lr: float, weight_decay: float, seed: int,
             attention: str = "vanilla") -> dict:
        del model, seed, attention      # the architecture and weights come from the checkpoint
        tokens = np.load(tokens)
        targets = np.roll(tokens, -1, axis=1)
        mask = np.ones_like(tokens, dtype=bool)
        mask[:, -1] = False             # Levanter's causal loss mask: the last position predicts nothing
        self.host_batch = {"tokens": tokens, "targets": targets, "loss_mask": mask}
        self.tx = optax.adamw(lr, weight_decay=weight_decay)
        self.remat = "none"
        return {"versions": {p: metadata.version(p) for p in ("jax", "jaxlib", "optax", "flax")}}

    def setup(self, axes: dict, hlo: str, warmup: int, checkpoint: str, remat: str = "none",
              rules: list | None = None) -> dict:
        """Build the layout's state (Levanter's initial weights) and step; compile; write the HLO; run
        ``warmup`` steps. ``rules``: ``[logical name, mesh axis or None]`` pairs before jaxpar's own."""
        self.step = self.state = self.batch = None
        mesh = jaxpar.make_mesh(axes, devices=jax.devices()[:8])
        strategy = _strategy(rules)
        state, layout, _ = train_state(checkpoint, self.tx, mesh, strategy, remat=remat, scan_layers=True)
        step = jaxpar.make_train_step(decoder_loss, self.tx, layout, strategy, grad_norm=False)   # as Levanter's hook-free step
        batch = jaxpar.shard_batch(self.host_batch, mesh)
        t0 = time.perf_counter()
        compiled = step.lower(state, batch).compile()
        compile_s = time.perf_counter() - t0
        with open(hlo, "w") as f:
            f.write(compiled.as_text())
        params = sum(int(np.prod(s.shape)) for s in jax.tree.leaves(layout.shapes))
        losses = []
        for _ in range(warmup):
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))
        self.step, self.state, self.batch = step, state, batch
        return {"compile_s": compile_s, "memory": proto.memory_stats(compiled), **proto.cost(compiled),
                "params": params, "losses": losses, "mesh": dict(mesh.shape)}

    def run(self, steps: int) -> float:
        """Seconds per step over ``steps`` steps back to back, blocked at the end."""
        state = self.state
        t0 = time.perf_counter()
        for _ in range(steps):
            state, metrics = self.step(state, self.batch)
        jax.block_until_ready((state, metrics))
        self.state = state
        return (time.perf_counter() - t0) / steps

    def target(self, axes: dict, hlo: str, target: str, checkpoint: str, remat: str = "none",
               rules: list | None = None) -> dict:
        """The same step compiled for ``target``'s abstract devices (``jaxpar.devices``); writes the HLO."""
        from jaxpar.devices import parse_target, target_devices

        self.step = self.state = self.batch = None
        devices = target_devices(parse_target(target))
        mesh = jaxpar.make_mesh(axes, devices=devices)
        strategy = _strategy(rules)
        cfg = decoder_config(read_config(checkpoint), remat=remat, scan_layers=True)
        layout = jaxpar.state_layout(lambda: Decoder(cfg, rngs=nnx.Rngs(0)), self.tx, mesh, strategy)
        step = jaxpar.make_train_step(decoder_loss, self.tx, layout, strategy, grad_norm=False)   # as Levanter's hook-free step
        sh = batch_sharding(mesh)
        batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sh) for k, v in self.host_batch.items()}
        t0 = time.perf_counter()
        compiled = step.lower(layout.abstract_state(), batch).compile()
        compile_s = time.perf_counter() - t0
        return proto.compiled_report(compiled, hlo, compile_s, devices, mesh)


if __name__ == "__main__":
    w = Worker()
    proto.serve({"init": w.init, "setup": w.setup, "run": w.run, "target": w.target})
