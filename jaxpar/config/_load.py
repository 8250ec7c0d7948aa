"""Loading: YAML files with ``base:`` inheritance, dotted overrides, merging the layers onto the
:class:`JobConfig` schema (unknown keys and wrong types named by their dotted path), and back to YAML.

A ``.py`` file in an import path is made absolute here, relative to the YAML file that names it
(in an override, to the working directory).
"""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import Any, Mapping, Sequence

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from jaxpar.config._checks import check
from jaxpar.config._schema import GPT_KEYS, HF_MODEL_KEYS, IMPORT_KEYS, RENAMED, USER_MODEL_KEYS, ConfigError, JobConfig


def _type_name(tp) -> str:
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if dataclasses.is_dataclass(tp) or typing.get_origin(tp) is dict:
        return "a mapping"
    if typing.get_origin(tp) is tuple:
        return f"a list of {_type_name(args[0])}"
    if len(args) == 1 and type(None) in typing.get_args(tp):
        return f"{_type_name(args[0])} or null"
    return getattr(tp, "__name__", str(tp))


def _lookup_type(key: str):
    cls = tp = JobConfig
    for part in key.split("."):
        hints = typing.get_type_hints(cls) if dataclasses.is_dataclass(cls) else {}
        if part not in hints:
            return None
        tp = cls = hints[part]
    return tp


def keys_named(name: str, cls: Any = JobConfig, prefix: str = "") -> list[str]:
    """The dotted keys of the schema whose last part is ``name``.

    Args:
      name: a key's last part (``"steps"``).
      cls: the section to search (default: the whole config).
      prefix: the section's dotted path.

    Returns:
      The keys, in the schema's order (``keys_named("lr") == ["optimizer.lr"]``).
    """
    found = []
    for key, tp in typing.get_type_hints(cls).items():
        path = f"{prefix}.{key}" if prefix else key
        found += keys_named(name, tp, path) if dataclasses.is_dataclass(tp) else [path] * (key == name)
    return found


def _check_keys(node: Any, cls, prefix: str, source: str) -> None:
    """Unknown (or renamed) keys and non-mapping sections, named by their dotted path."""
    hints = typing.get_type_hints(cls)
    where = f"under '{prefix}'" if prefix else "at the top level"
    if not isinstance(node, Mapping):
        raise ConfigError(f"{source}: '{prefix}' must be a mapping with keys {', '.join(hints)}; "
                          f"got {node!r}.")
    for key, value in node.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if path in RENAMED:
            raise ConfigError(f"{source}: '{path}' was renamed to '{RENAMED[path]}'; write "
                              f"{RENAMED[path].split('.')[-1]}: {value} under '{prefix}'.")
        if key not in hints:
            raise ConfigError(f"{source}: unknown key '{path}'; allowed keys {where}: {', '.join(hints)}.")
        if dataclasses.is_dataclass(hints[key]):
            _check_keys(value, hints[key], path, source)


def _absolute_imports(layer: dict, base: Path) -> dict:
    """Make the ``.py`` file part of ``model.target`` / ``model.loss`` / ``data.target``
    absolute, relative to ``base`` (the directory of the config file that names it)."""
    for section, key in IMPORT_KEYS:
        node = layer.get(section)
        value = node.get(key) if isinstance(node, dict) else None
        if isinstance(value, str) and ":" in value:
            module, _, attr = value.rpartition(":")
            if module.endswith(".py") and not Path(module).expanduser().is_absolute():
                node[key] = f"{(base / module).resolve()}:{attr}"
    return layer


def parse_overrides(items: Sequence[str]) -> dict:
    """``["mesh.tensor=2", "optimizer.lr=3e-4"]`` -> nested dict (values parsed as YAML).

    Args:
      items: ``key=value`` strings with dotted keys (``base`` is not allowed).

    Returns:
      The nested dict, e.g. ``{"mesh": {"tensor": 2}}``; a malformed item raises :class:`ConfigError`.
    """
    for item in items:
        key = item.split("=", 1)[0].strip()
        if "=" not in item or not key:
            raise ConfigError(f"override {item!r}: expected key=value with a dotted key, e.g. mesh.tensor=2.")
        if key == "base":
            raise ConfigError(f"override {item!r}: 'base' is only allowed inside a YAML file.")
    try:
        return OmegaConf.to_container(OmegaConf.from_dotlist(list(items)), resolve=False)
    except OmegaConfBaseException as e:
        raise ConfigError(f"overrides: {str(e).splitlines()[0]}") from None


def _last_target(layers: Sequence[tuple[str, Mapping]], section: str, keys: Sequence[str] = ("target",)) -> int:
    """Index of the last layer that sets ``<section>.target`` (or another of ``keys``; 0 if none)."""
    return max((i for i, (_, layer) in enumerate(layers)
                if isinstance(layer.get(section), Mapping) and any(k in layer[section] for k in keys)), default=0)


