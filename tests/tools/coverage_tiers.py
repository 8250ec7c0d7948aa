"""Which lines of jaxpar/ each CI run covers, from a coverage run with per-test contexts.

A CI run is the fast tier, the ``slow`` tests and one share of three of the ``exhaustive`` ones
(docs/testing.md). Given coverage data recorded with ``--cov-context=test`` (it may be an older run's)
and the tier of every test now (``tiers.json``, which ``JAXPAR_TEST_REPORT=DIR pytest --co -m ""``
writes), this prints the line coverage of ``jaxpar/`` of the whole suite and of each CI run and, for
each line a CI run misses, the cheapest test that covers it (its wall time from the cost reports).

    JAXPAR_TEST_REPORT=/tmp/tiers .venv/bin/python -m pytest --co -q -m ""
    .venv/bin/python tests/tools/coverage_tiers.py --data .coverage --tiers /tmp/tiers/tiers.json --report /tmp/cost
"""
from __future__ import annotations

import argparse
import collections
import json
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


def statements(data_files: list[str]) -> set:
    """Every statement of the measured files (what a coverage percentage divides by)."""
    cov = coverage.Coverage(data_file=data_files[0])
    cov.load()
    out = set()
    for path in cov.get_data().measured_files():
        out |= {(path, line) for line in cov.analysis2(path)[1]}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", nargs="+", required=True, help="coverage data files (with contexts)")
    p.add_argument("--tiers", required=True, help="tiers.json: every test's tier now")
    p.add_argument("--report", nargs="*", default=[], help="cost report folders (the tests' wall times)")
    p.add_argument("--imports", help="coverage data of importing every module of jaxpar/ (import-time lines): "
                                     "the other lines outside any test (subprocesses) are then left out of every run")
    args = p.parse_args(argv)
    covered, anonymous = collections.defaultdict(set), set()
    for f in args.data:
        tests, anon = lines_by_test(f)
        for t, lines in tests.items():
            covered[t] |= lines
        anonymous |= anon
    tiers = json.load(open(args.tiers))
    cost = {r["test"]: r["wall_s"] for folder in args.report for r in load(folder)}
    total = statements(args.data)
    covered = {t: lines & total for t, lines in covered.items()}
    anonymous &= total
    outside = set()
    everything = set().union(*covered.values()) | anonymous
    if args.imports:
        imported = coverage.CoverageData(args.imports)
        imported.read()
        at_import = {(p, line) for p in imported.measured_files() for line in imported.lines(p)} & total
        outside = anonymous - at_import - set().union(*covered.values())
        print(f"{len(outside)} lines run only outside any test and not at import (in subprocesses): "
              "counted for the whole suite, in no CI run")
        anonymous &= at_import
    print(f"statements of jaxpar/: {len(total)}; the whole suite covers {len(everything)} "
          f"({100 * len(everything) / len(total):.2f}%), {len(anonymous)} of them outside any test "
          "(imports, subprocesses)")
    unknown = sorted(set(covered) - set(tiers))
    if unknown:
        print(f"{len(unknown)} measured tests are not collected now (renamed or removed), e.g. {unknown[:3]}")
    for k, run in enumerate(ci_runs(tiers)):
        lines = set().union(*(covered.get(t, set()) for t in run)) | anonymous
        missing = everything - lines
        in_tests = len(missing - outside) if args.imports else len(missing)
        print(f"CI run with exhaustive share {k}: {len(run)} tests, {len(lines)} lines "
              f"({100 * len(lines) / len(total):.2f}%), {len(missing)} of the whole suite's missing, "
              f"{in_tests} of them run inside tests")
        for path, line in sorted(missing)[:40]:
            cheapest = min((t for t, ls in covered.items() if (path, line) in ls), key=lambda t: cost.get(t, 1e9),
                           default=None)
            if cheapest is None:
                continue                  # a subprocess's line: no test to name
            print(f"  {path}:{line}  <- {cheapest} ({tiers.get(cheapest)}, {cost.get(cheapest)} s)")
    fast = {t for t, tier in tiers.items() if tier == "fast"}
    lines = set().union(*(covered.get(t, set()) for t in fast)) | anonymous
    print(f"make test alone: {len(fast)} tests, {len(lines)} lines ({100 * len(lines) / len(total):.2f}%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
