"""Levanter's side of ``benchmarks/peers/levanter.py``: a worker in Levanter's own venv.

Run as ``.venv-levanter/bin/python -P _levanter_worker.py`` (``-P``: the script's folder is not on
``sys.path``, so ``import levanter`` finds the package, not the driver ``levanter.py``). It builds
Levanter's Llama (``LlamaConfig.build``: haliax named axes, scanned layers) and trains it with
Levanter's own train step, ``Trainer._jit_train_step_fn_no_hook`` (the step ``Trainer.train_step``
runs on steps without jit hooks: ``eqx.filter_value_and_grad`` of ``compute_next_token_loss`` under the
compute axis mapping, ``TrainerState.take_step``, ``named_jit`` over the parameter axis mapping),
on a mesh from Levanter's ``MeshConfig``: its axes ``data`` (FSDP: parameters' ``embed`` sharded
over it, the default ``param_mapping``), ``replica`` (plain data parallelism) and ``model``
(``heads`` and ``mlp``, the default shared mapping). Commands: the :class:`Worker` methods ``init``,
``export``, ``setup``, ``run`` and ``target``.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # _worker_protocol (imported first, then removed)
import _worker_protocol as proto  # noqa: E402

sys.path.pop(0)

import json  # noqa: E402
import time  # noqa: E402
from contextlib import ExitStack  # noqa: E402
from importlib import metadata  # noqa: E402

import equinox as eqx  # noqa: E402
import haliax as hax  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jax.random as jrandom  # noqa: E402
import levanter  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from haliax import Axis  # noqa: E402
from levanter.layers.attention import AttentionBackend  # noqa: E402
from levanter.models.llama import LlamaConfig  # noqa: E402
from levanter.models.lm_model import LmExample  # noqa: E402
from levanter.tracker import NoopConfig  # noqa: E402
from levanter.trainer import Trainer, TrainerConfig  # noqa: E402
from levanter.trainer_state import TrainerState  # noqa: E402
from levanter.utils.mesh import MeshConfig, create_mesh_from_axis_specs  # noqa: E402


class _Config(TrainerConfig):
    """Levanter's TrainerConfig on a mesh of given devices (a deviceless target's), else its own."""

    devices: list | None = None

    @property
    def device_mesh(self):
        if self.devices is None:
            return super().device_mesh
        ici, dcn = self.mesh.axis_shapes(len(self.devices), 1)
        return create_mesh_from_axis_specs(ici_axes=ici, dcn_axes=dcn, devices=self.devices)


def _shardings(tree, mapping, mesh):
    """``NamedSharding``s of a tree of (abstract) named arrays under ``mapping`` (haliax's ``pspec_for``)."""
    from jax.sharding import NamedSharding, PartitionSpec

    specs = hax.partitioning.pspec_for(tree, resource_mapping=mapping)
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, PartitionSpec))


def _abstract(shapes, shardings):
    """``shapes`` (of ``eqx.filter_eval_shape``) with each array's sharding from ``shardings`` (a prefix tree:
    one ``NamedSharding`` per named array, ``None`` where there is none)."""
    def put(h, s):
        if h is None:
            return s
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=h), s)

    return jax.tree.map(put, shardings, shapes, is_leaf=lambda x: x is None)


def _resolve_to(mesh):
    """Outside jit, haliax finds no mesh under ``use_abstract_mesh`` alone: give it the target's concrete one."""
    resolve = getattr(hax.partitioning._resolve_mesh, "original", hax.partitioning._resolve_mesh)

    def patched(m=None):
        found = resolve(m)
        return mesh if found is None else found

    patched.original = resolve
    hax.partitioning._resolve_mesh = patched


def _deviceless_haliax():
    """What a deviceless compile needs of haliax. It asks ``is_in_jit()`` by running ``jnp.zeros`` eagerly,
    which under a mesh of a target's abstract devices (nothing can run there) fails: ask JAX's trace
    state instead (the same answer)."""
    from jax._src import core

    hax.partitioning.is_in_jit = lambda: not core.trace_state_clean()
    # and named_jit passes only arrays (eqx.is_array) to jit as arguments: let abstract ones through too
    hax.partitioning.is_array = lambda x: eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


