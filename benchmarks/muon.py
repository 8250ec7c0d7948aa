"""Muon against AdamW on the CPU mesh (issue 57's benchmark): convergence, step time, compiled collectives.

1. Convergence: the quickstart (DP2 x FSDP2 x TP2, 300 steps, the same data, seed, warm-up and cosine
   schedule) with its AdamW (lr 3e-3, weight decay 0.1) and with ``optimizer.name: muon`` at
   ``optimizer.lr=0.02`` (Muon's usual lr; the matrices' decoupled weight decay is the quickstart's 0.1)
   with its AdamW half at the quickstart's AdamW settings (``adam_lr=3e-3``, ``adam_weight_decay=0.1``);
   nothing else tuned. Loss at steps 1/50/100/200/300, final train loss (mean of the last 10% of
   steps), eval loss.
2. Step time, Muon / AdamW, on the quickstart GPT (batch 32) for DP2 x FSDP2 x TP2, FSDP8 and one
   device (Newton-Schulz's compute alone, no collectives): both
   steps compiled in one process, then ``--reps`` rounds of ``--steps`` steps each, order alternating;
   the ratio is the median of the per-round ratios (as benchmarks/overhead.py measures).
3. The compiled collectives under FSDP8 (:func:`jaxpar.analysis.collectives`): of the whole train step,
   and of the optimizer update alone (``tx.update`` jitted on the layout's gradient, state and parameter
   shardings), Muon against AdamW: count and bytes (result bytes on one device) per kind.
4. Newton-Schulz placements (``muon(placement=...)``, docs/muon.md) under FSDP8 and DP2 x FSDP2 x TP2: the
   update alone's compiled collectives per placement (XLA's, ``gather``, ``owner``, ``local``) beside the
   cost model's bytes (:func:`jaxpar.cost.muon_update`) and the ``auto`` choice, then the step time of each
   placement against AdamW (all compiled in one process; ``--placement-reps`` rounds of ``--steps``
   steps, the order rotating; per placement the median of its per-round ratios to AdamW).

    .venv/bin/python benchmarks/muon.py [--skip-convergence] [--reps 20] [--json out.json]
    .venv/bin/python benchmarks/muon.py --placements-only [--placement-reps 10]
"""
from __future__ import annotations

import _common  # noqa: F401  (sets up 8 CPU devices first)

import argparse
import dataclasses
import functools
import math
import statistics
import time

import jax
import optax
from flax import nnx

import jaxpar
from jaxpar import cost
from jaxpar.adapters import abstract_model
from jaxpar.analysis import collectives, format_bytes, summarize
from jaxpar.models import GPT, lm_loss
from jaxpar.optimizers import muon, muon_placements, muon_routes
from jaxpar.rules import path_str

from _common import GPTConfig, convergence_rows, copy_state, environment, make_batch, markdown_table, write_json

MUON_LR, ADAM_LR, WD, B2 = 0.02, 3e-3, 0.1, 0.95
RUNS = {"AdamW": [],
        "Muon": ["optimizer.name=muon", f"optimizer.lr={MUON_LR}", f"optimizer.muon.adam_lr={ADAM_LR}",
                 f"optimizer.muon.adam_weight_decay={WD}"]}
#: The quickstart's GPT and global batch.
GPT_CFG, BATCH = GPTConfig(vocab=256, seq_len=64, embed=128, heads=4, layers=2), 32
LAYOUTS = {"DP2 x FSDP2 x TP2": {"data": 2, "fsdp": 2, "tensor": 2}, "FSDP8": {"fsdp": 8},
           "one device (no collectives)": {}}
KINDS = ("all-gather", "all-reduce", "reduce-scatter")
PLACEMENT_LAYOUTS = {"FSDP8": {"fsdp": 8}, "DP2 x FSDP2 x TP2": {"data": 2, "fsdp": 2, "tensor": 2}}
PLACEMENT_KINDS = ("all-gather", "all-reduce", "all-to-all")
#: ``None``: no mesh given, XLA partitions Newton-Schulz.
PLACEMENTS = {"XLA": None, "gather": "gather", "owner": "owner", "local": "local"}


def _model(cfg: GPTConfig = GPT_CFG):
    return GPT(cfg, rngs=nnx.Rngs(0))


def _muon(cfg: GPTConfig = GPT_CFG, **place) -> optax.GradientTransformation:
    logical = abstract_model(functools.partial(_model, cfg))[2]
    return optax.chain(optax.clip_by_global_norm(1.0), muon(MUON_LR, logical=logical, weight_decay=WD,
                                                            adam=dict(lr=ADAM_LR, b2=B2, weight_decay=WD), **place))


