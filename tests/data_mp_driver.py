"""One process of the multi-process data pipeline check, started by tests/test_data_multiprocess.py
(not collected by pytest).

    python tests/data_mp_driver.py COORDINATOR NUM_PROCESSES PROCESS_ID LOCAL_DEVICES SPEC

``SPEC`` is a JSON file written by the test: the tokenizer's directory and, per source, its file,
text field, token cache and weight. The process joins the job with :func:`jaxpar.devices.initialize`,
opens the token caches (checked against the sources and the tokenizer) and, for several meshes, builds
steps ``0 .. STEPS - 1`` of :class:`jaxpar.data.PackedBatches` with :func:`jaxpar.data.make_global_batch`.
For each step it checks that

* the gathered global batch equals the batch one local ``PackedBatches`` (other store objects) builds
  for all rows: same :func:`jaxpar.data.batch_digest`, same loss weights;
* each store's ``bytes_read`` grew by exactly the bytes of this process's rows' planned segments
  (``n`` tokens, plus the next one where the segment does not end its document), and, where the
  process holds part of the batch only, by well under the whole batch's bytes.

A last mesh (``dp_live``) reads the sources tokenized on the fly and checks the digests only.
Prints ``mesh <name> <shape> rows <rows>``, ``digest <hex>`` (per mesh and step) and
``bytes <name> <step> <read> <whole batch>`` lines, and ``OK`` at the end; a failed check exits
with a message (``SystemExit``).
"""
import json
import sys
from pathlib import Path

import numpy as np

from jaxpar.devices import initialize

#: The batches every process (and the test's one-process reference) builds.
SEQ_LEN, BATCH, SEED, ROWS_PER_WINDOW, STEPS = 64, 16, 7, 8, 5


def open_stores(spec: dict) -> list:
    """Fresh store objects of the spec's token caches (their ``bytes_read`` start at 0)."""
    from jaxpar.data._cache import expected_meta, open_cache
    from jaxpar.data.sources import open_source
    from jaxpar.data import load_tokenizer

    tokenizer = load_tokenizer(spec["tokenizer"], eos_token="</s>")
    return [open_cache(s["cache"], expected_meta(open_source(s["path"], text_field=s["text_field"]), tokenizer,
                                                 bos=False, eos=True))
            for s in spec["sources"]]


def live_stores(spec: dict) -> list:
    """The spec's sources tokenized on the fly (:class:`jaxpar.data.LiveTokens`), not read from the caches."""
    from jaxpar.data.sources import open_source
    from jaxpar.data import load_tokenizer
    from jaxpar.data import LiveTokens

    tokenizer = load_tokenizer(spec["tokenizer"], eos_token="</s>")
    return [LiveTokens(open_source(s["path"], text_field=s["text_field"]), tokenizer, bos=False, eos=True)
            for s in spec["sources"]]


def packed_batches(spec: dict, stores: list):
    """The run's :class:`jaxpar.data.PackedBatches` over ``stores``."""
    from jaxpar.data import PackedBatches

    return PackedBatches(stores, [s["weight"] for s in spec["sources"]], seq_len=SEQ_LEN, batch_size=BATCH,
                         seed=SEED, rows_per_window=ROWS_PER_WINDOW, prefetch=0)


def planned_bytes(data, stores: list, step: int, rows) -> list[int]:
    """Per store, the bytes that building global ``rows`` of ``step`` reads: each planned segment's
    ``n`` tokens, plus one more (its last target) where the segment does not end its document."""
    first = data.first_row(step)
    planned = data.plan.rows(first, first + data.size_at(step))
    out = [0] * len(stores)
    for row in rows:
        pieces, segments = planned[int(row)]
        for p, offset, n in segments:
            source, _, start, _, doc_len = (int(v) for v in pieces[p])
            tokens = n + int(start + offset + n < doc_len)
            out[source] += tokens * stores[source].tokens.dtype.itemsize
    return out


