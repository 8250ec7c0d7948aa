"""One process of a multi-process check, started by tests/test_multiprocess.py (not collected by pytest).

    python tests/mp_driver.py COORDINATOR NUM_PROCESSES PROCESS_ID LOCAL_DEVICES
    python tests/mp_driver.py env NUM_PROCESSES PROCESS_ID LOCAL_DEVICES   # who is who: from the environment

Joins the job with :func:`jaxpar.devices.initialize`, then, for several meshes and
both data sources, checks that this process builds only its own rows of the global
batch and that the assembled global batch equals the batch one process builds.
Prints ``rows <process> <mesh> <n>`` lines and ``OK`` at the end.
"""
import sys
from functools import partial

import numpy as np

from jaxpar.devices import initialize


def main(coordinator: str, num_processes: int, process_id: int, local_devices: int) -> None:
    flags = (None, None, None) if coordinator == "env" else (coordinator, num_processes, process_id)
    info = initialize(*flags, local_device_count=local_devices, heartbeat_timeout=20, initialization_timeout=120)
    print(f"joined {info.describe()}", flush=True)
    import jax
    from jax.experimental import multihost_utils

    import jaxpar
    from jaxpar.data import _windows as D
    from jaxpar.step._compose import batch_sharding

    if (jax.process_count(), jax.process_index()) != (num_processes, process_id):
        raise SystemExit(f"joined as process {jax.process_index()} of {jax.process_count()}, expected "
                         f"{process_id} of {num_processes}")
    corpus = D.load_bytes(max_bytes=100_000)
    batch = 16
    sources = {
        "text": partial(D.text_batch, corpus, batch_size=batch, seq_len=8, seed=3),
        "synthetic": partial(D.synthetic_batch, batch_size=batch, seq_len=8, vocab=50, seed=3),
    }
    for spec in (dict(data=-1), dict(data=2, fsdp=2, tensor=-1), dict(tensor=2, fsdp=-1),
                 dict(data=2, fsdp=4, dcn={"data": num_processes})):   # hybrid: data across processes
        mesh = jaxpar.make_mesh(jaxpar.MeshSpec(**spec))
        rows = D.process_rows(batch_sharding(mesh), batch)
        expect = batch // num_processes   # these meshes put the processes on the batch axes
        if len(rows) != expect:
            raise SystemExit(f"process {process_id}: mesh {dict(mesh.shape)} holds {len(rows)} rows, expected {expect}")
        print(f"rows {process_id} {dict(mesh.shape)} {rows.tolist()}", flush=True)
        for name, fn in sources.items():
            calls = []

            def counted(step, rows=None, fn=fn):
                out = fn(step, rows=rows)
                calls.append(len(out["tokens"]))
                return out

            placed = D.make_global_batch(counted, 7, mesh)
            if calls != [len(rows)]:
                raise SystemExit(f"process {process_id}: {name} built {calls} rows, expected only its {len(rows)}")
            full = fn(7)
            for key, value in placed.items():
                got = multihost_utils.process_allgather(value, tiled=True)
                if not np.array_equal(got, full[key]):
                    raise SystemExit(f"process {process_id}: {name} {key} differs from one process's batch "
                                     f"on mesh {dict(mesh.shape)}")
    print("OK", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
