"""One process of the two-process import / export check, started by tests/test_hf.py (not collected).

    python tests/hf_mp_driver.py COORDINATOR NUM_PROCESSES PROCESS_ID LOCAL_DEVICES CHECKPOINT OUT

Joins the job, loads CHECKPOINT onto ZeRO-3 over ``fsdp`` (every device of every process), and checks
that this process read exactly the bytes of the boxes its own devices hold (each distinct box once);
then exports to OUT (process 0 writes, every process takes part in the gathers). Prints
``bytes <process> <read> <own> <file>`` and ``OK``.
"""
import sys

import numpy as np

from jaxpar.devices import initialize


def main(coordinator: str, n: int, pid: int, local: int, path: str, out: str) -> None:
    initialize(coordinator, n, pid, local_device_count=local, heartbeat_timeout=20, initialization_timeout=120)
    import optax

    import jaxpar
    from jaxpar.hf import export, open_checkpoint
    from jaxpar.hf._files import DTYPES
    from flax import traverse_util

    ckpt = open_checkpoint(path)
    mesh = jaxpar.make_mesh({"fsdp": -1})
    layout = jaxpar.state_layout(ckpt.model_fn(), optax.adamw(1e-3), mesh, jaxpar.Strategy(zero=3))
    base = ckpt.files.bytes_read                     # the head check's first rows
    params = ckpt.load(mesh, layout.params)
    read = ckpt.files.bytes_read - base
    own = 0
    for x in traverse_util.flatten_dict(params).values():
        itemsize = DTYPES[ckpt.files.dtype(next(iter(ckpt.files.where)))].itemsize
        boxes = {tuple((s.start, s.stop) for s in (slice(*i.indices(d)[:2]) for i, d in zip(idx, x.shape)))
                 for idx in x.sharding.addressable_devices_indices_map(x.shape).values()}
        own += sum(int(np.prod([b - a for a, b in box])) * itemsize for box in boxes)
    total = sum(int(np.prod(ckpt.files.shape(k))) * DTYPES[ckpt.files.dtype(k)].itemsize for k in ckpt.files.where)
    print(f"bytes {pid} {read} {own} {total}", flush=True)
    if read != own:
        raise SystemExit(f"process {pid} read {read} bytes, its own boxes hold {own}")
    export(params, out, source=ckpt)
    print("OK", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], sys.argv[6])
