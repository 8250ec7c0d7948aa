"""Context parallelism's compiled memory against the cost model, deviceless: a Llama-3-8B-shaped Decoder
(configs/hf/llama3-8b/config.json's widths, ``configs/llama3_8b_gpu.yaml``: bf16 compute, fp32 parameters and
AdamW moments) with one sequence over ``context`` 8 (fsdp 1), compiled for ``h100:1x8`` on the CPU, per
context-parallel method, recomputation, number of layers, sequence length and ``model.loss_chunks`` (the loss in
pieces of the vocabulary; ``--methods none``: FSDP 8 without context parallelism, one sequence a device). Prints a
markdown table of the predicted and compiled temporaries and peak per device (what ``jaxpar inspect`` prints; on
GPUs the predicted temporaries are the predicted peak less the arguments), then the ``working`` bytes of
``jaxpar.cost._device_bytes.CONTEXT_KEEPS`` (and ``kept`` without recomputation) fitted to the programs of 8
and more layers with the whole loss, of every depth in pieces, as the table was measured (docs/planning.md §8).

    python benchmarks/context_memory.py [--methods ring,balanced,all_gather,ulysses] [--remat save-matmuls]
        [--layers 2,8,16] [--tokens 65536,131072] [--loss-chunks 1,8] [--json out.json] [--reuse out.json]

``--reuse`` reads the compiled figures of an earlier ``--json`` (compiling the cases it lacks) and predicts
again; a compile takes 10-60 seconds on a 2-core CPU. The table's pairs were fitted with ``--layers
2,4,6,8,12,16`` and with ``--methods ring,all_gather,ulysses --remat none,full --layers 2,4,8,12``
(docs/benchmarks.md §24).
"""
from __future__ import annotations

import argparse
import itertools
import json
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "llama3_8b_gpu.yaml"
SHAPE = ROOT / "configs" / "hf" / "llama3-8b" / "config.json"
#: The ``parallel.context`` setting of each method's name; ``none``: no context parallelism, the config's FSDP over
#: 8 devices and one sequence of ``tokens`` a device (the cost model's 16-bit table, not ``CONTEXT_KEEPS``).
METHODS = {"ring": "{method: ring}", "balanced": "{method: ring, balance: true}",
           "all_gather": "{method: all_gather}", "ulysses": "{method: ulysses}", "none": None}
#: ``kept`` bytes per token and unit of h counted in the compiled programs (the forward scan's stacked residuals),
#: by recomputation and method; without recomputation it is fitted with ``working``.
COUNTED = {"save-matmuls": {"ring": 21.0, "all_gather": 21.0, "ulysses": 26.0},
           "full": {"ring": 2.0, "all_gather": 2.0, "ulysses": 2.0}}
GIB = 2 ** 30


def overrides(folder: Path, method: str, remat: str, layers: int, tokens: int, chunks: int) -> list[str]:
    """The config's overrides of one case; writes its model's config.json into ``folder``."""
    shape = json.loads(SHAPE.read_text())
    (folder / "config.json").write_text(json.dumps({**shape, "num_hidden_layers": layers,
                                                    "max_position_embeddings": tokens}))
    layout = (["mesh.context=1", "mesh.fsdp=8", "data.batch_size=8"] if METHODS[method] is None else
              ["mesh.context=8", "mesh.fsdp=1", "data.batch_size=1", f"parallel.context={METHODS[method]}"])
    return [f"model.hf={folder}", f"model.seq_len={tokens}", *layout, f"model.remat={remat}",
            f"train.out_dir={folder}", f"model.loss_chunks={chunks}"]


def load(method: str, remat: str, layers: int, tokens: int, chunks: int, folder: Path):
    """The case's config and job on ``h100:1x8``'s devices."""
    from jaxpar.config import load_config
    from jaxpar.config._job import build_job
    from jaxpar.devices import parse_target, target_devices

    cfg = load_config(str(CONFIG), overrides(folder, method, remat, layers, tokens, chunks))
    return cfg, build_job(cfg, target_devices(parse_target("h100:1x8")), data=False)