def _drop_inherited(layers: Sequence[tuple[str, Mapping]]) -> list[tuple[str, Mapping]]:
    """Before the last layer that sets ``model.target`` drop the ``model`` sections (before one that sets
    ``model.hf``, all but their ``seq_len``, ``remat``, ``scan_layers`` and ``loss_chunks``); before the last that sets
    ``data.target`` drop ``data.kwargs`` (arguments belong to the target that a layer names)."""
    model, data, out = _last_target(layers, "model", ("target", "hf")), _last_target(layers, "data"), []
    keep = HF_MODEL_KEYS[2:] if layers and "target" not in (layers[model][1].get("model") or {}) else ()
    for i, (source, layer) in enumerate(layers):
        layer = {k: v if k != "model" or i >= model else {n: x for n, x in v.items() if n in keep}
                 for k, v in layer.items()}
        if i < data and isinstance(layer.get("data"), Mapping) and "kwargs" in layer["data"]:
            layer["data"] = {k: v for k, v in layer["data"].items() if k != "kwargs"}
        out.append((source, layer))
    return out


def _check_user_model(cfg: JobConfig, sections: Sequence[tuple[str, Mapping]]) -> None:
    """GPT keys given next to ``model.target`` (in ``sections``, the model sections from the layer that
    sets it on) are an error naming them."""
    given: dict[str, list[str]] = {}
    for source, section in sections:
        given.setdefault(source, []).extend(f"model.{k}" for k in section if k in GPT_KEYS)
    if where := "; ".join(f"{source}: {', '.join(keys)}" for source, keys in given.items() if keys):
        raise ConfigError(f"{where}: keys of the built-in GPT, but model.target={cfg.model.target!r} names a "
                          "model of your own; pass its arguments in model.kwargs (e.g. model.kwargs.layers=4) "
                          "and remove these keys.")


def _check_hf_model(cfg: JobConfig, sections: Sequence[tuple[str, Mapping]]) -> None:
    """Keys beside ``model.hf`` other than :data:`HF_MODEL_KEYS` (in ``sections``, the model sections from
    the layer that sets it on) are an error naming them."""
    given = [(source, f"model.{k}") for source, section in sections for k in section if k not in HF_MODEL_KEYS]
    if given:
        where = "; ".join(f"{source}: {key}" for source, key in given)
        raise ConfigError(f"{where}: set beside model.hf={cfg.model.hf!r}, whose config.json fixes the model; "
                          "beside it only model.seq_len (the data's windows), model.remat, model.scan_layers, "
                          "model.loss_chunks and "
                          f"model.name (a label) may be set. Remove {', '.join(k for _, k in given)}.")


def merge_layers(layers: Sequence[tuple[str, Mapping]], name: str = "") -> JobConfig:
    """Merge ``(source, mapping)`` layers, later wins, onto the :class:`JobConfig` schema.

    A layer that sets ``model.target`` starts the ``model`` section afresh: the model keys of the
    layers before it (e.g. a GPT base config) do not carry over. GPT keys given in that layer or a
    later one, next to a ``model.target``, are an error that names them. A layer that sets ``model.hf``
    keeps only ``seq_len``, ``remat``, ``scan_layers`` and ``loss_chunks`` of the layers before it, and any other model
    key from it on is an error. Likewise a layer that sets ``data.target`` drops the ``data.kwargs``
    of the layers before it.

    Args:
      layers: ``(source, mapping)`` pairs, base first; ``source`` names the layer in errors.
      name: the config's name when no layer sets one (default ``out_dir``: ``runs/<name>``).

    Returns:
      The :class:`JobConfig`: its keys, types and import paths checked; :func:`check` checks the rest.
    """
    for source, layer in layers:
        _check_keys(layer, JobConfig, "", source)
    fresh = _last_target(layers, "model", ("target", "hf"))
    merged: DictConfig = OmegaConf.structured(JobConfig)
    OmegaConf.set_readonly(merged, False)
    for source, layer in _drop_inherited(layers):
        try:
            merged = OmegaConf.merge(merged, layer)
        except OmegaConfBaseException as e:
            key = getattr(e, "full_key", None) or "?"
            tp = _lookup_type(key)
            expected = f"; expected {_type_name(tp)}" if tp is not None else ""
            reason = str(e).splitlines()[0].rstrip(".")
            raise ConfigError(f"{source}: invalid value for '{key}': {reason}{expected}.") from None
    try:
        cfg: JobConfig = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        raise ConfigError(f"config: '{getattr(e, 'full_key', '?')}': {str(e).splitlines()[0]}") from None
    sections = [(s, layer["model"]) for s, layer in layers[fresh:] if isinstance(layer.get("model"), Mapping)]
    label = None          # model.name's default: the directory's or the target's name
    if cfg.model.hf is not None:
        _check_hf_model(cfg, sections)
        label = Path(cfg.model.hf).name or "hf"
    elif cfg.model.target is not None:
        _check_user_model(cfg, sections)
        label = cfg.model.target.rpartition(":")[2].rpartition(".")[2]
    if label and not any("name" in section for _, section in sections):
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, name=label))
    if not cfg.name and name:
        cfg = dataclasses.replace(cfg, name=name)
    if not cfg.train.out_dir:
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, out_dir=f"runs/{cfg.name or 'job'}"))
    if not cfg.checkpoint.dir:
        cfg = dataclasses.replace(cfg, checkpoint=dataclasses.replace(
            cfg.checkpoint, dir=str(Path(cfg.train.out_dir) / "checkpoints")))
    return cfg