def check_global(placed: dict, reference: dict, where: str) -> None:
    """The global batch ``placed``, gathered, is ``reference`` (digest and loss weights); prints its digest."""
    from jax.experimental import multihost_utils

    from jaxpar.data import batch_digest

    gathered = {k: np.asarray(v) for k, v in multihost_utils.process_allgather(placed, tiled=True).items()}
    digest, want = batch_digest(gathered), batch_digest(reference)
    if digest != want:
        raise SystemExit(f"{where}: the gathered global batch (digest {digest}) differs from one process's batch "
                         f"of all rows ({want})")
    if not np.array_equal(gathered["loss_weights"], reference["loss_weights"]):
        raise SystemExit(f"{where}: the loss weights differ from one process's (they must count the unmasked "
                         "targets of the whole global batch)")
    print(f"digest {digest}", flush=True)


def main(coordinator: str, num_processes: int, process_id: int, local_devices: int, spec_file: str) -> None:
    info = initialize(coordinator, num_processes, process_id, local_device_count=local_devices,
                      heartbeat_timeout=20, initialization_timeout=120)
    print(f"joined {info.describe()}", flush=True)
    import jax

    import jaxpar
    from jaxpar.batch import batch_sharding
    from jaxpar.data import make_global_batch, process_rows

    me = f"process {process_id}"
    if (jax.process_count(), jax.process_index()) != (num_processes, process_id):
        raise SystemExit(f"joined as process {jax.process_index()} of {jax.process_count()}, expected "
                         f"{process_id} of {num_processes}")
    if jax.device_count() != num_processes * local_devices:
        raise SystemExit(f"{me}: {jax.device_count()} devices, expected {num_processes} x {local_devices}")
    spec = json.loads(Path(spec_file).read_text())
    reference_stores = open_stores(spec)
    reference_data = packed_batches(spec, reference_stores)
    reference = [reference_data(step) for step in range(STEPS)]    # all rows, this process alone

    meshes = {"dp": dict(data=-1), "zero3_tp": dict(data=2, fsdp=2, tensor=-1), "pipe": dict(pipe=2, data=-1),
              "context": dict(context=2, data=-1),
              "hybrid_dcn": dict(data=2, fsdp=4, dcn={"data": num_processes})}   # data across processes
    read_any = [0] * len(reference_stores)
    for name, axes in meshes.items():
        mesh = jaxpar.make_mesh(jaxpar.MeshSpec(**axes))
        rows = process_rows(batch_sharding(mesh), BATCH)
        print(f"mesh {name} {dict(mesh.shape)} rows {rows.tolist()}", flush=True)
        stores = open_stores(spec)                  # counted: only this mesh's run reads them
        data = packed_batches(spec, stores)
        for step in range(STEPS):
            before = [s.bytes_read for s in stores]
            placed = make_global_batch(data, step, mesh)
            read = [s.bytes_read - b for s, b in zip(stores, before)]
            check_global(placed, reference[step], f"{me}: mesh {name} step {step}")
            own = planned_bytes(reference_data, reference_stores, step, rows)
            whole = planned_bytes(reference_data, reference_stores, step, range(BATCH))
            print(f"bytes {name} {step} {sum(read)} {sum(whole)}", flush=True)
            if read != own:
                raise SystemExit(f"{me}: mesh {name} step {step}: the stores read {read} bytes, but rows "
                                 f"{rows.tolist()} hold {own} (per store)")
            if len(rows) < BATCH and not sum(read) < 0.75 * sum(whole):
                raise SystemExit(f"{me}: mesh {name} step {step}: {sum(read)} bytes read for {len(rows)} of "
                                 f"{BATCH} rows, not well below the whole batch's {sum(whole)}")
            read_any = [a + r for a, r in zip(read_any, read)]
    mesh = jaxpar.make_mesh(jaxpar.MeshSpec(data=-1))      # the text tokenized on the fly: the same batches
    print(f"mesh dp_live {dict(mesh.shape)} rows {process_rows(batch_sharding(mesh), BATCH).tolist()}", flush=True)
    data = packed_batches(spec, live_stores(spec))
    for step in range(STEPS):
        check_global(make_global_batch(data, step, mesh), reference[step], f"{me}: mesh dp_live step {step}")
    if not all(read_any):
        raise SystemExit(f"{me}: a source was never read ({read_any} bytes per store): the mixture is not checked")
    print("OK", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