def compiled_bytes(method: str, remat: str, layers: int, tokens: int, chunks: int) -> dict:
    """The compiled step's arguments, temporaries and peak per device (``memory_report``)."""
    from jaxpar.analysis import memory_report

    with tempfile.TemporaryDirectory() as tmp:
        _, job = load(method, remat, layers, tokens, chunks, Path(tmp))
        start = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            step = job.compile(job.state_layout())["step"]
        r = memory_report(step)
    return dict(method=method, remat=remat, layers=layers, tokens=tokens, loss_chunks=chunks, args=r.argument_bytes,
                temps=r.temp_bytes, peak=r.required_bytes, compile_s=round(time.perf_counter() - start, 1))


def cost_view(method: str, remat: str, layers: int, tokens: int, chunks: int):
    """The cost model's view of the case, as ``jaxpar inspect`` builds it."""
    from jaxpar.config._cost_model import config_view

    with tempfile.TemporaryDirectory() as tmp:
        cfg, job = load(method, remat, layers, tokens, chunks, Path(tmp))
        view, why = config_view(cfg, dict(job.mesh.shape), job.strategy, "h100", platform="cuda")
    if why is not None:
        raise SystemExit(f"not predicted: {why}")
    return view


def predicted_bytes(view) -> dict:
    """The cost model's arguments, temporaries and peak per device, as ``jaxpar inspect`` predicts them."""
    from jaxpar.plan._prediction import _predicted

    _, args, temps, peak = _predicted(view)
    return dict(p_args=args, p_temps=temps, p_peak=peak)


def temporaries_with(view, keeps: tuple[float, float]) -> float:
    """The cost model's temporaries of the case with ``keeps = (kept, working)`` in place of the table's (the
    working bytes of the loss in pieces too)."""
    from jaxpar.cost._device_bytes import context_temporaries

    model, plan = view.model, view.plan
    grads = sum(4 * leaf.size for leaf in model.leaves)
    rows = model.batch / (plan.data * plan.fsdp * plan.strategy.microbatches) / plan.context
    kept, working = keeps
    table = {plan.remat: (kept, working, working)}          # the same working bytes whole and in pieces
    return grads + sum(context_temporaries(model, plan, rows, grads, model.layers, table))


def fit_keeps(cases: list[tuple[dict, object]]) -> list[tuple]:
    """``(remat, method, pieces, kept, working, worst)``: the pair that brings the temporaries closest (the least
    largest ratio's distance from 1; where the working bytes never set the peak, the largest that keeps it), the
    balanced ring's with the ring's. The whole loss: the programs of 8 and more
    layers, ``kept`` as :data:`COUNTED` where counted; the loss in pieces (``pieces``): every depth, ``kept`` the
    table's."""
    from jaxpar.cost._device_bytes import CONTEXT_KEEPS

    out = []
    for remat, method, pieces in itertools.product(dict.fromkeys(r["remat"] for r, _ in cases),
                                                   ("ring", "all_gather", "ulysses"), (False, True)):
        fit = [(r, v) for r, v in cases if r["remat"] == remat and (r.get("loss_chunks", 1) > 1) == pieces
               and (pieces or r["layers"] >= 8)
               and r["method"] in ((method, "balanced") if method == "ring" else (method,))]
        if fit:
            counted = CONTEXT_KEEPS[method][remat][0] if pieces else COUNTED.get(remat, {}).get(method)
            kepts = [counted] if counted else [float(k) for k in range(20, 100)]
            worst, kept, working = min(     # of equal distances (to 0.1 %) the largest working: an upper bound
                (round(max(abs(temporaries_with(v, (k, w)) / r["temps"] - 1) for r, v in fit), 3), k, -float(w))
                for k in kepts for w in range(0, 160))
            out.append((remat, method, pieces, kept, -working, worst))
    return out


