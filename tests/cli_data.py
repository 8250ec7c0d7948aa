"""A synthetic classification task for the config tests (named by a YAML file as ``cli_data.py:classes``).

``classes(step, *, batch_size, seed, eval=False, features, classes)``: noisy copies of ``classes``
fixed random prototypes, labelled by prototype; a pure function of ``(seed, step, eval)``.
The batch matches :func:`jaxpar.models.classifier_loss`: ``{'x': f32[B, features], 'y': i32[B]}``.
"""
import numpy as np


def classes(step: int, *, batch_size: int, seed: int = 0, eval: bool = False, features: int = 16,
            classes: int = 4) -> dict:
    prototypes = np.random.default_rng(seed).normal(size=(classes, features))
    rng = np.random.default_rng([seed, step, int(eval)])
    y = rng.integers(0, classes, batch_size)
    x = prototypes[y] + rng.normal(scale=0.5, size=(batch_size, features))
    return {"x": x.astype(np.float32), "y": y.astype(np.int32)}


def no_eval(step: int, *, batch_size: int, seed: int = 0) -> dict:
    """Batches without an ``eval`` keyword: the run has no evaluation."""
    return classes(step, batch_size=batch_size, seed=seed)


def wrong_rows(step: int, *, batch_size: int, seed: int = 0) -> dict:
    """A broken batch function: one row short."""
    return classes(step, batch_size=batch_size - 1, seed=seed)


NOT_CALLABLE = 3