def optimizers() -> dict[str, optax.GradientTransformation]:
    """The two optimizers of the timing and the collectives (constant lr, clipped at 1 as the quickstart)."""
    return {"AdamW": optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(ADAM_LR, b2=B2, weight_decay=WD)),
            "Muon": _muon()}


def placed_optimizers(sizes: dict, cfg: GPTConfig) -> dict[str, optax.GradientTransformation]:
    """AdamW and Muon with each Newton-Schulz placement of :data:`PLACEMENTS` on a mesh of ``sizes``."""
    mesh = jaxpar.make_mesh(sizes, devices=jax.devices()[:math.prod(sizes.values())])
    model_fn = functools.partial(_model, cfg)
    specs = jaxpar.state_layout(model_fn, optax.identity(), mesh, jaxpar.Strategy()).opt_param_specs
    out = {"AdamW": optimizers()["AdamW"]}
    for name, p in PLACEMENTS.items():
        out[f"Muon {name}"] = _muon(cfg) if p is None else _muon(cfg, placement=p, mesh=mesh, specs=specs)
    return out


def convergence() -> list[list[str]]:
    """Table rows: loss at steps 1/50/100/200/300, final train, eval, and Muon / AdamW."""
    return convergence_rows(RUNS, "AdamW")


#: The Llama fixture's runs: the quickstart's data, mesh (tensor 1: its vocabulary, 131, is odd) and schedule,
#: from the fixture's random weights; AdamW at the quickstart's lr, Muon at 0.02 with its AdamW half at it.
LLAMA = ["mesh.tensor=1", "mesh.fsdp=4", "optimizer.lr=3e-3", "optimizer.weight_decay=0.1", "optimizer.warmup_steps=20",
         "optimizer.min_lr_ratio=0.1", "optimizer.clip_norm=1.0", "train.steps=300"]


def llama_convergence() -> list[list[str]]:
    """The Hugging Face Llama fixture (tests/hf_fixtures.py: 2 layers, embed 48, 6 heads / 2 KV heads, its
    byte-level BPE of 131 tokens) trained from its random weights on the quickstart's text: the same rows."""
    import sys
    import tempfile
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from hf_fixtures import build_checkpoint

    with tempfile.TemporaryDirectory() as d:
        path = build_checkpoint("llama", Path(d) / "llama")
        runs = {name: [f"model.hf={path}", *LLAMA, *o] for name, o in RUNS.items()}
        return convergence_rows(runs, "AdamW", config="hf_finetune.yaml")


def _built(sizes: dict, txs: dict, cfg: GPTConfig = GPT_CFG) -> tuple:
    """``(mesh, {name: (state, layout, step)})`` on a mesh of ``sizes``."""
    mesh = jaxpar.make_mesh(sizes, devices=jax.devices()[:math.prod(sizes.values())])
    built = {}
    for name, tx in txs.items():
        state, layout = jaxpar.init_train_state(functools.partial(_model, cfg), tx, mesh, jaxpar.Strategy())
        built[name] = (state, layout, jaxpar.make_train_step(lm_loss, tx, layout))
    return mesh, built


