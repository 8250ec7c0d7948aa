"""The change's own tests, for CI's --all-tiers (docs/testing.md §1): from each test file added or modified
since BASE, the test functions whose lines changed, or the whole file where a line outside every test
function changed (a fixture, a helper, a table); a change to import lines or the module's docstring alone
names nothing.

Usage: python .ci/changed_tests.py BASE  ->  comma-separated ``file`` and ``file::function`` ids.
"""
import ast
import re
import subprocess
import sys


def changed_lines(base: str, path: str) -> set[int]:
    """The lines of ``path`` at HEAD that differ from ``base`` (an added file: all of them)."""
    diff = subprocess.run(["git", "diff", "-U0", base, "HEAD", "--", path], capture_output=True, text=True,
                          check=True).stdout
    lines = set()
    for start, count in re.findall(r"^@@ -\S+ \+(\d+)(?:,(\d+))? @@", diff, re.M):
        n = 1 if count == "" else int(count)
        lines.update(range(int(start), int(start) + max(n, 1)))   # a pure deletion marks the line after it
    return lines


def own_tests(base: str, path: str) -> list[str]:
    """``path``'s ids among the change's tests (see the module docstring)."""
    source = open(path).read()
    tree, text = ast.parse(source), source.splitlines()
    functions = [(min([n.lineno, *(d.lineno for d in n.decorator_list)]), n.end_lineno, n.name) for n in tree.body
                 if isinstance(n, ast.FunctionDef) and n.name.startswith("test")]
    doc = tree.body[0] if tree.body and isinstance(tree.body[0], ast.Expr) and \
        isinstance(tree.body[0].value, ast.Constant) else None
    named = set()
    for line in changed_lines(base, path) - (set(range(doc.lineno, doc.end_lineno + 1)) if doc else set()):
        owner = next((name for a, b, name in functions if a <= line <= b), None)
        if owner is not None:
            named.add(f"{path}::{owner}")
        elif line <= len(text) and not re.match(r"\s*(import |from \S+ import |$|#)", text[line - 1]):
            return [path]
    return sorted(named)


if __name__ == "__main__":
    base = sys.argv[1]
    files = subprocess.run(["git", "diff", "--name-only", "--diff-filter=AM", base, "HEAD", "--", "tests/test_*.py"],
                           capture_output=True, text=True, check=True).stdout.split()
    print(",".join(i for f in files for i in own_tests(base, f)))
