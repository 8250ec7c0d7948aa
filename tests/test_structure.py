"""The package's shape, read from its source with ``ast``: one-way layers, no import cycle (imports
inside functions included), no private name used across modules, and short functions (a module is the size
of its concept: no line cap)."""
import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / "jaxpar"

#: Packages that import nothing from the layers above them.
#: Packages of the core below the step (jaxpar.cost, the planner's, may import the step: test_the_wings_point_one_way).
LOWER_LAYERS = ("jaxpar.parallel.pipeline", "jaxpar.parallel.compression", "jaxpar.parallel.sync")
UPPER = ("jaxpar.step", "jaxpar.run", "jaxpar.config", "jaxpar.cli")
MAX_FUNCTION = 60


def _modules() -> dict[str, pathlib.Path]:
    mods = {}
    for path in ROOT.rglob("*.py"):
        name = ".".join(("jaxpar", *path.relative_to(ROOT).with_suffix("").parts))
        mods[name.removesuffix(".__init__")] = path
    return mods


MODULES = _modules()


def _target(module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = module.split(".")
    if MODULES[module].name != "__init__.py":
        package = package[:-1]
    package = package[:len(package) - node.level + 1]
    return ".".join(package + ([node.module] if node.module else []))


def _known(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str) -> list[tuple[str, str | None]]:
    """``(imported module, imported name or None)`` of every import in ``module``, at any depth."""
    out = []
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.Import):
            out += [(_known(a.name), None) for a in node.names if a.name.startswith("jaxpar")]
        elif isinstance(node, ast.ImportFrom):
            base = _target(module, node)
            if base.startswith("jaxpar"):
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    out.append((sub, None) if sub in MODULES else (_known(base), a.name))
    return [(m, n) for m, n in out if m and m != module]


GRAPH = {m: _imports(m) for m in MODULES}


def _cycle() -> list[str] | None:
    """A cycle of module imports, or ``None``. A package's ``__init__`` is its API: a module that
    imports from a package depends on everything that ``__init__`` imports."""
    edges = {m: {t for t, _ in GRAPH[m]} for m in MODULES}
    state: dict[str, int] = {}

    def visit(m, path):
        state[m] = 1
        for t in edges[m]:
            if state.get(t) == 1:
                return path[path.index(t):] + [t]
            if t not in state and (found := visit(t, path + [t])):
                return found
        state[m] = 2
        return None

    for m in MODULES:
        if m not in state and (found := visit(m, [m])):
            return found
    return None


def test_no_import_cycle():
    assert _cycle() is None, f"import cycle: {' -> '.join(_cycle())}"


def test_the_step_imports_nothing_from_the_loop():
    """``jaxpar.run`` (the loop, checkpoints, reports) builds on ``jaxpar.step``, never the reverse."""
    up = [f"{m} -> {t}" for m, imps in GRAPH.items() if m.startswith("jaxpar.step")
          for t, _ in imps if t.startswith(("jaxpar.run", "jaxpar.config", "jaxpar.cli"))]
    assert not up, up


#: The three wings (../shared/design.md): the core (the library a JAX user shards a model with) imports neither
#: other wing; the planner (know before and after you run) imports the core only; the runner may use both.
WINGS = {
    "core": ("jaxpar.mesh", "jaxpar.rules", "jaxpar.strategy", "jaxpar.batch", "jaxpar.errors", "jaxpar.logical",
             "jaxpar._text", "jaxpar.optimizers", "jaxpar.compat", "jaxpar.adapters", "jaxpar.parallel", "jaxpar.step",
             "jaxpar.models", "jaxpar.attention", "jaxpar.options", "jaxpar.devices._distributed"),
    "planner": ("jaxpar.cost", "jaxpar.analysis", "jaxpar.plan", "jaxpar.devices._targets", "jaxpar.devices._calibrate",
                "jaxpar.devices._device_rates", "jaxpar.devices"),
    "runner": ("jaxpar.run", "jaxpar.config", "jaxpar.hf", "jaxpar.data", "jaxpar.cli", "jaxpar.commands"),
}


