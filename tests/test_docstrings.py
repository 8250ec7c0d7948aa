"""Public means something: every public function says what it takes and what it gives back, and
every cross reference in a docstring points at something real.

* :func:`test_public_functions_have_args_and_returns`: per module, every function named in its
  ``__all__`` (a package's API) with parameters, and every public method of a class named in
  it, has a Google-style ``Args:`` section listing its parameters (``self`` / ``cls``
  excluded; ``*args`` / ``**kwargs`` as ``*args`` / ``**kwargs`` or by name), and a ``Returns:``
  (or ``Yields:``) section when it returns something other than ``None``: by the return
  annotation when there is one, else by a ``return <value>`` or ``yield`` in its body.
* :func:`test_cross_references_resolve`: every ``:mod:``, ``:func:``, ``:class:``, ``:meth:``,
  ``:data:``, ``:attr:`` and ``:exc:`` reference in a docstring (or attribute docstring) of
  ``jaxpar/`` resolves: a dotted name imports, or is an attribute reachable from the enclosing
  class, the module where it is written, its package, or the builtins.
"""
import ast
import builtins
import dataclasses
import importlib
import inspect
import pkgutil
import re
import textwrap
from pathlib import Path
from typing import Iterator

import pytest

import jaxpar

PACKAGE_DIR = Path(jaxpar.__file__).resolve().parent

ROLES = ("mod", "func", "class", "meth", "data", "attr", "exc")
# :role:`target`, :role:`~target`, :role:`title <target>`; also the :py:role: spelling.
REFERENCE = re.compile(r":(?:py:)?(" + "|".join(ROLES) + r"):`([^`]+)`")
# One Args entry: "name: ...", "name (type): ...", or several names sharing one description
# ("batch, m, k, n: the shape.").
ARG_ENTRY = re.compile(r"(\*{0,2}\w+(?:\s*,\s*\*{0,2}\w+)*)\s*(?:\([^)]*\))?\s*:")
# Return annotations that mean "nothing": None, NoReturn, a generator of None (a context manager).
NOTHING = re.compile(r"None|NoneType|(typing\.)?(NoReturn|Never)|"
                     r"((typing|collections\.abc)\.)?(Iterator|Generator)\[(None|NoneType)(,(None|NoneType))*\]")
SECTION = re.compile(r"^\s*(\w+(?: \w+)?):\s*$")


def module_names() -> list[str]:
    """``jaxpar`` and every module and package below it."""
    found = pkgutil.walk_packages(jaxpar.__path__, prefix="jaxpar.", onerror=lambda name: None)
    return ["jaxpar"] + sorted(m.name for m in found)


def module_name(path: Path) -> str:
    """``.../jaxpar/run/loop.py`` -> ``jaxpar.run._loop``; ``.../parallel/pipeline/__init__.py`` -> ``jaxpar.parallel.pipeline``."""
    parts = ("jaxpar",) + path.relative_to(PACKAGE_DIR).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = module_names()


# --- Args / Returns ------------------------------------------------------------------------------

def public_names(module) -> list[str]:
    """The names in ``module.__all__``: a package's API or a public module's. Private ``_name.py``
    modules carry none (optax's layout); what they define is checked through the package that
    exports it."""
    return list(getattr(module, "__all__", ()))


def public_functions(module):
    """``(qualified name, function, is_method)`` for the public functions of ``module``: those of
    :func:`public_names`, and the public methods of such classes."""
    for name in public_names(module):
        obj = getattr(module, name)
        if inspect.isfunction(obj):
            yield name, obj, False
        elif inspect.isclass(obj) and obj.__module__.startswith("jaxpar"):
            for attr, raw in vars(obj).items():
                if attr.startswith("_") or isinstance(raw, property):
                    continue
                if isinstance(raw, staticmethod):
                    yield f"{name}.{attr}", raw.__func__, False
                elif isinstance(raw, classmethod):
                    yield f"{name}.{attr}", raw.__func__, True
                elif inspect.isfunction(raw) and raw.__module__ == obj.__module__:
                    yield f"{name}.{attr}", raw, True


