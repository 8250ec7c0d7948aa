"""Import paths of a user's model, loss and data function: ``'pkg.mod:attr'`` (importlib) or
``'path/to/file.py:attr'`` (that file, loaded once), with errors that name the YAML key.

:func:`call_problem` and :func:`takes` look at a signature without calling anything.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
import inspect
import re
import sys
from pathlib import Path
from typing import Any, Callable

from jaxpar.config._schema import ConfigError


def _load_file(path: Path) -> Any:
    """The module of a ``.py`` file, loaded once per path (cached in ``sys.modules``)."""
    path = path.resolve()
    stem = re.sub(r"\W", "_", path.stem)
    name = f"_jaxpar_user_{stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module      # dataclasses and pickling look the module up by name
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def resolve_import(value: Any, key: str) -> Any:
    """``'pkg.mod:attr'`` (importlib) or ``'path/to/file.py:attr'`` (that file) -> the object.

    Errors name ``key`` and ``value`` and say what went wrong: malformed, module or file not
    found, the import failed, attribute missing, not callable.

    Args:
      value: the import path (a string).
      key: the YAML key it came from (named in errors).

    Returns:
      The object.
    """
    form = "expected 'package.module:attribute' or 'path/to/file.py:attribute'"
    module, _, attr = value.rpartition(":") if isinstance(value, str) else ("", "", "")
    if not module or not attr:
        raise ConfigError(f"{key}={value!r}: {form}.")
    where, path = f"{key}={value!r}", Path(module).expanduser()
    if module.endswith(".py") and not path.is_file():
        raise ConfigError(f"{where}: file {str(path)!r} not found (a relative path is relative to the YAML file "
                          "that names it; in an override, to the working directory).")
    try:
        mod = _load_file(path) if module.endswith(".py") else importlib.import_module(module)
    except Exception as e:   # not found, or the user's module raised while it was imported
        name = getattr(e, "name", None) if isinstance(e, ModuleNotFoundError) else None
        if name and (module == name or module.startswith(name + ".")):
            raise ConfigError(f"{where}: module {module!r} not found (no module named {name!r}); install it, "
                              f"put it on PYTHONPATH, or give a file: 'path/to/file.py:{attr}'.") from None
        raise ConfigError(f"{where}: importing module {module!r} failed: {type(e).__name__}: {e}") from e
    obj = mod
    for i, part in enumerate(attr.split(".")):
        if not hasattr(obj, part):
            owner = module if i == 0 else f"{module}:{'.'.join(attr.split('.')[:i])}"
            names = [n for n in dir(obj) if not n.startswith("_")]
            close = difflib.get_close_matches(part, names, n=3)
            hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else "."
            raise ConfigError(f"{where}: {owner!r} has no attribute {part!r}{hint}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(f"{where}: {attr!r} is not callable (it is of type {type(obj).__name__}); name a "
                          "class or a function.")
    return obj


def call_problem(fn: Callable, *args: Any, **kwargs: Any) -> str | None:
    """Why ``fn(*args, **kwargs)`` cannot bind to ``fn``'s signature, or None (also when it has none).

    Args:
      fn: the function.
      *args: the positional arguments it would get.
      **kwargs: the keyword arguments it would get.

    Returns:
      The binding error's message, or None.
    """
    if isinstance(fn, type) and fn.__init__ is not object.__init__:
        fn, args = fn.__init__, (None, *args)     # a class: its __init__ (nnx's metaclass hides it)
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    try:
        sig.bind(*args, **kwargs)
    except TypeError as e:
        return str(e)
    return None


def takes(fn: Callable, name: str) -> bool:
    """Whether ``fn`` takes a parameter called ``name``.

    Args:
      fn: a callable.
      name: the parameter's name.

    Returns:
      True if its signature has it (False also when it has no signature).
    """
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
