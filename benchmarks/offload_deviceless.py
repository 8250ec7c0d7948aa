"""Memory offloading on one H100, deviceless: a Llama-3-8B-shaped :class:`jaxpar.models.Decoder` (AdamW,
fp32 parameters and moments, bf16 compute, ``remat="full"``) compiled for ``h100:1x1`` without offload, with
the optimizer state on the host and the host update, and with the master weights too. Prints one JSON line
per case: the device peak (``memory_report(...).required_bytes``), the host arguments and temporaries, and
the bytes moved between device and host per step (docs/strategies.md, memory offloading).

    python benchmarks/offload_deviceless.py LAYERS SEQ BATCH [none,opt-host,opt-master-host]
"""
import json
import sys
import time

import jax
import numpy as np
import optax
from flax import nnx

import jaxpar
from jaxpar.analysis._compiled_memory import host_transfers, memory_report
from jaxpar.devices import parse_target, target_devices
from jaxpar.models import Decoder, DecoderConfig, RoPE, decoder_loss
from jaxpar.options import Offload

#: Llama-3-8B's widths (config.json of meta-llama/Meta-Llama-3-8B); ``layers`` is the argument's.
LLAMA3_8B = dict(vocab=128256, embed=4096, heads=32, kv_heads=8, head_dim=128, mlp=14336, norm_eps=1e-5,
                 rope=RoPE(theta=500000.0))
OFFLOADS = {"none": None, "opt-host": Offload(optimizer=True, update="host"),
            "opt-master-host": Offload(optimizer=True, master=True, update="host")}


def measure(layers: int, seq: int, batch: int, kind: str) -> dict:
    """One case's figures (bytes per device)."""
    cfg = DecoderConfig(**LLAMA3_8B, layers=layers, remat="full")
    mesh = jaxpar.make_mesh({"data": 1}, devices=target_devices(parse_target("h100:1x1")))
    strategy = jaxpar.Strategy(compute_dtype="bfloat16", offload=OFFLOADS[kind])
    tx = optax.adamw(3e-4, weight_decay=0.1)
    start = time.perf_counter()
    layout = jaxpar.state_layout(lambda: Decoder(cfg, rngs=nnx.Rngs(0)), tx, mesh, strategy)
    step = jaxpar.make_train_step(decoder_loss, tx, layout, strategy)
    with jax.set_mesh(mesh):     # a target's devices list no memories: shardings over the abstract mesh
        tokens = jax.ShapeDtypeStruct((batch, seq), np.int32,
                                      sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
        compiled = step.lower(layout.abstract_state(), {"tokens": tokens, "targets": tokens}).compile()
    r = memory_report(compiled)
    state = layout.abstract_state()
    nbytes = lambda tree: sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(tree))     # noqa: E731
    return dict(kind=kind, layers=layers, seq=seq, batch=batch, params=nbytes(state.params),
                opt=nbytes(state.opt_state), device_peak=r.required_bytes, host_args=r.host_argument_bytes,
                host_temps=r.host_temp_bytes, **host_transfers(compiled.as_text()),
                compile_s=round(time.perf_counter() - start, 1))


if __name__ == "__main__":
    layers, seq, batch = (int(a) for a in sys.argv[1:4])
    for kind in (sys.argv[4].split(",") if len(sys.argv) > 4 else OFFLOADS):
        print(json.dumps(measure(layers, seq, batch, kind)), flush=True)
