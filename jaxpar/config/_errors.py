"""The errors that jaxpar's commands report as a usage error (exit status 2, one line on stderr): every
:class:`~jaxpar.errors.JaxparError`, an input (a config, data, mesh, rule, checkpoint, target or a
combination of features) that jaxpar has named as wrong, with the fix."""

from __future__ import annotations

from jaxpar.errors import JaxparError


def user_errors() -> tuple[type[Exception], ...]:
    """The exception classes a command prints as ``jaxpar COMMAND: error: ...``.

    Returns:
      ``(JaxparError,)``: the base of every error jaxpar raises (:mod:`jaxpar.errors`); anything else
      (a bug, an error of JAX or of the user's own code) keeps its traceback.

    Example:
      >>> from jaxpar.errors import DataError, SyncError
      >>> issubclass(DataError, user_errors()) and issubclass(SyncError, user_errors())
      True
      >>> issubclass(KeyError, user_errors())
      False
    """
    return (JaxparError,)
