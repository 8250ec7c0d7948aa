"""Where the tests' time goes: reads the JSON lines that ``JAXPAR_TEST_REPORT=DIR pytest ...`` writes
(one per test: wall time, compiles, persistent-cache hits and misses, backend compile and trace seconds;
see tests/conftest.py) and prints the tiers' worker-seconds, the files and the top tests by cost.

    JAXPAR_TEST_REPORT=/tmp/cost .venv/bin/python -m pytest -n auto --maxprocesses=4 --dist loadfile -m ""
    .venv/bin/python tests/tools/cost_report.py /tmp/cost [MORE ...] --top 30
"""
from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import sys
import zlib


def load(folder: str) -> list[dict]:
    """Every record of ``folder/*.jsonl``, each with its ``tier``."""
    records = [json.loads(line) for path in sorted(glob.glob(os.path.join(folder, "*.jsonl"))) for line in open(path)]
    for r in records:
        r.setdefault("tier", "slow" if r.pop("slow", False) else "fast")
    return records


def by_key(records: list[dict], key) -> dict:
    """Sums per ``key(record)``: tests, wall seconds, compiles, cache misses, compile seconds."""
    out = collections.defaultdict(lambda: collections.Counter())
    for r in records:
        c = out[key(r)]
        c["tests"] += 1
        for field in ("wall_s", "compiles", "cache_misses", "compile_s"):
            c[field] += r.get(field, 0)
    return out


def _row(name: str, c) -> str:
    return (f"| {name} | {c['tests']} | {c['wall_s']:.1f} | {c['compiles']} | {c['cache_misses']} "
            f"| {c['compile_s']:.1f} |")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folders", nargs="+")
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--files", type=int, default=30)
    args = p.parse_args(argv)
    records = [r for folder in args.folders for r in load(folder)]
    head = "| {} | tests | wall s | compiles | cache misses | compile s |\n|---|---:|---:|---:|---:|---:|"
    print(head.format("tier"))
    for tier, c in sorted(by_key(records, lambda r: r["tier"]).items()):
        print(_row(tier, c))
    shares = by_key([r for r in records if r["tier"] == "exhaustive"],
                    lambda r: zlib.crc32(r["test"].encode()) % 3)
    for k, c in sorted(shares.items()):
        print(_row(f"exhaustive, share {k} of 3", c))
    print("\n" + head.format("file (tier)"))
    files = by_key(records, lambda r: f"{r['test'].split('::')[0]} ({r['tier']})")
    for name, c in sorted(files.items(), key=lambda kv: -kv[1]["wall_s"])[:args.files]:
        print(_row(name, c))
    print("\n| test | tier | wall s | compiles | cache misses | compile s |\n|---|---|---:|---:|---:|---:|")
    for r in sorted(records, key=lambda r: -r["wall_s"])[:args.top]:
        print(f"| `{r['test'].removeprefix('tests/')}` | {r['tier']} | {r['wall_s']:.1f} | {r.get('compiles', 0)} "
              f"| {r.get('cache_misses', 0)} | {r.get('compile_s', 0):.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
