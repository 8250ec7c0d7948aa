"""The data section's checks, without reading a file: its kind and sizes, a batch function of your own
(``data.kind: import``), and a corpus of documents (:func:`jaxpar.config._documents.documents_problems`)."""

from __future__ import annotations

from jaxpar.data._tokens import TOKEN_DTYPES
from jaxpar.config._documents import documents_problems
from jaxpar.config._imports import call_problem, resolve_import
from jaxpar.config._problems import at_least, choice, collect
from jaxpar.config._schema import DATA_KINDS, DataConfig, JobConfig

_RESERVED_DATA_KWARGS = ("step", "batch_size", "seed", "eval", "rows")


def data_problems(cfg: JobConfig) -> list[str]:
    """What is wrong with ``cfg.data`` (and how it fits the model, for ``data.kind: documents``).

    Args:
      cfg: the whole config.

    Returns:
      One line per problem, each naming its YAML key; empty when there is none.
    """
    d, p = cfg.data, []
    choice(p, "data.kind", d.kind, DATA_KINDS)
    choice(p, "data.token_dtype", d.token_dtype, TOKEN_DTYPES)
    at_least(p, "data.batch_size", d.batch_size, 1)
    at_least(p, "data.max_bytes", d.max_bytes, 1)
    if not 0 <= d.eval_fraction < 1:
        p.append(f"data.eval_fraction={d.eval_fraction!r}: must be in [0, 1).")
    for key in ("bos", "eos"):
        if not (isinstance(value := getattr(d, key), bool) or value == "auto"):
            p.append(f"data.{key}={value!r}: choose true, false or auto (what the tokenizer's own post-processor "
                     "adds, as transformers' tokenizer(text) does).")
    if d.kind == "import":
        _import_problems(p, d)
    return p + documents_problems(cfg)


def _import_problems(p: list[str], d: DataConfig) -> None:
    if d.target is None:
        p.append("data.target: missing; data.kind=import needs the batch function, 'package.module:batches' or "
                 "'path/to/file.py:batches', called as batches(step, batch_size=, seed=, **data.kwargs).")
        return
    for key in _RESERVED_DATA_KWARGS:
        if key in d.kwargs:
            fix = f"set data.{key} instead" if key in ("batch_size", "seed") else "jaxpar passes it"
            p.append(f"data.kwargs.{key}: reserved ({fix}); remove it.")
    if (fn := collect(p, lambda: resolve_import(d.target, "data.target"))) is not None and not any(
            k in d.kwargs for k in _RESERVED_DATA_KWARGS):
        if why := call_problem(fn, 0, batch_size=d.batch_size, seed=d.seed, **d.kwargs):
            p.append(f"data.target={d.target!r}: is called as batches(step, batch_size=data.batch_size, "
                     f"seed=data.seed, **data.kwargs), which does not fit it: {why}.")
