"""Calibrate the cost model on this machine's simulated CPU mesh (``jaxpar calibrate``, which measures and
writes ``configs/clusters/cpu_sim.yaml``: :mod:`jaxpar.devices._calibrate`), then rank strategies with it.

The calibrated preset predicts the step time of the 11 strategies of ``benchmarks/overhead.py`` (GPT 4
layers, embed 128, 8 heads, seq 64, vocab 256, batch 16, fp32, ``lowering='xla-cpu'``) and the predicted
order is compared with the measured one (Spearman's rho). Measured times: ``--overhead-json`` (what
``benchmarks/overhead.py --json`` writes), else the ``jaxpar ms`` column of the table in
docs/benchmarks.md §1, read from the file (:func:`doc_measured_step_times`, with the section's date,
commit and machine). Without measuring, :func:`doc_spearman` gives the figure that README.md,
docs/benchmarks.md §7 and docs/planning.md §6 quote (``tests/test_docs_figures.py`` checks that they do).

Usage::

    python benchmarks/calibrate.py [--reps 9] [--write configs/clusters/cpu_sim.yaml] [--json out.json]
                                   [--overhead-json overhead.json]
    python benchmarks/calibrate.py --predict-only [--preset configs/clusters/cpu_sim.yaml]
                                   [--overhead-json overhead.json] [--json out.json]   # measures nothing
"""
from __future__ import annotations

import _common  # noqa: F401  (sets up 8 CPU devices first)

import argparse
import time
from pathlib import Path

from _common import environment, write_json

ROOT = Path(__file__).resolve().parents[1]

#: The measured step times used when no --overhead-json is given: the "jaxpar ms" column of the table
#: in this section of docs/benchmarks.md (read from the file, never copied here).
DOC = ROOT / "docs" / "benchmarks.md"
DOC_SECTION = "1"
DOC_COLUMN = "jaxpar ms"
DEFAULT_PRESET = ROOT / "configs" / "clusters" / "cpu_sim.yaml"


# ----------------------------------------------------------------------------- ranking
def spearman(a, b) -> float:
    from scipy.stats import spearmanr

    return float(spearmanr(a, b).statistic)


# ----------------------------------------------------------------------------- ranking
def predicted_step_times(cluster) -> dict[str, dict]:
    from jaxpar import Strategy, cost
    from jaxpar.cost import evaluate

    from _common import STRATEGIES

    model = cost.gpt(layers=4, hidden=128, heads=8, seq=64, vocab=256, batch=16)
    out = {}
    for bs in STRATEGIES:
        plan = cost.Plan(**bs.mesh, strategy=Strategy(zero=bs.zero, sequence_parallel=bs.sequence_parallel))
        c = cluster.with_devices(plan.devices)
        e = evaluate(model, plan, c, dtype="float32", precision="fp32", lowering="xla-cpu")
        t = e.time
        out[bs.name] = {"step_s": t.total, "compute_s": t.compute, "data_s": t.data, "tensor_s": t.tensor,
                        "optimizer_s": t.optimizer, "elementwise_s": t.elementwise}
    return out


def doc_section(text: str, number: str) -> str:
    """The text of section ``## <number>.`` of a markdown file, up to the next ``## `` heading."""
    import re

    m = re.search(rf"^## {re.escape(number)}\. .*?$(.*?)(?=^## |\Z)", text, re.M | re.S)
    if m is None:
        raise ValueError(f"no section '## {number}.' in the document")
    return m.group(0)


def section_provenance(section: str) -> dict[str, str]:
    """The date, commit and machine a results section states in its first paragraph (the command line)."""
    import re

    head = " ".join((section.split("\n\n")[1] if "\n\n" in section else section).split())
    date = re.search(r"\d{4}-\d{2}-\d{2}(?: (?:about )?\d{2}:\d{2}(?:[–-]\d{2}:\d{2})?(?: UTC)?)?", head)
    commit = re.search(r"commit `([0-9a-f]{7,40})`", head)
    machine = re.search(r"the 2-core machine[^,.:;]*", head)
    if not (date and commit and machine):
        raise ValueError(f"the section does not state its date, commit and machine: {head[:200]!r}")
    return {"date": date.group(0), "commit": commit.group(1), "machine": machine.group(0)}


def markdown_table(section: str, column: str) -> list[dict[str, str]]:
    """The rows of the first table in ``section`` that has a column headed ``column``, as dicts."""
    lines = section.splitlines()
    for i, line in enumerate(lines):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and column in cells:
            rows = []
            for row in lines[i + 2:]:
                if not row.startswith("|"):
                    break
                rows.append(dict(zip(cells, (c.strip().strip("*") for c in row.strip().strip("|").split("|")))))
            return rows
    raise ValueError(f"no table with a column {column!r}")


def doc_measured_step_times(path: str | Path = DOC, section: str = DOC_SECTION,
                            column: str = DOC_COLUMN) -> tuple[dict[str, float], str]:
    """``{strategy: ms}`` from the ``column`` of the table in ``section`` of docs/benchmarks.md, and a
    description of the source (the section's date, commit and machine)."""
    sec = doc_section(Path(path).read_text(), section)
    rows = markdown_table(sec, column)
    prov = section_provenance(sec)
    times = {r["strategy"]: float(r[column]) for r in rows}
    return times, (f"docs/benchmarks.md §{section} ({prov['date']}, commit {prov['commit']}, {prov['machine']}), "
                   f"{column} column")