def step_times(sizes: dict, txs: dict, steps: int, reps: int, warmup: int, cfg: GPTConfig = GPT_CFG) -> dict:
    """Median step time of each optimizer and the median per-round ratio of each to AdamW (the first)."""
    mesh, built = _built(sizes, txs, cfg)
    batch = jaxpar.shard_batch(make_batch(GPT_CFG, BATCH), mesh)
    states = {n: copy_state(b[0]) for n, b in built.items()}
    for n, (_, _, step) in built.items():
        for _ in range(warmup):
            states[n], m = step(states[n], batch)
        jax.block_until_ready((states[n], m))
    names, samples = list(built), {n: [] for n in built}
    for r in range(reps):
        for n in names[r % len(names):] + names[:r % len(names)]:      # the order rotates round by round
            s, step = states[n], built[n][2]
            t0 = time.perf_counter()
            for _ in range(steps):
                s, m = step(s, batch)
            jax.block_until_ready((s, m))
            samples[n].append((time.perf_counter() - t0) / steps)
            states[n] = s
    out = {"median_s": {n: statistics.median(v) for n, v in samples.items()}, "samples_s": samples, "ratios": {}}
    for n in names[1:]:
        ratios = sorted(a / b for a, b in zip(samples[n], samples["AdamW"]))
        out["ratios"][n] = {"median": statistics.median(ratios),
                            "quartiles": (ratios[len(ratios) // 4], ratios[3 * len(ratios) // 4])}
    out["ratio"], out["quartiles"] = out["ratios"][names[1]]["median"], out["ratios"][names[1]]["quartiles"]
    return out


def _update_program(tx, state, layout):
    """``tx.update`` alone, compiled on the layout's gradient, optimizer-state and parameter shardings."""
    sh = lambda specs: jaxpar.named_shardings(specs, layout.mesh)   # noqa: E731
    fn = jax.jit(lambda g, s, p: tx.update(g, s, p), in_shardings=(sh(layout.grads), sh(layout.opt_state),
                                                                   sh(layout.params)))
    return fn.lower(state.params, state.opt_state, state.params).compile()


def _by_kind(colls) -> dict[str, dict]:
    out = {k: {"count": 0, "bytes": 0} for k in KINDS}
    for row in summarize(colls):
        if row["kind"] in out:
            out[row["kind"]]["count"] += row["count"]
            out[row["kind"]]["bytes"] += row["bytes"]
    return out


def compiled_collectives(txs: dict) -> dict:
    """FSDP8: ``{program: {optimizer: {kind: {count, bytes}}}}`` for the train step and the update alone."""
    mesh, built = _built(LAYOUTS["FSDP8"], txs)
    batch = jaxpar.shard_batch(make_batch(GPT_CFG, BATCH), mesh)
    out = {"train step": {}, "update alone": {}}
    for n, (state, layout, step) in built.items():
        out["train step"][n] = _by_kind(collectives(step.lower(state, batch).compile(), mesh))
        out["update alone"][n] = _by_kind(collectives(_update_program(txs[n], state, layout), mesh))
    return out


def placement_collectives(sizes: dict, cfg: GPTConfig) -> dict:
    """``{placement: {kind: {count, bytes}}, "predicted": {placement: bytes}, "auto": [choices]}``: the update
    alone of each placement on a mesh of ``sizes``, and the cost model's bytes and ``auto`` choice."""
    txs = placed_optimizers(sizes, cfg)
    mesh, built = _built(sizes, {n: tx for n, tx in txs.items() if n != "AdamW"}, cfg)
    out: dict = {"measured": {}, "predicted": {}}
    for n, (state, layout, _) in built.items():
        colls = collectives(_update_program(txs[n], state, layout), mesh)
        out["measured"][n] = {k: {"count": sum(r["count"] for r in summarize(colls) if r["kind"] == k),
                                  "bytes": sum(r["bytes"] for r in summarize(colls) if r["kind"] == k)}
                              for k in PLACEMENT_KINDS}
    model = cost.gpt(cfg.layers, cfg.embed, cfg.heads, cfg.seq_len, cfg.vocab, BATCH)
    for name, p in PLACEMENTS.items():
        if p is not None:
            out["predicted"][f"Muon {name}"] = cost.muon_update(model, sizes, "cpu_sim", placement=p).bytes
    layout = built["Muon owner"][1]
    out["auto"] = {k: v.kind for k, v in muon_placements(layout.shapes, layout.logical, mesh=mesh,
                                                         specs=layout.opt_param_specs,
                                                         chooser=cost.placement_chooser("cpu_sim")).items()}
    return out


def _placement_rows(name: str, colls: dict, times: dict | None) -> list[list[str]]:
    rows = []
    for n, per in colls["measured"].items():
        kinds = ", ".join(f"{v['count']} {k}" for k, v in per.items() if v["count"]) or "none"
        total = sum(v["bytes"] for v in per.values())
        pred = colls["predicted"].get(n)
        ratio = "-" if times is None else "{:.3f} ({:.3f} - {:.3f})".format(
            times["ratios"][n]["median"], *times["ratios"][n]["quartiles"])
        ms = "-" if times is None else f"{times['median_s'][n] * 1e3:.1f}"
        rows.append([name, n.replace("Muon ", ""), kinds, format_bytes(total),
                     "-" if pred is None else format_bytes(pred), ms, ratio])
    if times is not None:
        rows.append([name, "AdamW", "-", "-", "-", f"{times['median_s']['AdamW'] * 1e3:.1f}", "1"])
    return rows


def placements(steps: int, reps: int, warmup: int, layers: int = GPT_CFG.layers) -> dict:
    """Section 4: per layout, the placements' compiled collectives and (``reps`` > 0) step times, on the
    quickstart GPT with ``layers`` layers."""
    out, cfg = {}, dataclasses.replace(GPT_CFG, layers=layers)
    for name, sizes in PLACEMENT_LAYOUTS.items():
        out[name] = {"collectives": placement_collectives(sizes, cfg)}
        if reps:
            out[name]["step_time"] = step_times(sizes, placed_optimizers(sizes, cfg), steps, reps, warmup, cfg)
        print(f"{name}: auto chooses {out[name]['collectives']['auto']}", flush=True)
    headers = ["layout", "placement", "update's collectives", "bytes (compiled)", "bytes (cost model)",
               "step ms", "step / AdamW (median, quartiles)"]
    rows = [r for name, o in out.items() for r in _placement_rows(name, o["collectives"], o.get("step_time"))]
    print("\n" + markdown_table(headers, rows), flush=True)
    return out


def muon_matrix_bytes() -> tuple[int, int]:
    """``(matrices, bytes)``: the Muon-routed parameters and their full fp32 size (what gathering each
    momentum once costs on one device)."""
    shapes, logical = abstract_model(_model)[1:3]
    routes = muon_routes(shapes, logical)
    flat = {path_str(p): a for p, a in jax.tree_util.tree_flatten_with_path(shapes)[0]}
    on = [flat[k] for k, r in routes.items() if r.rule == "muon"]
    return len(on), sum(a.size * a.dtype.itemsize for a in on)


def _collective_rows(colls: dict) -> list[list[str]]:
    rows = []
    for program, per in colls.items():
        for kind in KINDS:
            a, m = per["AdamW"][kind], per["Muon"][kind]
            rows.append([program, kind, str(a["count"]), format_bytes(a["bytes"]), str(m["count"]),
                         format_bytes(m["bytes"]), format_bytes(m["bytes"] - a["bytes"])])
    return rows


def _convergence_table(rows: list[list[str]]) -> str:
    return markdown_table(["optimizer", "step 1", "50", "100", "200", "300", "final train", "eval", "train / AdamW",
                           "eval / AdamW"], rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--skip-convergence", action="store_true")
    parser.add_argument("--steps", type=int, default=2, help="steps per timed block")
    parser.add_argument("--reps", type=int, default=20, help="alternating rounds")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--json", default=None)
    parser.add_argument("--placements-only", action="store_true", help="section 4 only")
    parser.add_argument("--llama", action="store_true", help="the Llama fixture's convergence only")
    parser.add_argument("--placement-reps", type=int, default=10, help="rounds of section 4's timing (0: none)")
    parser.add_argument("--placement-layers", type=int, default=GPT_CFG.layers, help="section 4's GPT layers")
    args = parser.parse_args()
    env = environment()
    print(f"# {env['date']}, commit {env['git']}, {env['devices']}, jax {env['jax']}, {env['nproc']} cores", flush=True)
    out: dict = {"environment": env, "config": vars(args)}
    if args.llama:
        out["llama_convergence"] = llama_convergence()
        print(_convergence_table(out["llama_convergence"]), flush=True)
        write_json(args.json, out)
        return
    if args.placements_only:
        out["placements"] = placements(args.steps, args.placement_reps, args.warmup, args.placement_layers)
        write_json(args.json, out)
        return
    if not args.skip_convergence:
        out["convergence"] = convergence()
        print(_convergence_table(out["convergence"]), flush=True)
    if not args.skip_convergence:
        out["llama_convergence"] = llama_convergence()
        print("\nThe Hugging Face Llama fixture:\n" + _convergence_table(out["llama_convergence"]), flush=True)
    txs = optimizers()
    out["step_time"] = {name: step_times(sizes, txs, args.steps, args.reps, args.warmup)
                        for name, sizes in LAYOUTS.items()}
    print("\n" + markdown_table(["layout", "AdamW ms", "Muon ms", "Muon / AdamW (median of paired rounds)",
                                 "quartiles of the rounds' ratios"],
                                [[name, f"{r['median_s']['AdamW'] * 1e3:.2f}", f"{r['median_s']['Muon'] * 1e3:.2f}",
                                  f"{r['ratio']:.3f}", "{:.3f} - {:.3f}".format(*r["quartiles"])]
                                 for name, r in out["step_time"].items()]), flush=True)
    out["collectives"] = compiled_collectives(txs)
    n, size = muon_matrix_bytes()
    print("\nFSDP8, collectives per device (result bytes):")
    print(markdown_table(["program", "kind", "AdamW count", "AdamW bytes", "Muon count", "Muon bytes",
                          "Muon - AdamW bytes"], _collective_rows(out["collectives"])))
    print(f"\nMuon-routed parameters: {n}, full fp32 size {format_bytes(size)} (one gather of each momentum)")
    out["muon_matrices"] = {"count": n, "bytes": size}
    out["placements"] = placements(args.steps, args.placement_reps, args.warmup, args.placement_layers)
    write_json(args.json, out)


if __name__ == "__main__":
    main()
