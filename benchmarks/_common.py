"""Shared helpers for the benchmarks: simulated devices, the strategy list, the
GPT model, jaxpar's step and a hand-written reference step.

Import this module *first* in every benchmark script: it sets up 8 simulated
CPU devices before anything touches the JAX backend.
"""

from __future__ import annotations

import os

os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import json  # noqa: E402
import platform  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from typing import Any, Callable  # noqa: E402

import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

import jaxpar  # noqa: E402
from jaxpar.models import GPT, GPTConfig, lm_loss  # noqa: E402
from jaxpar.step import TrainState  # noqa: E402
from jaxpar.step._compose import batch_sharding  # noqa: E402

__all__ = [
    "BenchStrategy", "STRATEGIES", "make_tx", "build", "make_batch", "abstract_batch",
    "make_hand_step", "markdown_table", "environment", "write_json", "GPTConfig",
]


@dataclass(frozen=True)
class BenchStrategy:
    """A named mesh + strategy; ``n_devices`` counts the devices of the mesh."""

    name: str
    mesh: dict = field(default_factory=dict)
    zero: int = 0
    sequence_parallel: bool = False

    @property
    def n_devices(self) -> int:
        n = 1
        for v in self.mesh.values():
            n *= v
        return n

    def make_mesh(self, n_devices: int | None = None):
        n = self.n_devices if n_devices is None else n_devices
        return jaxpar.make_mesh(dict(self.mesh), devices=jax.devices()[:n])

    def strategy(self) -> jaxpar.Strategy:
        return jaxpar.Strategy(zero=self.zero, sequence_parallel=self.sequence_parallel)


#: The strategies every benchmark covers (8 devices except ``single``).
STRATEGIES = (
    BenchStrategy("single", {}),
    BenchStrategy("DP8", {"data": 8}),
    BenchStrategy("ZeRO-1 (data=8)", {"data": 8}, zero=1),
    BenchStrategy("ZeRO-2 (data=8)", {"data": 8}, zero=2),
    BenchStrategy("ZeRO-3 (data=8)", {"data": 8}, zero=3),
    BenchStrategy("FSDP8", {"fsdp": 8}),
    BenchStrategy("TP8", {"tensor": 8}),
    BenchStrategy("TP8+SP", {"tensor": 8}, sequence_parallel=True),
    BenchStrategy("DP2xTP4", {"data": 2, "tensor": 4}),
    BenchStrategy("FSDP4xTP2", {"fsdp": 4, "tensor": 2}),
    BenchStrategy("DP2xFSDP2xTP2", {"data": 2, "fsdp": 2, "tensor": 2}),
)


def make_tx() -> optax.GradientTransformation:
    return optax.adamw(1e-3)


def build(cfg: GPTConfig, bs: BenchStrategy, n_devices: int | None = None, tx=None):
    """``(mesh, strategy, state, layout, tx)`` with the train state created sharded."""
    mesh = bs.make_mesh(n_devices)
    strategy = bs.strategy()
    tx = make_tx() if tx is None else tx
    state, layout = jaxpar.init_train_state(lambda: GPT(cfg, rngs=nnx.Rngs(0)), tx, mesh, strategy)
    return mesh, strategy, state, layout, tx


def make_batch(cfg: GPTConfig, batch_size: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, cfg.vocab, size=(batch_size, cfg.seq_len + 1), dtype=np.int32)
    return {"tokens": tokens[:, :-1], "targets": tokens[:, 1:]}


def abstract_batch(cfg: GPTConfig, batch_size: int, mesh) -> dict[str, jax.ShapeDtypeStruct]:
    sh = batch_sharding(mesh)
    s = jax.ShapeDtypeStruct((batch_size, cfg.seq_len), np.int32, sharding=sh)
    return {"tokens": s, "targets": s}