def _yaml_chain(path: Path, seen: tuple[Path, ...] = ()) -> list[tuple[str, dict]]:
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} not found.")
    if path.resolve() in seen:
        chain = " -> ".join(str(p) for p in seen + (path.resolve(),))
        raise ConfigError(f"{path}: 'base' inheritance cycle: {chain}.")
    try:
        raw = OmegaConf.load(path)
    except Exception as e:  # yaml.YAMLError and OmegaConf errors
        raise ConfigError(f"{path}: cannot parse YAML: {e}") from None
    data = OmegaConf.to_container(raw, resolve=False) if raw is not None else {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping (model:, mesh:, ...).")
    base = data.pop("base", None)
    chain: list[tuple[str, dict]] = []
    if base is not None:
        if not isinstance(base, str) or not base:
            raise ConfigError(f"{path}: 'base' must be a path to another YAML file (relative to this one).")
        chain = _yaml_chain(path.parent / base, seen + (path.resolve(),))
    return chain + [(str(path), _absolute_imports(data, path.parent))]


def load_config(path: str | Path, overrides: Sequence[str] = (), *, checked: bool = True) -> JobConfig:
    """Load ``path`` (following ``base:``), apply dotted ``overrides``, check, and return a :class:`JobConfig`.

    A ``.py`` file in an import path (``model.target: vit.py:ViT``) is relative to the YAML file
    that names it; in an override, to the working directory. The resolved config holds it absolute.

    Args:
      path: the YAML file.
      overrides: dotted ``key=value`` strings (:func:`parse_overrides`), applied last; ``~key`` drops a key from
        the YAML files, so that its default holds; ``key={}`` empties a mapping the files set (``parallel.fp8={}``:
        FP8 off), where another mapping is merged into theirs.
      checked: run :func:`check` (``False``: a command that checks it on its devices once, ``jaxpar train``; its
        keys, types and import paths are checked all the same).

    Returns:
      The checked :class:`JobConfig`; a problem raises :class:`ConfigError`.
    """
    path = Path(path)
    removed = [item[1:].strip() for item in overrides if item.startswith("~")]
    emptied = [key for key in map(_emptied_key, overrides) if key]    # key={}: the files' mapping replaced, not merged
    for key in removed:
        if _lookup_type(key) is None:
            raise ConfigError(f"override ~{key}: unknown key; '~' drops a key of the schema (e.g. ~optimizer.muon), "
                              "so that its default holds.")
    layers = [(source, _without(layer, removed + emptied)) for source, layer in _yaml_chain(path)]
    if overrides := [item for item in overrides if not item.startswith("~")]:
        layers.append(("overrides", _absolute_imports(parse_overrides(overrides), Path.cwd())))
    cfg = merge_layers(layers, name=path.stem)
    if checked:
        check(cfg)
    return cfg


def _emptied_key(item: str) -> str | None:
    """The key of an override ``key={}`` (an empty mapping), else None."""
    key, eq, value = item.partition("=")
    if not eq or item.startswith("~"):
        return None
    try:
        empty = yaml.safe_load(value) == {}
    except yaml.YAMLError:
        return None
    return key.strip() if empty else None


def _without(layer: Mapping, keys: Sequence[str]) -> dict:
    """``layer`` without the dotted ``keys`` (``~key`` overrides: the schema's default holds then)."""
    out = dict(layer)
    for key in keys:
        head, _, rest = key.partition(".")
        if head in out and not rest:
            del out[head]
        elif isinstance(out.get(head), Mapping):
            out[head] = _without(out[head], [rest])
    return out


def to_yaml(cfg: JobConfig, *, defaults: bool = True) -> str:
    """The resolved config as YAML (loadable again with :func:`load_config`); the ``model`` section
    holds the GPT's keys, the user model's or those beside ``model.hf``, not several.

    Args:
      cfg: a resolved config.
      defaults: write every key; ``False``: only those whose value is not the schema's default (the file
        loads to the same config).

    Returns:
      The YAML text.
    """
    data, m = OmegaConf.to_container(OmegaConf.structured(cfg)), cfg.model
    keep = HF_MODEL_KEYS if m.hf is not None else ("name", *(USER_MODEL_KEYS if m.target is not None else GPT_KEYS))
    data["model"] = {k: v for k, v in data["model"].items() if k in keep}
    if not defaults:
        data = _changed(data, OmegaConf.to_container(OmegaConf.structured(JobConfig())))
    return OmegaConf.to_yaml(data)


def _changed(data: dict, default: dict) -> dict:
    """The entries of ``data`` whose value is not ``default``'s (sections compared key by key)."""
    out = {}
    for key, value in data.items():
        if isinstance(value, dict) and value and isinstance(default.get(key), dict):
            if inner := _changed(value, default[key]):
                out[key] = inner
        elif key not in default or value != default[key]:
            out[key] = value
    return out
