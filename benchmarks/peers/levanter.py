"""jaxpar against Levanter, side by side: the same Llama, the same weights, the same batch and AdamW.

Two long-lived workers, one per venv, are driven in alternation over pipes:
``_levanter_worker.py`` in Levanter's own venv (``benchmarks/peers/.venv-levanter``, pinned in
``requirements-levanter.txt``; ``make peers`` creates it) and ``_jaxpar_worker.py`` in this one. Each
holds 8 simulated CPU devices. Levanter's worker builds ``LlamaConfig(...).build`` and writes its
initial weights as a Hugging Face checkpoint; jaxpar's worker loads that checkpoint into a
:class:`jaxpar.models.Decoder` (``jaxpar.hf.train_state``), so both train the same weights on the same
tokens (Levanter's causal example: the last position masked) with ``optax.adamw``. Levanter runs its
own train step (``Trainer._jit_train_step_fn_no_hook``) under its own ``MeshConfig`` axis mappings.

Per layout (DP8, FSDP8, FSDP4xTP2, each in both frameworks' axis names):

* correctness: parameter count, the compiler's FLOPs per device, the losses of the first steps;
* step time: ``--rounds`` rounds, each runs ``--steps`` steps on one worker then the other (the
  order alternates); the ratio jaxpar / Levanter is the median of the per-round ratios;
* collective bytes per step per mesh axis: each compiled program's HLO text read by
  ``jaxpar.analysis`` (the same parser for both; loops counted by trip count), axes named by role
  (DP, FSDP, TP);
* peak memory per device: ``compiled.memory_analysis()`` (``jaxpar.analysis.MemoryReport``);
* with ``--target h100:1x8``: the same steps compiled deviceless for the target, bytes and memory.

``--levanter-mapping '{"kv_head": "model"}'`` adds logical-to-mesh rules to Levanter's defaults
(``MeshConfig.shared_mapping``), ``--jaxpar-rules '[["vocab", null]]'`` to jaxpar's
(``Strategy.extra_rules``); ``jaxpar_ab.py`` runs jaxpar against itself in the same harness (the
noise floor, a rule's worth). Results and rationale: docs/benchmarks.md.

Usage::

    make peers     # once: Levanter's venv
    .venv/bin/python benchmarks/peers/levanter.py --rounds 40 --steps 3 [--target h100:1x8] [--json out.json]
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
import _common  # noqa: E402,F401  (8 CPU devices first)

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

from jaxpar.analysis import MemoryReport, collectives, format_bytes, trip_counts  # noqa: E402
from jaxpar.devices import gpu_target_config, parse_target, targets_dir  # noqa: E402

from _common import environment, markdown_table, write_json  # noqa: E402

VENV = os.path.join(HERE, ".venv-levanter")
LEVANTER_PYTHON = os.path.join(VENV, "bin", "python")
#: layout: (jaxpar's mesh axes, Levanter's MeshConfig axes)
LAYOUTS = {
    "DP8": ({"data": 8}, {"data": 1, "replica": 8, "model": 1}),
    "FSDP8": ({"fsdp": 8}, {"data": 8, "replica": 1, "model": 1}),
    "FSDP4xTP2": ({"fsdp": 4, "tensor": 2}, {"data": 4, "replica": 1, "model": 2}),
}
#: each framework's mesh axis by role
ROLES = {"jaxpar": {"data": "DP", "fsdp": "FSDP", "tensor": "TP"},
         "levanter": {"replica": "DP", "replica_dcn": "DP", "data": "FSDP", "model": "TP"}}
ROLE_ORDER = ("DP", "FSDP", "TP")


class WorkerError(RuntimeError):
    """A worker's command failed; the message carries its traceback."""