def make_hand_step(layout, tx, loss_fn: Callable = lm_loss, donate: bool = True, pin_grads: bool = False):
    """The same train step written by hand: ``jax.jit`` + ``jax.value_and_grad`` +
    optax, with the same in/out shardings as jaxpar's step (the layout's state
    shardings and the batch sharding). The model is rebuilt with ``nnx.merge``
    under ``jaxpar.use_rules`` so activations get the same sharding constraints;
    the data-axis collectives are left to XLA (no explicit data-parallel wrapper).
    Returns the same metrics (loss, global grad norm) as jaxpar's step.
    ``pin_grads=True`` also constrains the gradients to the strategy's gradient
    layout (``layout.grads``): without it XLA may pick another one (for ZeRO-1 it
    propagates the optimizer-state sharding into the gradients, making it ZeRO-2)."""
    mesh = layout.mesh
    state_sh = layout.shardings()
    replicated = NamedSharding(mesh, PartitionSpec())

    def loss_of(params, batch):
        with jaxpar.use_rules(mesh, layout.rules):
            return loss_fn(nnx.merge(layout.graphdef, params), batch)

    def step(state, batch):
        loss, grads = jax.value_and_grad(loss_of)(state.params, batch)
        if pin_grads:
            grads = jax.lax.with_sharding_constraint(grads, jaxpar.named_shardings(layout.grads, mesh))
        gnorm = optax.global_norm(grads)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        return TrainState(state.step + 1, params, opt_state), {"loss": loss, "grad_norm": gnorm}

    return jax.jit(step, in_shardings=(state_sh, batch_sharding(mesh)), out_shardings=(state_sh, replicated),
                   donate_argnums=(0,) if donate else ())


def copy_state(state):
    """A fresh copy of a (sharded) train state, so each variant can donate its own."""
    return jax.tree.map(lambda a: a.copy(), state)


def markdown_table(headers, rows) -> str:
    out = ["| " + " | ".join(headers) + " |",
           "|" + "|".join("---" if i == 0 else "---:" for i in range(len(headers))) + "|"]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(out)


def _git_state() -> str:
    """``<commit>`` of the checkout, ``+dirty`` when jaxpar/ has uncommitted edits."""
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "jaxpar"], cwd=root, capture_output=True,
                               text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (head or "unknown") + ("+dirty" if dirty else "")


def environment() -> dict[str, Any]:
    return {
        "git": _git_state(),
        "jax": jax.__version__,
        "devices": f"{jax.device_count()} x {jax.devices()[0].platform}",
        "nproc": os.cpu_count(),
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def write_json(path: str | None, payload: Any) -> None:
    if not path:
        return
    with open(path, "w") as f:
        json.dump(payload, f, indent=2, default=str)
    print(f"\nwrote {path}")


def quickstart_run(overrides: list[str], what: str, config: str = "quickstart.yaml") -> tuple[list[dict], float]:
    """``jaxpar train configs/<config>`` (the quickstart) with ``overrides``, in a temporary directory, quietly,
    one record per step, no checkpoints, 4 eval batches at the end: its ``train`` records and the
    final eval loss. ``what`` names the run in the error if it fails."""
    import tempfile
    from pathlib import Path

    from jaxpar.cli import main

    root = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory() as out:
        args = ["train", str(root / "configs" / config), "train.log_every=1", "checkpoint.enabled=false",
                "train.eval_batches=4", "train.eval_every=0", "logging.samples=0", "logging.tensorboard=false",
                "train.progress=none", f"train.out_dir={out}", *overrides]
        if main(args) != 0:
            raise RuntimeError(f"jaxpar train failed for {what}")
        recs = [json.loads(x) for x in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return [r for r in recs if r["kind"] == "train"], next(r["eval_loss"] for r in recs if r["kind"] == "eval")


def final_loss(recs: list[dict]) -> float:
    """The mean loss of the last 10% of the train records."""
    tail = recs[-max(1, len(recs) // 10):]
    return sum(r["loss"] for r in tail) / len(tail)


def convergence_rows(runs: dict[str, list[str]], base: str, steps=(1, 50, 100, 200, 300),
                     config: str = "quickstart.yaml") -> list[list[str]]:
    """One run of ``configs/<config>`` per ``{name: overrides}``: rows of the loss at ``steps``, the final train
    loss (:func:`final_loss`), the eval loss, and both over the run ``base``'s."""
    results = {name: quickstart_run(overrides, name, config) for name, overrides in runs.items()}
    base_train, base_eval = final_loss(results[base][0]), results[base][1]
    rows = []
    for name, (recs, evaluated) in results.items():
        at = {r["step"]: r["loss"] for r in recs}
        rows.append([name, *(f"{at[s]:.4f}" for s in steps), f"{final_loss(recs):.4f}", f"{evaluated:.4f}",
                     f"{final_loss(recs) / base_train:.4f}", f"{evaluated / base_eval:.4f}"])
    return rows
