"""The errors that jaxpar's commands report as a usage error (exit status 2, one line on stderr): a
config, data, mesh, rule, checkpoint or target that jaxpar has named as wrong, with the fix."""

from __future__ import annotations

__all__ = ["user_errors"]


def user_errors() -> tuple[type[Exception], ...]:
    """The exception classes a command prints as ``jaxpar COMMAND: error: ...``.

    >>> from jaxpar.data import DataError
    >>> DataError in user_errors()
    True
    """
    from ..cost import ClusterError, PlanError
    from ..data import DataError
    from ..distributed import DistributedError
    from ..hf import HFExportError
    from ..pipeline.cut import PipelineCutError
    from ..rules import RulesError
    from ..targets import TargetError
    from ..train.checkpoint import CheckpointError
    from ..train.step import ExplicitDPError
    from .schema import ConfigError

    return (ConfigError, ClusterError, PlanError, DistributedError, RulesError, CheckpointError, PipelineCutError,
            ExplicitDPError, TargetError, HFExportError, DataError)