def measured_step_times(path: str | None) -> tuple[dict[str, float], str]:
    if path:
        import json

        data = json.loads(Path(path).read_text())
        return ({r["name"]: r["median_s"]["jaxpar"] * 1e3 for r in data["results"]},
                f"{path} ({data['env'].get('date', '?')}, commit {data['env'].get('git', '?')})")
    return doc_measured_step_times()


def rank_correlations(pred: dict, measured: dict) -> tuple[float, float]:
    """Spearman's rho of the predicted step times against the measured ones, and the same without the
    cost model's elementwise term (the predicted total minus ``elementwise_s``)."""
    names = [n for n in pred if n in measured]
    m = [measured[n] for n in names]
    return (spearman([pred[n]["step_s"] for n in names], m),
            spearman([pred[n]["step_s"] - pred[n]["elementwise_s"] for n in names], m))


def load_preset(preset: str | Path = DEFAULT_PRESET):
    from jaxpar import cost

    return cost._cluster.cluster_from_dict(__import__("yaml").safe_load(Path(preset).read_text()), "cpu_sim")


def doc_spearman(preset: str | Path = DEFAULT_PRESET, doc: str | Path = DOC) -> tuple[float, float, str]:
    """Spearman's rho of the ranking that README.md quotes: ``preset``'s predictions against the measured
    step times of docs/benchmarks.md §1; also without the elementwise term, and the source. Measures
    nothing (a few seconds)."""
    measured, source = doc_measured_step_times(doc)
    rho, rho_no_elementwise = rank_correlations(predicted_step_times(load_preset(preset)), measured)
    return rho, rho_no_elementwise, source


# ----------------------------------------------------------------------------- preset
def ranking(cluster, overhead_json: str | None) -> tuple[dict, dict, str, float]:
    """Predict the 11 strategies on ``cluster``, compare with the measured order, print the table."""
    pred = predicted_step_times(cluster)
    measured, source = measured_step_times(overhead_json)
    names = [n for n in pred if n in measured]
    rho, rho_no_elementwise = rank_correlations(pred, measured)
    print(f"\nranking of the {len(names)} strategies (measured: {source}):")
    order_m = sorted(names, key=lambda n: measured[n])
    order_p = sorted(names, key=lambda n: pred[n]["step_s"])
    print(f"  {'strategy':>16}  {'measured ms':>11}  {'rank':>4}  {'predicted ms':>12}  {'rank':>4}  "
          f"{'compute':>8}  {'elementw':>8}  {'data':>7}  {'tensor':>7}  {'update':>7}")
    for n in names:
        q = pred[n]
        print(f"  {n:>16}  {measured[n]:11.2f}  {order_m.index(n) + 1:4d}  {q['step_s'] * 1e3:12.2f}  "
              f"{order_p.index(n) + 1:4d}  {q['compute_s'] * 1e3:8.2f}  {q['elementwise_s'] * 1e3:8.2f}  "
              f"{q['data_s'] * 1e3:7.2f}  {q['tensor_s'] * 1e3:7.2f}  {q['optimizer_s'] * 1e3:7.2f}")
    print(f"  Spearman rho = {rho:.3f} (without the elementwise term: {rho_no_elementwise:.3f})")
    return pred, measured, source, rho


def predict_only(preset: str, overhead_json: str | None, json_out: str | None) -> int:
    """The ranking alone, from a preset already written (nothing is measured)."""
    pred, measured, source, rho = ranking(load_preset(preset), overhead_json)
    write_json(json_out, {"env": environment(), "preset": preset, "predicted": pred, "measured_ms": measured,
                          "measured_source": source, "spearman": rho})
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=9, help="interleaved rounds per program pair")
    p.add_argument("--write", default=str(DEFAULT_PRESET),
                   help="preset to write ('' to skip)")
    p.add_argument("--json", help="write measurements and fits here")
    p.add_argument("--overhead-json", help="benchmarks/overhead.py --json output (default: docs/benchmarks.md §1)")
    p.add_argument("--predict-only", action="store_true",
                   help="measure nothing: rank the strategies with --preset against --overhead-json")
    p.add_argument("--preset", default=str(DEFAULT_PRESET),
                   help="the preset --predict-only reads")
    args = p.parse_args(argv)
    if args.predict_only:
        return predict_only(args.preset, args.overhead_json, args.json)

    from jaxpar import cost, devices

    t_all = time.perf_counter()
    result = devices.calibrate(args.write or None, reps=args.reps)
    cluster = cost.cluster_from_dict(__import__("yaml").safe_load(result["yaml"]), "cpu_sim")
    pred, measured, source, rho = ranking(cluster, args.overhead_json)
    print(f"\ntotal wall time {time.perf_counter() - t_all:.0f} s")
    write_json(args.json, {**{k: v for k, v in result.items() if k != "yaml"}, "predicted": pred,
                            "measured_ms": measured, "measured_source": source, "spearman": rho})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