def sections(doc: str) -> dict[str, list[str]]:
    """Google-style sections of a docstring: header (``Args``, ``Returns``, ...) -> its body lines."""
    out, current, indent = {}, None, 0
    for line in inspect.cleandoc(doc).splitlines():
        width = len(line) - len(line.lstrip())
        header = SECTION.match(line)
        if header and (current is None or width <= indent):
            current, indent = header.group(1), width
            out[current] = []
        elif current is not None and line.strip() and width <= indent:
            current = None
        elif current is not None:
            out[current].append(line)
    return out


def documented_args(body: list[str]) -> set[str]:
    """Names of the entries of an ``Args:`` body (the lines at its smallest indentation)."""
    lines = [line for line in body if line.strip()]
    if not lines:
        return set()
    least = min(len(line) - len(line.lstrip()) for line in lines)
    names = set()
    for line in lines:
        if len(line) - len(line.lstrip()) == least and (m := ARG_ENTRY.match(line.strip())):
            names.update(name.strip() for name in m.group(1).split(","))
    return names


def expected_args(fn, is_method: bool) -> list[inspect.Parameter]:
    params = list(inspect.signature(inspect.unwrap(fn)).parameters.values())
    return params[1:] if is_method and params else params


def returns_value(fn) -> bool:
    """Whether ``fn`` returns something other than ``None``: its return annotation when present,
    else a ``return <value>`` / ``yield`` in its own body (not in nested functions). A generator of
    ``None`` (a context manager's body, ``Iterator[None]``) returns nothing."""
    fn = inspect.unwrap(fn)
    annotation = inspect.signature(fn).return_annotation
    if annotation is not inspect.Signature.empty:
        text = annotation if isinstance(annotation, str) else inspect.formatannotation(annotation)
        return not NOTHING.fullmatch(text.replace(" ", ""))
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    stack = list(ast.iter_child_nodes(tree.body[0]))
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            continue
        if isinstance(node, (ast.Yield, ast.YieldFrom)):
            return True
        if isinstance(node, ast.Return) and node.value is not None and not (
                isinstance(node.value, ast.Constant) and node.value.value is None):
            return True
        stack.extend(ast.iter_child_nodes(node))
    return False


def docstring_problems(qualname: str, fn, is_method: bool) -> list[str]:
    params = expected_args(fn, is_method)
    if not params:
        return []
    found = sections(fn.__doc__ or "")
    problems = []
    if "Args" not in found:
        problems.append(f"{qualname}: no 'Args:' section")
    else:
        listed = documented_args(found["Args"])
        for p in params:
            star = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}.get(p.kind, "")
            if p.name not in listed and star + p.name not in listed:
                problems.append(f"{qualname}: parameter {star}{p.name} missing from 'Args:'")
        unknown = listed - {p.name for p in params} - {"*" + p.name for p in params} - {"**" + p.name for p in params}
        problems += [f"{qualname}: 'Args:' lists {name}, which is not a parameter" for name in sorted(unknown)]
    if returns_value(fn) and not {"Returns", "Yields"} & set(found):
        problems.append(f"{qualname}: returns a value but has no 'Returns:' (or 'Yields:') section")
    return problems


@pytest.mark.parametrize("name", MODULES)
def test_public_functions_have_args_and_returns(name):
    module = importlib.import_module(name)
    problems = [p for qualname, fn, is_method in public_functions(module)
                for p in docstring_problems(qualname, fn, is_method)]
    assert not problems, f"{name}: public functions without Google-style Args / Returns:\n" + "\n".join(problems)