def _in(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


@pytest.mark.parametrize("wing,others", [("core", ("planner", "runner")), ("planner", ("runner",))])
def test_the_wings_point_one_way(wing, others):
    above = tuple(p for w in others for p in WINGS[w])
    wrong = [f"{m} -> {t}" for m, imps in GRAPH.items() if _in(m, WINGS[wing]) for t, _ in imps if _in(t, above)]
    assert not wrong, wrong


def test_every_module_has_a_wing():
    """Each module but the top package (the API, which re-exports every wing) lies in a wing (its longest
    package there: ``jaxpar.devices._distributed`` is the core's, the rest of ``jaxpar.devices`` the planner's)."""
    assert not [m for m in MODULES if m != "jaxpar" and not any(_in(m, WINGS[w]) for w in WINGS)]


def test_no_two_packages_import_each_other():
    """Between packages (and top modules) the imports run one way: no arrow runs back up."""
    top = lambda m: ".".join(m.split(".")[:2])          # noqa: E731
    edges = {(top(m), top(t)) for m, imps in GRAPH.items() for t, _ in imps if top(m) != top(t)}
    assert not sorted((a, b) for a, b in edges if (b, a) in edges and a < b)


def test_no_command_imports_another_and_config_prints_nothing():
    """The commands share their helpers through the commands' own modules (``_common``, ``_job_devices``,
    ``_lines``), never through another command; the YAML layer builds the job and prints nothing."""
    command = lambda m: m.startswith("jaxpar.commands.") and m.endswith(("_command", "_commands"))   # noqa: E731
    across = [f"{m} -> {t}" for m, imps in GRAPH.items() if command(m) for t, _ in imps if command(t)]
    prints = [f"{m}:{node.lineno}" for m, path in MODULES.items() if _in(m, ("jaxpar.config",))
              for node in ast.walk(ast.parse(path.read_text()))
              if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print"]
    assert not across and not prints, {"commands importing commands": across, "print() in jaxpar.config": prints}


def test_no_private_name_is_imported_across_modules():
    private = [f"{m} imports {t}.{n}" for m, imps in GRAPH.items() for t, n in imps
               if n and n.startswith("_") and not n.startswith("__")]
    assert not private, private


@pytest.mark.parametrize("layer", LOWER_LAYERS)
def test_lower_layers_import_nothing_from_above(layer):
    up = [f"{m} -> {t}" for m, imps in GRAPH.items() if m == layer or m.startswith(layer + ".")
          for t, _ in imps if t.startswith(UPPER)]
    assert not up, up


def test_the_cost_model_imports_no_jax_at_import_time():
    found = []
    for m, path in MODULES.items():
        if m == "jaxpar.cost" or m.startswith("jaxpar.cost."):
            tree = ast.parse(path.read_text())
            for node in tree.body:
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
                found += [f"{m}: {n}" for n in names if n.split(".")[0] in ("jax", "jaxlib", "flax", "optax")]
    assert not found, found


def test_the_cost_model_runs_nothing():
    """The cost model is pure functions: the step and the measurements that calibrate it (:mod:`jaxpar.devices`)
    are not imported from it, at any depth."""
    up = [f"{m} -> {t}" for m, imps in GRAPH.items() if _in(m, ("jaxpar.cost",))
          for t, _ in imps if _in(t, ("jaxpar.step", "jaxpar.run", "jaxpar.devices"))]
    assert not up, up


def test_functions_are_short():
    long = [f"{p.relative_to(ROOT.parent)}:{node.name}: {node.end_lineno - node.lineno + 1} lines"
            for p in MODULES.values() for node in ast.walk(ast.parse(p.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION]
    assert not long, long


def test_make_train_step_is_one_composition():
    """No feature is special-cased in ``make_train_step``: it checks the table, builds the update
    and the options, and hands them to the builder of the program's shape."""
    tree = ast.parse(MODULES["jaxpar.step._compose"].read_text())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "make_train_step")
    branches = [n for n in ast.walk(fn) if isinstance(n, (ast.If, ast.IfExp, ast.Match))]
    assert not branches, [ast.unparse(b.test) for b in branches if hasattr(b, "test")]


#: File names that several packages may each have, because each is the same kind of thing there:
#: the package's API, its errors, and the base class of its plug-ins.
SAME_KIND = {"__init__.py", "_errors.py", "_base.py"}


def test_the_top_of_the_package_holds_the_core_only():
    """The mesh, its rules, the batch, the strategy and its plain options, logical names, errors, text and the CLI."""
    top = sorted(p.name for p in ROOT.glob("*.py") if p.name != "__init__.py")
    assert len(top) <= 9, f"{len(top)} modules at the top of jaxpar/: {top}"


def test_no_two_modules_share_a_file_name():
    seen: dict[str, list[str]] = {}
    for path in MODULES.values():
        if path.name not in SAME_KIND:
            seen.setdefault(path.name, []).append(str(path.relative_to(ROOT.parent)))
    assert not {n: ps for n, ps in seen.items() if len(ps) > 1}, {n: ps for n, ps in seen.items() if len(ps) > 1}


def test_a_package_is_its_api_and_its_modules_are_private():
    """Optax's layout: a package's ``__init__`` is its API (an explicit ``__all__``); every module inside a
    package is private (``_name.py``); only the core (``mesh``, ``rules``, ``strategy``, ...) sits at the top."""
    public = [str(p.relative_to(ROOT.parent)) for p in MODULES.values()
              if p.parent != ROOT and p.name != "__init__.py" and not p.name.startswith("_")]
    no_api = [m for m, p in MODULES.items() if p.name == "__init__.py" and "__all__" not in p.read_text()]
    assert not public and not no_api, {"public modules inside packages": public, "packages without __all__": no_api}


def _user_code() -> dict[str, str]:
    """The code a user reads and copies: examples, notebooks' code cells, and the Python blocks of the
    README and docs/."""
    import json
    import re

    repo = ROOT.parent
    code = {str(p.relative_to(repo)): p.read_text() for p in (repo / "examples").rglob("*.py")}
    for nb in (repo / "notebooks").glob("*.ipynb"):
        cells = json.loads(nb.read_text())["cells"]
        code[str(nb.relative_to(repo))] = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    for md in [repo / "README.md", *(repo / "docs").glob("*.md")]:
        code[str(md.relative_to(repo))] = "\n".join(re.findall(r"```python\n(.*?)```", md.read_text(), re.S))
    return {where: text for where, text in code.items() if text}


def test_user_code_imports_the_public_api_only():
    """Examples, notebooks, the README and docs/ import jaxpar's packages, never a private module."""
    import re

    code = _user_code()
    assert len(code) > 10 and any(k.endswith(".ipynb") for k in code), sorted(code)
    found = [f"{where}: {m.group(0)}" for where, text in code.items()
             for m in re.finditer(r"(?:from|import) jaxpar(?:\.\w+)*\._\w+", text)]
    assert not found, found


def test_user_code_imports_names_the_packages_have():
    """Every ``from jaxpar... import name`` of the examples, notebooks and docs names something public
    the package has (the notebooks run in the exhaustive tier only; a renamed or unexported name fails here)."""
    import importlib.util
    import re

    missing = []
    for where, text in _user_code().items():
        for m in re.finditer(r"^[ \t]*from (jaxpar(?:\.\w+)*) import (\([^)]*\)|[^\n#]+)", text, re.M):
            package = importlib.import_module(m.group(1))
            names = [n.split(" as ")[0].strip() for n in m.group(2).strip("() \n").split(",") if n.strip()]
            missing += [f"{where}: {m.group(1)}.{n}" for n in names if n.startswith("_") or not (
                hasattr(package, n) or importlib.util.find_spec(f"{m.group(1)}.{n}") is not None)]
    assert not missing, missing
