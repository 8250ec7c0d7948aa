"""Memory offloading on one GPU: peak device memory and step time with and without each kind of offload.

A Llama-3-8B-shaped :class:`jaxpar.models.Decoder` cut to ``--layers`` layers (AdamW, fp32 parameters and
moments, bf16 compute, ``remat="full"``; the activations case ``remat="offload"``), one device. Each case runs
in a process of its own, so that the device's ``peak_bytes_in_use`` is that case's alone:

- the state is built leaf by leaf in the memory kind its layout gives it (parameters a constant, moments
  zero: values move neither the step's memory nor its time), so building it never holds more on the device
  than the case keeps there; ``init`` instead times :func:`jaxpar.init_train_state` and its peak;
- then ``--reps`` steps after one warm-up: the median step, ``memory_stats()`` (bytes in use with the state
  built, the peak after the steps), and the compiled program's figures (:func:`memory_report`'s device
  peak, host arguments and temporaries, :func:`host_transfers`).

``python benchmarks/offload_gpu.py --out DIR [--layers 4 --seq 4096 --batch 1 --reps 5]``; ``--small``
runs tiny shapes on any backend. One JSON line per case, all in ``DIR/offload_gpu.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

#: case -> (Offload keyword arguments or None, the model's remat policy)
CASES = {"none": (None, "full"), "opt-host": (dict(optimizer=True, update="host"), "full"),
         "opt-master-host": (dict(optimizer=True, master=True, update="host"), "full"),
         "opt": (dict(optimizer=True), "full"), "opt-master": (dict(optimizer=True, master=True), "full"),
         "act": (dict(activations=("jaxpar_layer_input",)), "offload"),
         "init": (dict(optimizer=True, master=True, update="host"), "full")}
SMALL = dict(vocab=256, embed=64, heads=4, kv_heads=2, head_dim=16, mlp=128)


def built_state(layout):
    """The train state leaf by leaf in its layout's memory kinds: floats 0.01 (parameters) or 0 (moments)."""
    import jax
    import numpy as np

    def leaf(path, a):
        is_param = jax.tree_util.keystr(path).startswith(".params")
        value = 0.01 if is_param and np.issubdtype(a.dtype, np.floating) else 0
        return jax.device_put(np.full(a.shape, value, a.dtype), a.sharding)
    return jax.tree_util.tree_map_with_path(leaf, layout.abstract_state())


def run_case(case: str, layers: int, seq: int, batch: int, reps: int, small: bool) -> dict:
    import jax
    import numpy as np
    import optax
    from flax import nnx

    import jaxpar
    from jaxpar.analysis._compiled_memory import host_transfers, memory_report
    from jaxpar.models import Decoder, DecoderConfig, decoder_loss
    from jaxpar.options import Offload
    sys.path.insert(0, str(Path(__file__).parent))
    from gpu import run_steps
    from offload_deviceless import LLAMA3_8B

    kwargs, remat = CASES[case]
    cfg = DecoderConfig(**(SMALL if small else LLAMA3_8B), layers=layers, remat=remat)
    strategy = jaxpar.Strategy(compute_dtype="bfloat16", offload=kwargs and Offload(**kwargs))
    tx = optax.adamw(3e-4, weight_decay=0.1)
    mesh = jaxpar.make_mesh({"data": 1}, devices=jax.devices()[:1])
    device = jax.devices()[0]
    stats = lambda: device.memory_stats() or {}           # noqa: E731 - the CPU backend has none
    model_fn = lambda: Decoder(cfg, rngs=nnx.Rngs(0))     # noqa: E731
    row = dict(case=case, layers=layers, seq=seq, batch=batch)
    t = time.perf_counter()
    if case == "init":
        state, layout = jaxpar.init_train_state(model_fn, tx, mesh, strategy)
        jax.block_until_ready(state)
        row.update(init_s=round(time.perf_counter() - t, 1), in_use=stats().get("bytes_in_use"),
                   peak=stats().get("peak_bytes_in_use"))
        return row
    layout = jaxpar.state_layout(model_fn, tx, mesh, strategy)
    state = built_state(layout)
    jax.block_until_ready(state)
    row.update(build_s=round(time.perf_counter() - t, 1), in_use=stats().get("bytes_in_use"))
    step = jaxpar.make_train_step(decoder_loss, tx, layout, strategy, clip_norm=1.0)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab, (batch, seq + 1)).astype(np.int32)
    data = jaxpar.shard_batch({"tokens": tokens[:, :-1], "targets": tokens[:, 1:]}, mesh)
    compiled, compile_s, state, m, times = run_steps(step, state, data, warmup=1, reps=reps)
    row["compile_s"] = round(compile_s, 1)
    r = memory_report(compiled)
    row.update(ms=round(1e3 * statistics.median(times), 2), ms_all=[round(1e3 * x, 1) for x in times],
               loss=float(m["loss"]), peak=stats().get("peak_bytes_in_use"), compiled_peak=r.required_bytes,
               host_args=r.host_argument_bytes, host_temps=r.host_temp_bytes,
               **host_transfers(compiled.as_text()), device=device.device_kind, jax=jax.__version__)
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="out/offload_gpu")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--case", help="run one case in this process and print its JSON line")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds for each case's process")
    ap.add_argument("--small", action="store_true")
    args = ap.parse_args()
    shape = ["--layers", str(args.layers), "--seq", str(args.seq), "--batch", str(args.batch),
             "--reps", str(args.reps)] + ["--small"] * args.small
    if args.case:
        print("ROW " + json.dumps(run_case(args.case, args.layers, args.seq, args.batch, args.reps, args.small)))
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for case in args.cases.split(","):
        try:
            proc = subprocess.run([sys.executable, __file__, "--case", case] + shape, capture_output=True,
                                  text=True, timeout=args.timeout)
            lines = [ln[4:] for ln in proc.stdout.splitlines() if ln.startswith("ROW ")]
            row = json.loads(lines[-1]) if lines else {"case": case, "error": proc.stderr[-1500:]}
        except subprocess.TimeoutExpired:
            row = {"case": case, "error": f"over {args.timeout} s"}
        rows.append(row)
        print(json.dumps(row), flush=True)
        (out / "offload_gpu.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
