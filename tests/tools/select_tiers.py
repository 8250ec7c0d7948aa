"""Choose the fast tier's cases and the ``slow`` tests from a measured run (docs/testing.md §1).

Reads coverage data recorded with per-test contexts and the cost report of the same run, and writes
``tests/tiers.py``:

* every test function the fast tier runs keeps at least one case in it, and the fast tier keeps
  covering every line of ``jaxpar/`` it covered: a greedy cover of those lines, by lines gained per
  second, over the cases of functions with several fast cases;
* the other fast cases become ``exhaustive``;
* while the fast tier costs more than ``FAST_BUDGET_S``, the heaviest tests every line of which other
  fast tests run become ``exhaustive`` too (``COVERED_ELSEWHERE``; not those ``KEEP`` or a ``MOVED``
  reason names, nor subprocess tests);
* the lines only ``exhaustive`` tests reach are covered in every CI run by ``slow`` tests, chosen the
  same way among them.

    .venv/bin/python tests/tools/select_tiers.py --data A/.coverage B/.coverage --report /tmp/cost \
        [--costs /tmp/plain-run]
"""
from __future__ import annotations

import argparse
import collections
import re
import sys

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from cost_report import load  # noqa: E402
from coverage_tiers import lines_by_test  # noqa: E402


#: A case that costs less (wall seconds in the measured run) stays in the fast tier.
MOVE_ABOVE_S = 1.0
#: The fast tier's budget in worker-seconds of the cost reports it reads (the tier chosen with 760
#: measured 835 worker-seconds and 7:07-7:15 of wall time on two workers: fixture costs land on the
#: first test that uses them), and the cost from which a test whose lines the rest of the fast tier
#: runs may leave it to fit the budget.
FAST_BUDGET_S = 710
HEAVY_S = 2.0


def function_of(test: str) -> str:
    return re.sub(r"\[.*\]$", "", test)


def case_of(test: str) -> str:
    m = re.search(r"\[(.*)\]$", test)
    return m.group(1) if m else ""


def greedy_cover(target: set, candidates: list[str], lines: dict, cost: dict, covered: set) -> list[str]:
    """Tests of ``candidates`` that cover ``target - covered``, by new lines per second."""
    chosen, covered = [], set(covered)
    left = {t: (lines.get(t, set()) & target) - covered for t in candidates}
    while True:
        best = max(left, key=lambda t: len(left[t]) / max(cost[t], 0.05), default=None)
        if best is None or not left[best]:
            return chosen
        chosen.append(best)
        covered |= left.pop(best)
        for t in left:
            left[t] -= covered


def covered_elsewhere(kept: list, lines: dict, records: dict, cost: dict, moved: dict, keep: dict,
                      budget: float = FAST_BUDGET_S) -> list[str]:
    """Heavy fast tests every line of which other fast tests run, heaviest first, until the fast tier
    fits ``budget`` (:data:`FAST_BUDGET_S`: worker-seconds of a plain run). Stay: a test that compiles nothing in process (its work is in
    subprocesses, whose lines no test context names), a test a ``MOVED`` reason names, and the
    ``KEEP`` tests (those that catch docs/testing.md §6's bugs: lines run are not assertions made)."""
    named = set(re.findall(r"test_\w+", " ".join(moved.values())))
    runs = collections.Counter(line for t in kept for line in lines.get(t, ()))
    total, out = sum(cost[t] for t in kept), []
    for t in sorted(kept, key=lambda t: -cost[t]):
        if total <= budget or cost[t] < HEAVY_S:
            break
        if function_of(t).split("::")[-1] in named or t in keep or not records[t].get("compiles", 0):
            continue
        if lines.get(t) and all(runs[line] > 1 for line in lines[t]):
            out.append(t)
            total -= cost[t]
            runs.subtract(lines[t])
    return sorted(out)


def select(lines: dict, records: dict, moved: dict, cost: dict, keep: dict,
           cases: dict | None = None, budget: float = FAST_BUDGET_S) -> tuple[dict, list, list]:
    """The tiers; ``cases`` (a ``FAST_CASES``) fixes the fast cases and refits only the budget."""
    fast = [t for t, r in records.items() if r["tier"] == "fast" and t not in moved]
    functions = collections.defaultdict(list)
    for t in fast:
        functions[function_of(t)].append(t)
    if cases is not None:
        return refit(cases, functions, lines, records, moved, cost, keep, budget)
    kept = [cases[0] for cases in functions.values() if len(cases) == 1]
    target = set().union(*(lines.get(t, set()) for t in fast))
    several = [t for cases in functions.values() if len(cases) > 1 for t in cases]
    kept += [t for t in several if cost[t] < MOVE_ABOVE_S]     # moving them would save nothing
    covered = set().union(*(lines.get(t, set()) for t in kept))
    kept += greedy_cover(target, [t for t in several if t not in kept], lines, cost, covered)
    for fn, cases in functions.items():
        if len(cases) > 1 and not set(cases) & set(kept):
            kept.append(min(cases, key=lambda t: cost[t]))
    fast_cases = {fn: sorted(case_of(t) for t in cases if t in kept)
                  for fn, cases in sorted(functions.items()) if len(cases) > 1 and not set(cases) <= set(kept)}
    return fit_budget(fast_cases, kept, lines, records, moved, cost, keep, budget)


