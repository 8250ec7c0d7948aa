"""A training run around the step: the loop, checkpoints, preemption, reports, ramps and samples."""
from jaxpar.run._loop import train as train
from jaxpar.errors import NonFiniteError as NonFiniteError
from jaxpar.run._summary import LogOptions as LogOptions
from jaxpar.run._checkpoint import Checkpointer as Checkpointer, CheckpointWarning as CheckpointWarning
from jaxpar.run._resume import train_with_checkpoints as train_with_checkpoints
from jaxpar.run._sample import greedy_generate as greedy_generate
from jaxpar.run._ramp import AdaptiveRamp as AdaptiveRamp, BatchRamp as BatchRamp, ramp_batch_fn as ramp_batch_fn
from jaxpar.run._same_program import SameProgram as SameProgram
from jaxpar.run._goodput import Goodput as Goodput
from jaxpar.run._watchdog import HUNG_EXIT as HUNG_EXIT, Watchdog as Watchdog

__all__ = ["train", "LogOptions", "NonFiniteError", "Checkpointer", "CheckpointWarning", "train_with_checkpoints",
           "greedy_generate", "AdaptiveRamp", "BatchRamp", "ramp_batch_fn", "SameProgram", "Goodput",
           "Watchdog", "HUNG_EXIT"]
