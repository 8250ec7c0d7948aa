"""The docs state the present: figures recomputed from their source, paths and names that exist.

* README.md, docs/benchmarks.md §7 and docs/planning.md §6 quote the cost model's rank correlation
  (Spearman's rho) that ``benchmarks/calibrate.py`` computes from the measured step times of
  docs/benchmarks.md §1 (parsed from its table) and the ``cpu_sim`` preset, to the printed precision.
* Every ``jaxpar/...`` path and every ``jaxpar.x.y`` dotted name in README.md and docs/*.md exists
  (a file or folder; a module or an attribute of one), and so does every other ``dir/file.py`` path.
* Every link's ``#anchor`` into README.md or docs/*.md names a heading that exists.
* Every results section of docs/benchmarks.md (a section with a table of its own) names the commit
  it was measured at (a hex id of 7+ digits) and the machine.

Pure parsing plus the cost model (pure Python): a few seconds, no device work.
"""
from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
BENCHMARKS_MD = ROOT / "docs" / "benchmarks.md"
#: Placeholders in the prose, not paths of the repository.
PLACEHOLDER_PATHS = {"tests/test_x.py"}


def _calibrate():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import calibrate
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return calibrate


def _flat(text: str) -> str:
    return " ".join(text.split())


@pytest.fixture(scope="module")
def doc_spearman():
    return _calibrate().doc_spearman()


def test_spearman_is_recomputed_from_the_benchmarks_table(doc_spearman):
    calibrate = _calibrate()
    measured, source = calibrate.doc_measured_step_times()
    assert len(measured) == 11 and all(v > 0 for v in measured.values())
    rho, _, src = doc_spearman
    assert src == source and -1 <= rho <= 1
    assert re.search(r"commit [0-9a-f]{7,}", source), source


def test_readme_quotes_the_recomputed_spearman(doc_spearman):
    rho, rho_no_elementwise, source = doc_spearman
    commit = re.search(r"commit ([0-9a-f]{7,})", source).group(1)
    readme = _flat((ROOT / "README.md").read_text())
    quoted = re.findall(r"Spearman (?:ρ )?(?:= )?(-?[01]\.\d+)", readme)
    assert quoted, "README.md quotes no Spearman figure"
    assert set(quoted) == {f"{rho:.3f}"}, (quoted, rho)
    assert commit in readme, f"README.md does not name the commit of docs/benchmarks.md §1 ({commit})"


@pytest.mark.parametrize("doc, section", [("docs/benchmarks.md", "7"), ("docs/planning.md", "6")])
def test_docs_quote_the_recomputed_spearman(doc_spearman, doc, section):
    calibrate = _calibrate()
    rho, rho_no_elementwise, source = doc_spearman
    text = _flat(calibrate.doc_section((ROOT / doc).read_text(), section))
    assert f"{rho:.3f}" in text, (doc, section, rho)
    quoted = re.findall(r"(?:Spearman|ρ) ?=? ?\**(-?[01]\.\d{3})\b", text)
    assert set(quoted) <= {f"{rho:.3f}"}, (doc, section, quoted, rho)
    if "without the elementwise term" in text:
        assert f"{rho_no_elementwise:.3f}" in text, (doc, section, rho_no_elementwise)


def _resolves(name: str) -> bool:
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for attr in parts[i:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return False
        return True
    return False


def test_paths_and_dotted_names_in_the_docs_exist():
    missing = []
    path_re = re.compile(r"(?<![\w./-])(jaxpar/[\w/.-]*[\w/])")
    file_re = re.compile(r"(?<![\w./-])((?:[\w-]+/)+[\w-]+\.py)\b")
    name_re = re.compile(r"(?<![\w./-])(jaxpar(?:\.[A-Za-z_]\w*)+)")
    for doc in DOCS:
        for n, line in enumerate(doc.read_text().splitlines(), 1):
            where = f"{doc.relative_to(ROOT)}:{n}"
            for p in path_re.findall(line):
                if not ((ROOT / p).exists() or (ROOT / f"{p}.py").exists()):
                    missing.append(f"{where}: {p}")
            for p in file_re.findall(line):
                if p not in PLACEHOLDER_PATHS and not (ROOT / p).exists():
                    missing.append(f"{where}: {p}")
            for name in name_re.findall(line):
                if not _resolves(name):
                    missing.append(f"{where}: {name}")
    assert not missing, "\n".join(missing)


def _slug(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(doc: Path) -> set[str]:
    out, fenced = set(), False
    for line in doc.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            out.add(_slug(line.lstrip("#")))
    return out


def test_links_into_the_docs_name_existing_headings():
    anchors = {d.resolve(): _anchors(d) for d in DOCS}
    broken = []
    for doc in DOCS:
        for n, line in enumerate(doc.read_text().splitlines(), 1):
            for target, anchor in re.findall(r"\]\(([^)\s#]*)(?:#([^)\s]+))?\)", line):
                if target.startswith(("http:", "https:", "mailto:")):
                    continue
                path = (doc.parent / target).resolve() if target else doc.resolve()
                if not path.exists():
                    broken.append(f"{doc.relative_to(ROOT)}:{n}: {target}")
                elif anchor and path in anchors and anchor not in anchors[path]:
                    broken.append(f"{doc.relative_to(ROOT)}:{n}: {target}#{anchor}")
    assert not broken, "\n".join(broken)


def _sections(text: str):
    """``(heading, own body)`` of every ``##`` / ``###`` section: the body up to the next heading."""
    parts = re.split(r"^(#{2,3} .*)$", text, flags=re.M)
    return list(zip(parts[1::2], parts[2::2]))


def test_every_results_section_of_benchmarks_md_names_its_commit_and_machine():
    text = BENCHMARKS_MD.read_text()
    assert "the 2-core machine" in _flat(text.split("\n## ")[0]), "the header does not define the machine"
    results = [(h, b) for h, b in _sections(text) if re.search(r"^\|.*\|\s*$", b, re.M)]
    assert len(results) >= 20
    bad = []
    for heading, body in results:
        flat = _flat(heading + " " + body)
        if not re.search(r"`[0-9a-f]{7,40}`", flat):
            bad.append(f"{heading}: no commit")
        if "2-core machine" not in flat:
            bad.append(f"{heading}: no machine")
        if not re.search(r"\d{4}-\d{2}-\d{2}", flat):
            bad.append(f"{heading}: no date")
    assert not bad, "\n".join(bad)
