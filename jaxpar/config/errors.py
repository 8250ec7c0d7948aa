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
    from jaxpar.cost import ClusterError, PlanError
    from jaxpar.data import DataError
    from jaxpar.devices.distributed import DistributedError
    from jaxpar.hf import HFExportError
    from jaxpar.parallel.pipeline.cut import PipelineCutError
    from jaxpar.rules import RulesError
    from jaxpar.devices.targets import TargetError
    from jaxpar.run.checkpoint import CheckpointError
    from jaxpar.step.compose import ExplicitDPError
    from jaxpar.config.schema import ConfigError

    return (ConfigError, ClusterError, PlanError, DistributedError, RulesError, CheckpointError, PipelineCutError,
            ExplicitDPError, TargetError, HFExportError, DataError)
