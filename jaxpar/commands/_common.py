"""What several commands do with their config: build its job on the processes' devices (:func:`config_job`),
check the files it reads before anything runs (:func:`check_inputs`), and read the steps to show or trace
(``--steps A:B``: :func:`parse_steps`; ``train.profile``: :func:`profile_steps`).
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

from jaxpar.config._job import build_job, hf_checkpoint
from jaxpar.config._load import load_config
from jaxpar.config._schema import ConfigError, DataConfig
from jaxpar.data._windows import expand_paths
from jaxpar.devices._distributed import start_processes


def config_job(config: str, overrides: Sequence[str], command: str, dist: dict | None = None, *, data: bool = False):
    """``(cfg, job)`` of the run's config, on its devices (``dist``: the process options of ``jaxpar train``;
    ``data``: the data read too)."""
    cfg = load_config(config, list(overrides))
    if command == "export" and cfg.model.hf is None:
        raise ConfigError("jaxpar export: model.hf is not set; export writes a Hugging Face checkpoint of a model "
                          "imported from one (model.hf: its directory). jaxpar's GPT and models of your own "
                          "(model.target) have no Hugging Face layout to write.")
    if command == "sample" and cfg.model.target is not None:
        raise ConfigError(f"jaxpar sample: model.target={cfg.model.target!r} is a model of your own, whose inputs "
                          "and outputs jaxpar does not know; sample continues text with jaxpar's GPT or model.hf.")
    start_processes(**{k: v for k, v in (dist or {}).items() if v is not None}, devices=cfg.train.devices)
    return cfg, build_job(cfg, data=data)


def check_inputs(cfg: Any) -> str:
    """The files the config reads, checked before the run directory: ``model.hf``'s checkpoint (opened: its
    ``config.json`` and safetensors headers) and the data files (found, not read); a missing one raises.

    Args:
      cfg: the checked config.

    Returns:
      The data files found, in words (empty: the config names none).
    """
    hf_checkpoint(cfg, None)
    return _check_data_files(cfg.data)


def _check_data_files(d: DataConfig) -> str:
    """The files of ``data.paths`` / ``data.sources`` found (none read), in words; a missing one raises."""
    from jaxpar.data.sources import resolve_paths

    if d.kind in ("text", "tokens") and d.paths:
        return f"data     {len(expand_paths(d.paths))} file(s) of data.paths found (not read: jaxpar data show)"
    if d.kind == "documents" and d.sources:
        found = []
        for i, source in enumerate(d.sources):
            try:
                found += resolve_paths(source.get("path"))
            except Exception as e:      # SourceError: named by its key
                raise ConfigError(f"data.sources[{i}] (path {source.get('path')!r}): {e}") from None
        return f"data     {len(found)} path(s) of data.sources found (not read: jaxpar data show)"
    return ""


def parse_steps(text: str) -> tuple[int, int]:
    """``--steps A:B`` as ``(A, B)``: the steps ``A .. B-1``.

    Args:
      text: ``"A:B"``.

    Returns:
      ``(A, B)``.

    Raises:
      ConfigError: not ``A:B`` with ``0 <= A < B``.

    >>> parse_steps("2:4")
    (2, 4)
    """
    try:
        a, b = (int(v) for v in text.split(":"))
    except ValueError:
        raise ConfigError(f"--steps {text!r}: expected A:B, e.g. --steps 2:4 (the steps A .. B-1).") from None
    if not 0 <= a < b:
        raise ConfigError(f"--steps {text!r}: need 0 <= A < B (the steps A .. B-1).")
    return a, b


def profile_steps(profile: Mapping[str, Any]) -> tuple[int, int] | None:
    """``train.profile``'s steps: ``{steps: [A, B]}`` -> ``(A, B)``; ``{}`` -> None.

    Args:
      profile: the config's ``train.profile``.

    Returns:
      ``(A, B)`` or None.

    Raises:
      ConfigError: another key, or steps that are not two integers ``0 <= A < B``.

    >>> profile_steps({"steps": [3, 5]}), profile_steps({})
    ((3, 5), None)
    """
    if not profile:
        return None
    steps = profile.get("steps")
    ok = (set(profile) == {"steps"} and isinstance(steps, (list, tuple)) and len(steps) == 2
          and all(isinstance(s, int) and not isinstance(s, bool) for s in steps) and 0 <= steps[0] < steps[1])
    if not ok:
        raise ConfigError(f"train.profile={dict(profile)!r}: expected {{steps: [A, B]}} with 0 <= A < B, the steps "
                          "A .. B-1 to trace (e.g. train.profile.steps=[2,4]); {} traces none.")
    return int(steps[0]), int(steps[1])