def refit(cases: dict, functions: dict, lines: dict, records: dict, moved: dict, cost: dict,
          keep: dict, budget: float = FAST_BUDGET_S) -> tuple[dict, list, list]:
    """The fast tier of ``cases`` fitted to the budget again, from newer costs."""
    kept = [t for fn, ts in functions.items() for t in ts if fn not in cases or case_of(t) in cases[fn]]
    return fit_budget(cases, kept, lines, records, moved, cost, keep, budget)


def fit_budget(fast_cases: dict, kept: list, lines: dict, records: dict, moved: dict, cost: dict,
               keep: dict, budget: float = FAST_BUDGET_S) -> tuple[dict, list, list]:
    elsewhere = covered_elsewhere(kept, lines, records, cost, moved, keep, budget)
    kept = [t for t in kept if t not in elsewhere]
    covered = set().union(*(lines.get(t, set()) for t in kept))
    everything = set().union(*lines.values())
    rest = [t for t, r in records.items() if r["tier"] == "exhaustive" or t in moved or t in elsewhere]
    slow = sorted(greedy_cover(everything, rest, lines, cost, covered))
    return fast_cases, elsewhere, slow


HEADER = '''"""The tiers chosen from a measured run (docs/testing.md §1), written by tests/tools/select_tiers.py.

``KEEP`` (by hand): fast tests that stay fast, with the bug each catches (the compiled-collective
checks among them: a misplaced collective keeps every number equal). ``FAST_CASES``: for a test
function with several cases, the cases ``make test`` runs; its other cases are ``exhaustive``. ``MOVED`` (written by hand, kept by the script): heavy tests whose behaviour a
cheaper fast test also checks, each with the reason. ``COVERED_ELSEWHERE``: heavy tests every line of
which other fast tests run, moved heaviest first until the fast tier fits its budget; ``exhaustive``.
``SLOW``: tests outside ``make test`` that CI runs every time (the only ones to reach some lines of
``jaxpar/``). tests/conftest.py applies them; a name that matches no test is an error when the whole
suite is collected.
"""
'''


def render(fast_cases: dict, elsewhere: list, slow: list, moved: dict, keep: dict) -> str:
    out = [HEADER, "KEEP = {"]
    for test, reason in keep.items():
        out.append(f"    {test!r}:\n        {reason!r},")
    out.append("}\n\nMOVED = {")
    for test, reason in moved.items():
        out.append(f"    {test!r}:\n        {reason!r},")
    out.append("}\n\nFAST_CASES = {")
    for fn, cases in fast_cases.items():
        out.append(f"    {fn!r}: {cases!r},")
    out.append("}\n\nCOVERED_ELSEWHERE = [")
    out += [f"    {t!r}," for t in elsewhere]
    out.append("]\n\nSLOW = [")
    out += [f"    {t!r}," for t in slow]
    out.append("]\n")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", nargs="+", required=True)
    p.add_argument("--report", nargs="+", required=True)
    p.add_argument("--costs", nargs="*", default=[], help="later cost reports: their wall times replace the "
                                                          "measured run's (e.g. a run without coverage)")
    p.add_argument("--out", default="tests/tiers.py")
    p.add_argument("--fast-only", action="store_true", help="--data is a coverage run of the fast tier alone: keep "
                   "tests/tiers.py's FAST_CASES and SLOW; add to COVERED_ELSEWHERE the heavy fast tests every line of "
                   "which other fast tests run")
    p.add_argument("--budget", type=float, default=FAST_BUDGET_S, help="the fast tier's budget in worker-seconds of "
                   "the costs read (default %(default)s; a slower machine's reports need more)")
    p.add_argument("--refit", action="store_true", help="keep tests/tiers.py's FAST_CASES; choose only "
                                                        "COVERED_ELSEWHERE and SLOW again")
    args = p.parse_args(argv)
    lines = collections.defaultdict(set)
    for f in args.data:
        for t, ls in lines_by_test(f)[0].items():
            lines[t] |= ls
    records = {r["test"]: r for folder in args.report for r in load(folder)}
    for r in records.values():
        if r["tier"] == "slow":        # a report from before the exhaustive marker
            r["tier"] = "exhaustive"
    sys.path.insert(0, "tests")
    from tiers import COVERED_ELSEWHERE, FAST_CASES, KEEP, MOVED, SLOW

    cost = {t: r["wall_s"] for t, r in records.items()}
    cost.update({r["test"]: r["wall_s"] for folder in args.costs for r in load(folder) if r["test"] in cost})
    if args.fast_only:      # the moved tests' lines stay in the fast tier, so SLOW's cover holds
        fast = [t for t, r in records.items() if r["tier"] == "fast"]
        more = covered_elsewhere(fast, lines, records, cost, MOVED, KEEP, args.budget)
        fast_cases, elsewhere, slow = FAST_CASES, sorted(set(COVERED_ELSEWHERE) | set(more)), SLOW
    else:
        fast_cases, elsewhere, slow = select(lines, records, MOVED, cost, KEEP, FAST_CASES if args.refit else None,
                                             args.budget)
    with open(args.out, "w") as f:
        f.write(render(fast_cases, elsewhere, slow, MOVED, KEEP))
    moved = [t for t, r in records.items() if r["tier"] == "fast" and function_of(t) in fast_cases
             and case_of(t) not in fast_cases[function_of(t)]]
    secs = lambda tests: sum(cost.get(t, 0.0) for t in tests)      # noqa: E731 - a report has only its tiers
    print(f"{len(moved)} fast cases become exhaustive ({secs(moved):.0f} s); {len(elsewhere)} heavy tests covered "
          f"elsewhere ({secs(elsewhere):.0f} s); {len(slow)} slow tests ({secs(slow):.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
