"""The public API stays put: every ``jaxpar.…`` name that README.md, docs/*.md, notebooks/*.ipynb and examples/
mention resolves (its module imports, then attribute by attribute), and each name that moved since the documented
API of e46ff18 still resolves at its old place, to the same object, with a ``DeprecationWarning`` that names the
new place (:data:`jaxpar.errors.MOVED`). A name that disappears without such an alias fails here.

The names are read from code: fenced blocks and inline code spans of the Markdown (the notebooks' Markdown cells
too), whole code cells and example files; dotted names, ``from jaxpar.x import a, b`` and ``import jaxpar.x as m``
then ``m.a``. Names with a private part (``jaxpar.cost._time``) are implementation, not API, and are left out;
so are paths (``jaxpar/cli.py``), file names and commands (``jaxpar train``). Nothing compiles: imports only.
"""
import importlib
import json
import re
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: Old dotted name -> new dotted name: the public names (``__all__`` of jaxpar's packages, or named in the
#: docs, notebooks or examples) of e46ff18 that live elsewhere now, and the options' re-exports of 8bb8566.
MOVED = {
    "jaxpar.compression_plan": "jaxpar.step.compression_plan",
    "jaxpar.replica_bytes": "jaxpar.step.replica_bytes",
    "jaxpar.cost.calibrate": "jaxpar.devices.calibrate",
    "jaxpar.cost.calibrate_device": "jaxpar.devices.calibrate_device",
    "jaxpar.parallel.context.attention": "jaxpar.attention.attention",
    "jaxpar.parallel.context.use_attention_kernel": "jaxpar.attention.use_attention_kernel",
    "jaxpar.parallel.context.current_attention_kernel": "jaxpar.attention.current_attention_kernel",
    "jaxpar.parallel.context.count_attention_kernels": "jaxpar.attention.count_attention_kernels",
    "jaxpar.parallel.context.choose_kernel": "jaxpar.attention.choose_kernel",
    "jaxpar.parallel.context.KERNELS": "jaxpar.attention.KERNELS",
    "jaxpar.parallel.context.AttentionFallbackWarning": "jaxpar.attention.AttentionFallbackWarning",
    "jaxpar.parallel.context.AttentionError": "jaxpar.errors.AttentionError",
    "jaxpar.parallel.context.METHODS": "jaxpar.options.CONTEXT_METHODS",
    "jaxpar.parallel.Fp8": "jaxpar.options.Fp8",
    "jaxpar.parallel.Offload": "jaxpar.options.Offload",
    "jaxpar.parallel.context.ContextParallel": "jaxpar.options.ContextParallel",
}
#: Public names of e46ff18 with no new public home: deprecated, each warning with what replaced it.
RETIRED = {"jaxpar.parallel.moe.expert_mlp": "jaxpar.parallel.moe.routed_mlp",
           "jaxpar.cost.step_peak_bytes": "jaxpar.cost.memory_per_device"}

NAME = re.compile(r"(?<![\w./-])jaxpar(?:\.[A-Za-z_]\w*)+(?![\w/-])")
FROM_IMPORT = re.compile(r"\bfrom\s+(jaxpar(?:\.\w+)*)\s+import\s+(\([^)]*\)|[^\n]+)")
IMPORT_AS = re.compile(r"\bimport\s+(jaxpar(?:\.\w+)*)\s+as\s+(\w+)")
FILE_ENDINGS = {"py", "md", "yaml", "yml", "json", "ipynb", "toml", "txt", "csv", "png", "log"}


def code_parts(path: str, text: str) -> list[str]:
    """The code of a file: an example whole, a notebook's code cells whole, Markdown's fenced blocks and spans."""
    if path.endswith(".py"):
        return [text]
    if path.endswith(".ipynb"):
        parts = []
        for cell in json.loads(text)["cells"]:
            source = "".join(cell["source"])
            parts += [source] if cell["cell_type"] == "code" else code_parts("cell.md", source)
        return parts
    fenced = re.findall(r"```.*?```", text, re.S)
    return fenced + re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S))