def test_the_checks_read_google_style():
    def f(a, *rest, b=1, c=2, d=3, **kw) -> int:
        """Do it.

        Args:
          a: the first, on
            two lines.
          *rest: more.
          b (int): the second.
          c, d: the third and fourth.
          **kw: the rest.

        Returns:
          A number.
        """
        return a

    def g(a):
        """Yield it.

        Args:
          a: one.
        """
        yield a

    assert docstring_problems("f", f, False) == []
    assert docstring_problems("g", g, False) == ["g: returns a value but has no 'Returns:' (or 'Yields:') section"]
    def h() -> Iterator[None]:
        yield

    def k(x):
        if x:
            return None
        return [x]

    assert not returns_value(h) and returns_value(k)


# --- cross references ----------------------------------------------------------------------------

def docstrings(tree: ast.Module):
    """``(enclosing class names, text)`` for every string statement of a module: the docstrings of
    the module, its classes and functions, and attribute docstrings."""
    stack = [(tree, ())]
    while stack:
        node, classes = stack.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Expr) and isinstance(child.value, ast.Constant) and isinstance(child.value.value, str):
                yield classes, child.value.value
            stack.append((child, classes + (child.name,) if isinstance(child, ast.ClassDef) else classes))


def references() -> list[tuple[str, tuple[str, ...], str]]:
    """``(module, enclosing classes, reference as written)`` for every cross reference in ``jaxpar/``."""
    found = []
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        name = module_name(path)
        for classes, text in docstrings(ast.parse(path.read_text())):
            for _, target in REFERENCE.findall(text):
                found.append((name, classes, target))
    return sorted(set(found))


_MISSING = object()


def attribute(obj, dotted: str):
    """``obj.a.b`` for ``dotted = "a.b"``, a submodule, or a dataclass / annotated field; ``_MISSING``
    when it is not there."""
    for part in dotted.split("."):
        value = getattr(obj, part, _MISSING)
        if value is _MISSING and inspect.ismodule(obj):
            try:
                value = importlib.import_module(f"{obj.__name__}.{part}")
            except ImportError:
                value = _MISSING
        if value is _MISSING and inspect.isclass(obj):
            fields = {f.name for f in dataclasses.fields(obj)} if dataclasses.is_dataclass(obj) else set()
            fields |= {k for c in obj.__mro__ for k in getattr(c, "__annotations__", {})}
            value = part if part in fields else _MISSING
        if value is _MISSING:
            return _MISSING
        obj = value
    return obj


def resolves(module_name_: str, classes: tuple[str, ...], written: str) -> bool:
    target = written.split("<")[-1].rstrip(">").strip() if "<" in written else written
    target = target.lstrip("~!.").removesuffix("()")
    parts = target.split(".")
    for i in range(len(parts), 0, -1):   # an absolute dotted name: the longest prefix that imports
        try:
            root = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        if i == len(parts) or attribute(root, ".".join(parts[i:])) is not _MISSING:
            return True
        break
    module = importlib.import_module(module_name_)
    scopes = []
    owner = module
    for c in classes:   # the enclosing classes, innermost first
        owner = getattr(owner, c, None)
        if owner is not None:
            scopes.insert(0, owner)
    package = module_name_ if hasattr(module, "__path__") else module_name_.rpartition(".")[0]
    scopes += [module, importlib.import_module(package), builtins]
    return any(attribute(scope, target) is not _MISSING for scope in scopes)


def test_cross_references_resolve():
    broken = [f"{m}: {ref!r}" + (f" (in class {'.'.join(classes)})" if classes else "")
              for m, classes, ref in references() if not resolves(m, classes, ref)]
    assert not broken, ("docstring cross references that resolve to nothing (write the full dotted name, "
                     "or a name the module imports):\n" + "\n".join(broken))


def test_the_walk_finds_references():
    refs = references()
    assert len(refs) > 50
    assert ("jaxpar.cost", (), "~jaxpar.cost._collectives") in refs
    assert resolves("jaxpar.cost", (), "~jaxpar.cost._collectives")
    assert resolves("jaxpar.cost", (), "ValueError")
    assert not resolves("jaxpar.cost", (), "jaxpar.cost.no_such_module")
