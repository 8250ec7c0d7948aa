"""Host memory and throughput of importing and exporting a Hugging Face checkpoint (jaxpar.hf).

A synthetic Llama of ~1.1B parameters (hidden 2048, 16 layers, 32 heads, 8 K/V heads, MLP 8192,
vocab 32000, untied) is written in bf16 (random values, streamed to disk), then in a fresh process:

* **load**: :meth:`jaxpar.hf.Checkpoint.load` onto ZeRO-3 over ``fsdp=8`` (8 simulated CPU devices, fp32
  master weights). The devices' memory is host memory here, so the resident parameters are part of
  the process's anonymous memory; what matters is the peak *above* them: ``peak - baseline -
  resident``, against ``1.5 x the largest shard + 100 MB`` (a bf16 box read and its fp32 copy).
* **export**: :func:`jaxpar.hf.export` of the loaded parameters, peak above the post-load level,
  against ``2 x the largest tensor (fp32) + 100 MB``; and a check that the export's tensors are the
  source's bytes.

Anonymous memory is ``RssAnon`` of ``/proc/self/status``, sampled every 2 ms by a thread (the
memory-mapped file's pages are file-backed and not counted). Throughput is the file bytes read
divided by the load's wall time.

Usage::

    python benchmarks/hf_memory.py [--dir /tmp/jaxpar-hf-bench] [--json out.json] [--small]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32000, "hidden_size": 2048,
          "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
          "head_dim": 64, "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "dtype": "bfloat16",
          "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"}}
SMALL = dict(CONFIG, vocab_size=4000, hidden_size=512, intermediate_size=2048, num_hidden_layers=4,
             num_attention_heads=8, num_key_value_heads=2)


def rss_anon() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


class Peak:
    """The highest ``RssAnon`` seen while the block runs."""

    def __enter__(self):
        self.peak, self.running = rss_anon(), True
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self):
        while self.running:
            self.peak = max(self.peak, rss_anon())
            time.sleep(0.002)

    def __exit__(self, *exc):
        self.running = False
        self.thread.join()
        self.peak = max(self.peak, rss_anon())


def write_checkpoint(path: Path, hf: dict) -> int:
    """A random bf16 checkpoint of ``hf`` in ``path``, written one tensor at a time; returns its bytes."""
    import ml_dtypes

    from jaxpar.hf import decoder_config, tensor_maps, write_safetensors
    from jaxpar.hf._keys import stack_counts

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf))
    cfg = decoder_config(hf)
    maps, counts = tensor_maps(cfg, "llama"), stack_counts(cfg)
    entries = {k: (m.file, "BF16") for m in maps.values() for k in m.keys(counts)}
    rng = np.random.default_rng(0)
    tensors = ((rng.standard_normal(shape, np.float32) * 0.02).astype(ml_dtypes.bfloat16)
               for shape, _ in entries.values())
    write_safetensors(path / "model.safetensors", entries, tensors)
    return (path / "model.safetensors").stat().st_size


def measure(path: Path) -> dict:
    """Load onto fsdp=8 and export, in this (fresh) process."""
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    import optax

    import jaxpar
    from jaxpar.hf import export, open_checkpoint

    ckpt = open_checkpoint(path)
    mesh = jaxpar.make_mesh({"fsdp": 8})
    layout = jaxpar.state_layout(ckpt.model_fn(), optax.adamw(1e-4), mesh, jaxpar.Strategy(zero=3))
    jax.block_until_ready(jax.jit(lambda: 0)())       # the backend's own memory, before the baseline
    base = rss_anon()
    start = time.perf_counter()
    with Peak() as load:
        params = jax.block_until_ready(ckpt.load(mesh, layout.params))
    seconds, read = time.perf_counter() - start, ckpt.files.bytes_read
    leaves = jax.tree.leaves(params)
    resident = sum(x.nbytes for x in leaves)
    shard = max(s.data.nbytes for x in leaves for s in x.addressable_shards)
    tensor = max(int(np.prod(m.file)) * 4 for m in ckpt.maps.values())
    after = rss_anon()
    out = path.parent / (path.name + "-export")
    with Peak() as exp:
        export(params, out, source=ckpt, overwrite=True)
    same = ckpt.files.read("model.layers.3.mlp.up_proj.weight", ()).tobytes() == \
        open_checkpoint(out).files.read("model.layers.3.mlp.up_proj.weight", ()).tobytes()
    mb = 2 ** 20
    return {"parameters": sum(x.size for x in leaves), "bytes_read": read,
            "file_bytes": ckpt.files.path.joinpath("model.safetensors").stat().st_size,
            "load_seconds": seconds, "load_gb_per_s": read / seconds / 1e9,
            "resident_mb": resident / mb, "largest_shard_mb": shard / mb, "largest_tensor_mb": tensor / mb,
            "load_peak_above_resident_mb": (load.peak - base - resident) / mb,
            "load_bound_mb": (1.5 * shard) / mb + 100, "export_peak_above_loaded_mb": (exp.peak - after) / mb,
            "export_bound_mb": (2 * tensor) / mb + 100, "export_bytes_identical": same}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="/tmp/jaxpar-hf-bench")
    parser.add_argument("--json")
    parser.add_argument("--small", action="store_true", help="a ~20M-parameter model (a quick check)")
    parser.add_argument("--measure", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(Path(args.measure))))
        return
    path = Path(args.dir) / ("small" if args.small else "llama-1b")
    if not (path / "model.safetensors").is_file():
        write_checkpoint(path, SMALL if args.small else CONFIG)
    run = subprocess.run([sys.executable, __file__, "--measure", str(path)], capture_output=True, text=True,
                         check=True)
    result = json.loads(run.stdout.strip().splitlines()[-1])
    for k, v in result.items():
        print(f"{k:32s} {v:.3f}" if isinstance(v, float) else f"{k:32s} {v}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
