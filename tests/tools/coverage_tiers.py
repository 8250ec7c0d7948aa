"""Which lines of jaxpar/ each CI run covers, from a coverage run with per-test contexts.

A CI run is the fast tier, the ``slow`` tests and one share of three of the ``exhaustive`` ones
(docs/testing.md). Given coverage data recorded with ``--cov-context=test`` and the tier of every test
(the JSON lines of ``JAXPAR_TEST_REPORT``, or ``pytest --co`` output saved with ``--tiers``), this prints
the lines the whole suite covers, the lines each CI run covers and, for each line a CI run misses, the
cheapest test that covers it.

    .venv/bin/python tests/tools/coverage_tiers.py --data .coverage --report /tmp/cost
"""
from __future__ import annotations

import argparse
import collections
import sys
import zlib

import coverage

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from cost_report import load  # noqa: E402


def lines_by_test(data_file: str) -> tuple[dict[str, set], set]:
    """``{test id: {(file, line)}}`` and the lines with no test context (subprocesses, import time)."""
    data = coverage.CoverageData(data_file)
    data.read()
    tests, anonymous = collections.defaultdict(set), set()
    for path in data.measured_files():
        for line, contexts in data.contexts_by_lineno(path).items():
            for ctx in contexts:
                test = ctx.rsplit("|", 1)[0]
                (tests[test].add((path, line)) if test else anonymous.add((path, line)))
    return tests, anonymous


def ci_runs(tiers: dict[str, str]) -> list[set[str]]:
    """The tests of each of the three CI runs: fast, slow and share k of the exhaustive tier."""
    every = {t for t, tier in tiers.items() if tier in ("fast", "slow")}
    return [every | {t for t, tier in tiers.items() if tier == "exhaustive" and zlib.crc32(t.encode()) % 3 == k}
            for k in range(3)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", nargs="+", required=True, help="combined coverage data files (with contexts)")
    p.add_argument("--report", required=True, help="JAXPAR_TEST_REPORT folder of the tiering to check")
    args = p.parse_args(argv)
    covered, anonymous = collections.defaultdict(set), set()
    for f in args.data:
        tests, anon = lines_by_test(f)
        for t, lines in tests.items():
            covered[t] |= lines
        anonymous |= anon
    records = {r["test"]: r for r in load(args.report)}
    tiers = {t: r["tier"] for t, r in records.items()}
    everything = set().union(*covered.values()) | anonymous
    print(f"whole suite: {len(everything)} lines of jaxpar/ ({len(anonymous)} with no test context)")
    for k, run in enumerate(ci_runs(tiers)):
        lines = set().union(*(covered.get(t, set()) for t in run)) | anonymous
        missing = everything - lines
        print(f"CI run with exhaustive share {k}: {len(lines)} lines, {len(missing)} of the whole suite's missing")
        for path, line in sorted(missing)[:40]:
            cheapest = min((t for t, ls in covered.items() if (path, line) in ls),
                           key=lambda t: records.get(t, {}).get("wall_s", 1e9))
            print(f"  {path}:{line}  <- {cheapest} ({tiers.get(cheapest)}, {records.get(cheapest, {}).get('wall_s')} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