class Worker:
    def __init__(self):
        self.stack = ExitStack()
        self.fn = self.state = self.example = None

    # ------------------------------------------------------------------ setup
    def init(self, model: dict, batch: int, seq: int, tokens: str, lr: float, weight_decay: float, seed: int,
             attention: str = "vanilla") -> dict:
        m = model
        backend = None if attention == "default" else AttentionBackend[attention.upper()]
        self.cfg = LlamaConfig(max_seq_len=seq, hidden_dim=m["embed"], intermediate_dim=m["mlp"],
                               num_layers=m["layers"], num_heads=m["heads"], num_kv_heads=m["kv_heads"],
                               head_dim=m["head_dim"], layer_norm_epsilon=m["norm_eps"],
                               gradient_checkpointing=m["remat"], scan_layers=True, attn_backend=backend)
        self.Vocab = Axis("vocab", m["vocab"])
        self.batch, self.seq, self.seed = batch, seq, seed
        self.tokens = np.load(tokens)
        self.tx = optax.adamw(lr, weight_decay=weight_decay)
        return {"versions": {p: metadata.version(p) for p in ("marin-levanter", "marin-haliax", "jax", "jaxlib",
                                                              "optax", "equinox", "transformers")}}

    def _model_init(self):
        return self.cfg.build(self.Vocab, key=jrandom.PRNGKey(self.seed))

    def _trainer(self, axes: dict, devices=None, shared_mapping: dict | None = None) -> Trainer:
        mesh = MeshConfig(axes=axes) if shared_mapping is None else MeshConfig(axes=axes, shared_mapping=shared_mapping)
        tc = _Config(mesh=mesh, tracker=NoopConfig(), train_batch_size=self.batch,
                     num_train_steps=10**6, log_jaxprs=False, log_xla_hlo=False, id="peer-bench",
                     require_accelerator=False)
        tc.devices = devices
        tc._initialize_jax_config()     # Levanter's jax settings (threefry partitionable, softmax custom jvp)
        if devices is None:
            tc._validate_and_set_defaults()
        else:
            tc.per_device_parallelism = -1      # no micro-batching (validation counts this process's devices)
        return Trainer(tc, self.tx, lambda model, ex, *, key=None: model.compute_next_token_loss(ex, key=key))

    def _example(self, trainer: Trainer, abstract: bool = False):
        Batch, Pos = trainer.TrainBatch, self.cfg.max_Pos.resize(self.seq)
        make = lambda t: hax.vmap(LmExample.causal, Batch)(hax.named(t, (Batch, Pos)))  # noqa: E731
        if abstract:
            ex = eqx.filter_eval_shape(make, jax.ShapeDtypeStruct(self.tokens.shape, jnp.int32))
            sh = _shardings(ex, trainer.compute_axis_mapping, trainer.device_mesh)
            return _abstract(ex, sh)
        return hax.shard(make(jnp.asarray(self.tokens)), trainer.compute_axis_mapping)

    def export(self, path: str) -> dict:
        """The initial model as a Hugging Face Llama checkpoint (config.json, model.safetensors)."""
        from safetensors.numpy import save_file

        model = self._model_init()
        sd = hax.state_dict.to_torch_compatible_state_dict(model)
        os.makedirs(path, exist_ok=True)
        save_file({k: np.ascontiguousarray(np.asarray(v, np.float32)) for k, v in sd.items()},
                  os.path.join(path, "model.safetensors"))
        hf = self.cfg.to_hf_config(self.Vocab.size).to_dict()
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(hf, f, indent=1, default=str)
        return {"params": int(sum(np.size(v) for v in sd.values())), "keys": sorted(sd)}

    def setup(self, axes: dict, hlo: str, warmup: int, shared_mapping: dict | None = None) -> dict:
        """Build the layout's trainer, state and step; compile; write the HLO; run ``warmup`` steps.
        ``shared_mapping``: logical axis -> mesh axis besides Levanter's defaults (``MeshConfig.shared_mapping``)."""
        self.stack.close()
        self.fn = self.state = self.example = None
        trainer = self._trainer(axes, shared_mapping=shared_mapping)
        self.stack.enter_context(trainer)
        state = trainer.initial_state(jrandom.PRNGKey(self.seed + 1), model_init=self._model_init)
        example = self._example(trainer)
        fn = trainer._jit_train_step_fn_no_hook
        t0 = time.perf_counter()
        compiled = fn.lower(state, (example,), {}).compile()
        compile_s = time.perf_counter() - t0
        with open(hlo, "w") as f:
            f.write(compiled.as_text())
        params = sum(x.size for x in jax.tree.leaves(eqx.filter(state.model, eqx.is_array)))
        losses = []
        for _ in range(warmup):
            r = fn(state, (example,), {})
            state = r.new_state
            losses.append(float(r.loss))
        self.fn, self.state, self.example = fn, state, example
        return {"compile_s": compile_s, "memory": proto.memory_stats(compiled), **proto.cost(compiled),
                "params": int(params), "losses": losses, "mesh": dict(trainer.device_mesh.shape)}

    def run(self, steps: int) -> float:
        """Seconds per step over ``steps`` steps back to back, blocked at the end."""
        state = self.state
        t0 = time.perf_counter()
        for _ in range(steps):
            r = self.fn(state, (self.example,), {})
            state = r.new_state
        jax.block_until_ready((state, r.loss))
        self.state = state
        return (time.perf_counter() - t0) / steps

    def target(self, axes: dict, hlo: str, targets_dir: str, name: str, target_config: str, hosts: int,
               per_host: int, shared_mapping: dict | None = None) -> dict:
        """The same step compiled for a GPU target's abstract devices; writes the HLO."""
        self.stack.close()
        self.fn = self.state = self.example = None
        proto.start_cuda_compiler(targets_dir)
        _deviceless_haliax()
        devices = proto.gpu_devices(name, target_config, hosts, per_host)
        trainer = self._trainer(axes, devices, shared_mapping)
        mesh = trainer.device_mesh
        _resolve_to(mesh)
        # Trainer.__enter__'s contexts, with the abstract mesh: under the concrete mesh of devices that cannot
        # run anything, the constants haliax computes eagerly while tracing (RoPE's frequencies) fail.
        with levanter.current_tracker(trainer.tracker), jax.sharding.use_abstract_mesh(mesh.abstract_mesh), \
                hax.axis_mapping(trainer.parameter_axis_mapping):

            def init():
                return TrainerState.init(self.tx, self._model_init(), key=jrandom.PRNGKey(self.seed + 1),
                                         is_trainable=True, mp=trainer.mp)

            shapes = eqx.filter_eval_shape(init)
            shardings = _shardings(shapes, trainer.parameter_axis_mapping, mesh)
            state = _abstract(shapes, shardings)
            example = self._example(trainer, abstract=True)
            t0 = time.perf_counter()
            compiled = trainer._jit_train_step_fn_no_hook.lower(state, (example,), {}).compile()
            compile_s = time.perf_counter() - t0
        return proto.compiled_report(compiled, hlo, compile_s, devices, mesh)


if __name__ == "__main__":
    w = Worker()
    proto.serve({"init": w.init, "export": w.export, "setup": w.setup, "run": w.run, "target": w.target})
