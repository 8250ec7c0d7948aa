"""A batch function whose process stops at one step (tests/test_watchdog.py): ``cli_data.py:classes``'s
batches, except that process ``stall_process`` sleeps for an hour when asked for step ``stall_step``, as a data
loader that never returns. The other processes then wait in the step's collectives for it."""
import time

import jax

from cli_data import classes


def stalls(step: int, *, batch_size: int, seed: int = 0, eval: bool = False, stall_step: int = 3,
           stall_process: int = 1, features: int = 16, classes_: int = 4) -> dict:
    if not eval and step == stall_step and jax.process_index() == stall_process:
        time.sleep(3600)
    return classes(step, batch_size=batch_size, seed=seed, eval=eval, features=features, classes=classes_)