def fit_half_pieces(cases: list[tuple[dict, object]]) -> list[tuple]:
    """``(remat, "none", True, None, working, worst)``: the working bytes of ``HALF_PIECES`` that bring the
    temporaries of the programs without context parallelism whose loss runs in pieces closest (of equal distances,
    the largest)."""
    from jaxpar.cost._device_bytes import HALF_PIECES

    out = []
    for remat in dict.fromkeys(r["remat"] for r, _ in cases):
        fit = [(r, v) for r, v in cases
               if r["method"] == "none" and r["remat"] == remat and r.get("loss_chunks", 1) > 1]
        table, distances = dict(HALF_PIECES), []
        for w in range(0, 160) if fit else ():
            HALF_PIECES[remat] = float(w)
            distances.append((round(max(abs(predicted_bytes(v)["p_temps"] / r["temps"] - 1) for r, v in fit), 3), -w))
        HALF_PIECES.update(table)
        if distances:
            worst, working = min(distances)
            out.append((remat, "none", True, None, float(-working), worst))
    return out


def table(rows: list[dict]) -> str:
    """The markdown table of ``rows``."""
    lines = ["| method | recomputation | loss pieces | layers | tokens | temporaries GiB, predicted / compiled | "
             "ratio | peak GiB, predicted / compiled | ratio |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in sorted(rows, key=lambda r: (r["remat"], list(METHODS).index(r["method"]), r.get("loss_chunks", 1),
                                         r["tokens"], r["layers"])):
        lines.append(f"| {r['method']} | {r['remat']} | {r.get('loss_chunks', 1)} | {r['layers']} | {r['tokens']:,} | "
                     f"{r['p_temps'] / GIB:.2f} / {r['temps'] / GIB:.2f} | {r['p_temps'] / r['temps']:.3f} | "
                     f"{r['p_peak'] / GIB:.2f} / {r['peak'] / GIB:.2f} | {r['p_peak'] / r['peak']:.3f} |")
    return "\n".join(lines)


def fit_table(fits: list[tuple]) -> str:
    """The markdown table of :func:`fit_keeps`'s pairs."""
    lines = ["| recomputation | method | loss | kept | working | largest distance of the fitted programs |",
             "|---|---|---|---:|---:|---:|"]
    lines += [f"| {remat} | {method} | {'in pieces' if pieces else 'whole'} | {'-' if kept is None else f'{kept:.0f}'} "
              f"| {working:.0f} | {worst:.3f} |" for remat, method, pieces, kept, working, worst in fits]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--remat", default="save-matmuls", help="comma-separated: none, save-matmuls, full")
    parser.add_argument("--layers", default="2,8,16")
    parser.add_argument("--tokens", default="65536,131072")
    parser.add_argument("--loss-chunks", default="1", help="comma-separated: model.loss_chunks")
    parser.add_argument("--json", help="write the compiled and predicted rows here")
    parser.add_argument("--reuse", help="the rows of an earlier --json: compile only the cases it lacks")
    args = parser.parse_args()
    cases = [(m, r, int(n), int(s), int(c)) for r in args.remat.split(",") for m in args.methods.split(",")
             for s in args.tokens.split(",") for n in args.layers.split(",") for c in args.loss_chunks.split(",")]
    old = {(r["method"], r["remat"], r["layers"], r["tokens"], r.get("loss_chunks", 1)): r
           for r in json.loads(Path(args.reuse).read_text())} if args.reuse else {}
    rows, views = [], []
    for case in cases:
        got = old[case] if case in old else compiled_bytes(*case)
        views.append(cost_view(*case))
        rows.append({**got, **predicted_bytes(views[-1])})
        print(json.dumps(rows[-1]), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1))
    print(table(rows))
    print()
    cases = [(r, v) for r, v in zip(rows, views)]
    print(fit_table(fit_keeps(cases) + fit_half_pieces(cases)))


if __name__ == "__main__":
    main()