class Worker:
    """A worker subprocess answering one JSON command per line (``_worker_protocol.serve``)."""

    def __init__(self, name: str, argv: list[str], log: str):
        self.name, self.log = name, log
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(log, "w"),
                                     text=True, bufsize=1, cwd=HERE)

    def __call__(self, cmd: str, **kwargs):
        self.proc.stdin.write(json.dumps({"cmd": cmd, **kwargs}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise WorkerError(f"{self.name} worker exited during {cmd!r}; its log {self.log} ends:\n"
                              + "".join(open(self.log).readlines()[-30:]))
        out = json.loads(line)
        if "error" in out:
            raise WorkerError(f"{self.name} worker failed in {cmd!r}:\n{out['error']}")
        return out["ok"]

    def close(self):
        try:
            self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()


def check_venv() -> None:
    """Stop with how to create Levanter's venv when it is missing."""
    if not os.path.exists(LEVANTER_PYTHON):
        raise SystemExit(f"Levanter's venv is missing: {VENV} has no bin/python. Create it with `make peers` "
                         f"(python3.11 -m venv {VENV} && {VENV}/bin/pip install -r "
                         f"{os.path.join(HERE, 'requirements-levanter.txt')}).")


def analysis_mesh(shape: dict[str, int]) -> Mesh:
    """A mesh of ``shape`` over this process's CPU devices: HLO text's partition ``i`` is its flat position ``i``."""
    return Mesh(np.array(jax.devices()[: int(np.prod(list(shape.values())))]).reshape(tuple(shape.values())),
                tuple(shape))


def bytes_by_role(hlo_path: str, shape: dict[str, int], framework: str) -> dict:
    """Collective bytes per step by role axis and by (kind, role axis), loops counted by trip count
    (the sum of ``jaxpar.analysis._axis_bytes.compiled_bytes_per_axis``), and counts per step."""
    text = open(hlo_path).read()
    mesh = analysis_mesh(shape)
    runs = trip_counts(text)
    roles, kinds, counts = {}, {}, {}
    for c in collectives(text, mesh):
        times = runs.get(c.computation, 1)
        for ax in ("?",) if c.axes is None else c.axes:     # "?": groups that are no set of mesh axes
            if ax != "?" and shape[ax] == 1:
                continue
            role = ROLES[framework].get(ax, "?")
            roles[role] = roles.get(role, 0.0) + c.bytes * times
            key = f"{c.kind} {role}"
            kinds[key] = kinds.get(key, 0.0) + c.bytes * times
            counts[key] = counts.get(key, 0.0) + times
    return {"bytes": roles, "by_kind": kinds, "counts": counts}


def peak(memory: dict) -> int:
    return MemoryReport(**memory).required_bytes


def alternate(workers: dict[str, Worker], rounds: int, steps: int) -> dict[str, list[float]]:
    """``rounds`` rounds of ``steps`` steps on each worker, the order alternating: seconds per step."""
    samples = {name: [] for name in workers}
    names = list(workers)
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            samples[name].append(workers[name]("run", steps=steps))
    return samples


def bench_layout(name: str, workers: dict[str, Worker], ckpt: str, out: str, args) -> dict:
    jax_axes, lev_axes = LAYOUTS[name]
    res = {"layout": name}
    hlo = {f: os.path.join(out, f"{name}.{f}.hlo.txt") for f in workers}
    res["levanter"] = workers["levanter"]("setup", axes=lev_axes, hlo=hlo["levanter"], warmup=args.warmup,
                                          shared_mapping=args.levanter_mapping)
    res["jaxpar"] = workers["jaxpar"]("setup", axes=jax_axes, hlo=hlo["jaxpar"], warmup=args.warmup, checkpoint=ckpt,
                                      remat=args.remat, rules=args.jaxpar_rules)
    for f in workers:
        res[f].update(bytes_by_role(hlo[f], res[f]["mesh"], f))
        res[f]["peak"] = peak(res[f]["memory"])
        if "?" in res[f]["bytes"]:
            print(f"warning: {name}: {f}'s program has collectives over no set of mesh axes "
                  f"({res[f]['bytes']['?']:.0f} B per step; kinds {res[f]['by_kind']})", flush=True)
    samples = alternate(workers, args.rounds, args.steps)
    res["samples"] = samples
    res["median_s"] = {f: statistics.median(s) for f, s in samples.items()}
    ratios = sorted(j / lv for j, lv in zip(samples["jaxpar"], samples["levanter"]))
    res["ratio"] = statistics.median(ratios)
    res["ratio_iqr"] = (ratios[len(ratios) // 4], ratios[(3 * len(ratios)) // 4])
    return res


def target_layout(name: str, workers: dict[str, Worker], ckpt: str, out: str, args) -> dict:
    jax_axes, lev_axes = LAYOUTS[name]
    t = parse_target(args.target)
    hosts, per_host = t.shape
    hlo = {f: os.path.join(out, f"{name}.{f}.{args.target.replace(':', '_')}.hlo.txt") for f in workers}
    res = {"layout": name, "target": args.target}
    res["levanter"] = workers["levanter"]("target", axes=lev_axes, hlo=hlo["levanter"], targets_dir=str(targets_dir()),
                                          name=t.spec.name, target_config=gpu_target_config(t.spec), hosts=hosts,
                                          per_host=per_host, shared_mapping=args.levanter_mapping)
    res["jaxpar"] = workers["jaxpar"]("target", axes=jax_axes, hlo=hlo["jaxpar"], target=args.target, checkpoint=ckpt,
                                      remat=args.remat, rules=args.jaxpar_rules)
    for f in workers:
        res[f].update(bytes_by_role(hlo[f], res[f]["mesh"], f))
        res[f]["peak"] = peak(res[f]["memory"])
    return res


def _bytes_cells(r: dict) -> list[str]:
    cells = []
    for role in ROLE_ORDER:
        j, lv = r["jaxpar"]["bytes"].get(role, 0.0), r["levanter"]["bytes"].get(role, 0.0)
        if not j and not lv:
            cells.append("-")
        else:
            ratio = f" ({j / lv:.2f}x)" if lv else ""
            cells.append(f"{format_bytes(j)} / {format_bytes(lv)}{ratio}")
    return cells


def _ratio(j: dict, lv: dict, key: str) -> str:
    return f"{j[key] / lv[key]:.3f}" if j.get(key) and lv.get(key) else "-"


def print_tables(results: list[dict], targets: list[dict]) -> None:
    rows = []
    for r in results:
        j, lv = r["jaxpar"], r["levanter"]
        rows.append([r["layout"], f"{r['median_s']['levanter'] * 1e3:.1f}", f"{r['median_s']['jaxpar'] * 1e3:.1f}",
                     f"**{r['ratio']:.3f}** ({r['ratio_iqr'][0]:.2f}-{r['ratio_iqr'][1]:.2f})", *_bytes_cells(r), f"{format_bytes(j['peak'])} / {format_bytes(lv['peak'])}",
                     f"{j['params']:,} / {lv['params']:,}", _ratio(j, lv, "flops"), _ratio(j, lv, "bytes_accessed"),
                     f"{j['losses'][0]:.5f} / {lv['losses'][0]:.5f}", f"{j['losses'][-1]:.5f} / {lv['losses'][-1]:.5f}"])
    print(markdown_table(["layout", "Levanter ms", "jaxpar ms", "jaxpar / Levanter (IQR)", "DP bytes (jaxpar / Levanter)",
                          "FSDP bytes", "TP bytes", "peak / device", "params", "FLOPs jaxpar / Levanter",
                          "bytes accessed jaxpar / Levanter",
                          "loss step 1", "loss last warm-up step"], rows))
    print()
    for r in results + targets:
        where = r.get("target", "cpu")
        keys = sorted(set(r["jaxpar"]["by_kind"]) | set(r["levanter"]["by_kind"]))
        detail = [[k, f"{r['jaxpar']['counts'].get(k, 0):g}", format_bytes(r["jaxpar"]["by_kind"].get(k, 0.0)),
                   f"{r['levanter']['counts'].get(k, 0):g}", format_bytes(r["levanter"]["by_kind"].get(k, 0.0))]
                  for k in keys]
        print(f"{r['layout']} on {where}: collectives per step")
        print(markdown_table(["kind axis", "jaxpar count", "jaxpar bytes", "Levanter count", "Levanter bytes"], detail))
        print()
    if targets:
        rows = [[r["layout"], *_bytes_cells(r), f"{format_bytes(r['jaxpar']['peak'])} / "
                 f"{format_bytes(r['levanter']['peak'])}", f"{r['jaxpar']['compile_s']:.1f} / "
                 f"{r['levanter']['compile_s']:.1f}"] for r in targets]
        print(f"deviceless {targets[0]['target']}:")
        print(markdown_table(["layout", "DP bytes (jaxpar / Levanter)", "FSDP bytes", "TP bytes", "peak / device",
                              "compile s"], rows))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated, of " + ", ".join(LAYOUTS))
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--steps", type=int, default=3, help="steps per timed block")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps after compiling (their losses are compared)")
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--embed", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--mlp", type=int, default=384)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--remat", choices=("none", "full"), default="none",
                   help="both: jaxpar's DecoderConfig.remat, Levanter's gradient_checkpointing")
    p.add_argument("--attention", default="vanilla",
                   help="Levanter's attn_backend (vanilla: plain softmax attention, as jaxpar's; default: Levanter's "
                        "choice for the platform, JAX_FLASH on CPU)")
    p.add_argument("--levanter-mapping", type=json.loads, default=None,
                   help='Levanter MeshConfig.shared_mapping besides its defaults, JSON, e.g. '
                        '\'{"kv_head": "model", "vocab": "model"}\' (default: none, Levanter\'s own mapping)')
    p.add_argument("--jaxpar-rules", type=json.loads, default=None,
                   help='jaxpar Strategy.extra_rules, JSON pairs, e.g. \'[["vocab", null]]\' (default: none)')
    p.add_argument("--target", default="", help="also compile deviceless for this target, e.g. h100:1x8")
    p.add_argument("--keep", default="", help="keep the checkpoint, HLO files and worker logs in this folder")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    check_venv()
    unknown = [x for x in args.layouts.split(",") if x not in LAYOUTS]
    if unknown:
        raise SystemExit(f"--layouts: unknown {unknown}; choose from {list(LAYOUTS)}")

    out = args.keep or tempfile.mkdtemp(prefix="peer-levanter-")
    os.makedirs(out, exist_ok=True)
    model = dict(vocab=args.vocab, embed=args.embed, layers=args.layers, heads=args.heads, kv_heads=args.kv_heads,
                 head_dim=args.embed // args.heads, mlp=args.mlp, norm_eps=1e-5, remat=args.remat == "full")
    tokens = os.path.join(out, "tokens.npy")
    np.save(tokens, np.random.default_rng(0).integers(0, args.vocab, (args.batch, args.seq), dtype=np.int32))
    env = environment()
    env["loadavg_start"] = os.getloadavg()
    workers = {"levanter": Worker("levanter", [LEVANTER_PYTHON, "-P", os.path.join(HERE, "_levanter_worker.py")],
                                  os.path.join(out, "levanter.log")),
               "jaxpar": Worker("jaxpar", [sys.executable, "-P", os.path.join(HERE, "_jaxpar_worker.py")],
                                os.path.join(out, "jaxpar.log"))}
    results, targets = [], []
    try:
        common = dict(model=model, batch=args.batch, seq=args.seq, tokens=tokens, lr=1e-3, weight_decay=1e-4, seed=0,
                      attention=args.attention)
        versions = {f: w("init", **common)["versions"] for f, w in workers.items()}
        ckpt = os.path.join(out, "levanter-init")
        exported = workers["levanter"]("export", path=ckpt)
        print(f"# jaxpar @ {env['git']} vs Levanter {versions['levanter']['marin-levanter']} "
              f"({env['devices']}, nproc={env['nproc']}); Llama {model}, batch {args.batch} x seq {args.seq}; "
              f"{args.rounds} rounds x {args.steps} steps; Levanter mapping extra {args.levanter_mapping}; jaxpar rules extra {args.jaxpar_rules}; exported {exported['params']:,} parameters", flush=True)
        for name in args.layouts.split(","):
            t0 = time.perf_counter()
            r = bench_layout(name, workers, ckpt, out, args)
            results.append(r)
            print(f"{name}: Levanter {r['median_s']['levanter'] * 1e3:.1f} ms, jaxpar {r['median_s']['jaxpar'] * 1e3:.1f}"
                  f" ms, ratio {r['ratio']:.3f}; losses jaxpar {r['jaxpar']['losses']} Levanter "
                  f"{r['levanter']['losses']} [{time.perf_counter() - t0:.0f} s]", flush=True)
        if args.target:
            for name in args.layouts.split(","):
                targets.append(target_layout(name, workers, ckpt, out, args))
    finally:
        for w in workers.values():
            w.close()
    env["loadavg_end"] = os.getloadavg()
    print(f"\nload average at start {env['loadavg_start']}, at end {env['loadavg_end']}")
    print_tables(results, targets)
    print(f"\nfiles in {out}")
    write_json(args.json, {"env": env, "versions": versions, "config": vars(args), "model": model,
                           "results": results, "targets": targets})
    return 0


if __name__ == "__main__":
    sys.exit(main())