def names_in(code: str) -> set[str]:
    """The public ``jaxpar`` dotted names that ``code`` uses."""
    found = set(NAME.findall(code))
    for module, names in FROM_IMPORT.findall(code):
        for item in re.sub(r"#[^\n]*", "", names).strip("()").split(","):
            words = item.split()
            if words and re.fullmatch(r"\w+", words[0]):
                found.add(f"{module}.{words[0]}")
    for module, alias in IMPORT_AS.findall(code):
        found |= {f"{module}.{a}" for a in re.findall(rf"(?<![\w.]){alias}\.(\w+)", code)}
    return {n for n in found if not any(p.startswith("_") for p in n.split("."))
            and n.rsplit(".", 1)[-1] not in FILE_ENDINGS}


def documented_names() -> dict[str, list[str]]:
    """Each public name the docs, notebooks and examples use -> the files that use it."""
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "notebooks").glob("*.ipynb")),
             *sorted((ROOT / "examples").glob("*.py"))]
    where: dict[str, list[str]] = {}
    for f in files:
        for part in code_parts(f.name, f.read_text()):
            for name in names_in(part):
                where.setdefault(name, []).append(str(f.relative_to(ROOT)))
    return {n: sorted(set(fs)) for n, fs in where.items()}


def resolve(dotted: str):
    """The object ``dotted`` names: the longest importable module prefix, then attributes."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        module = ".".join(parts[:i])
        try:
            obj = importlib.import_module(module)
            break
        except ModuleNotFoundError as e:        # that module does not exist (not a missing dependency inside it)
            if e.name is None or not (module == e.name or module.startswith(e.name + ".")) or i == 1:
                raise
    for attr in parts[i:]:
        obj = getattr(obj, attr)
    return obj


def test_the_parser_finds_names_and_leaves_out_paths_and_commands():
    code = ("`jaxpar/cli.py` `jaxpar train configs/quickstart.yaml` `jaxpar.egg-info` `configs/jaxpar.yaml` "
            "`jaxpar.cost._time.step_time` `jaxpar.make_mesh(...)`\n"
            "from jaxpar.attention import (attention,  # the one call\n    dense_attention as dense)\n"
            "import jaxpar.parallel.context as cp\ny = cp.to_balanced(x, 1, 4)\n")
    assert names_in(code) == {"jaxpar.make_mesh", "jaxpar.attention", "jaxpar.attention.attention",
                              "jaxpar.attention.dense_attention", "jaxpar.parallel.context",
                              "jaxpar.parallel.context.to_balanced"}
    names = documented_names()
    assert len(names) > 100 and "README.md" in names["jaxpar.make_mesh"], sorted(names)


def test_every_documented_name_resolves_without_a_deprecation():
    missing, deprecated = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for name, files in sorted(documented_names().items()):
            try:
                resolve(name)
            except (ImportError, AttributeError) as e:
                missing.append(f"{name} (in {', '.join(files)}): {type(e).__name__}: {e}")
    deprecated = [str(w.message) for w in caught
                  if issubclass(w.category, DeprecationWarning) and str(w.message).startswith("jaxpar.")]
    assert not missing, ("documented names that no longer resolve; give each an alias in jaxpar/errors.py (MOVED) (and "
                         "tests/test_public_api.py's MOVED) or fix the docs:\n" + "\n".join(missing))
    assert not deprecated, "the docs use old names; use the new ones:\n" + "\n".join(deprecated)


@pytest.mark.parametrize("old", sorted(MOVED))
def test_a_moved_name_still_resolves_and_warns_with_its_new_place(old):
    with pytest.warns(DeprecationWarning, match=rf"^{re.escape(old)} moved to {re.escape(MOVED[old])}; ") as caught:
        obj = resolve(old)
    assert obj is resolve(MOVED[old])
    assert Path(caught[0].filename).name == "test_public_api.py"      # the line that read the old name


@pytest.mark.parametrize("old", sorted(RETIRED))
def test_a_retired_name_still_resolves_and_warns_with_its_replacement(old):
    with pytest.warns(DeprecationWarning, match=rf"^{re.escape(old)} is deprecated .*{re.escape(RETIRED[old])}"):
        assert callable(resolve(old))
    resolve(RETIRED[old])


def test_an_unknown_name_is_still_an_attribute_error():
    import jaxpar.parallel.context as cp

    with pytest.raises(AttributeError, match="module 'jaxpar.parallel.context' has no attribute 'attentoin'"):
        cp.attentoin
