"""Preemption: a SIGTERM / SIGINT stops training after a step, the same step in every process.

* :func:`catch_stop_signals` records a signal from now on (start-up, restore,
  compilation); the next :class:`StopSignals` block counts it as received.
* :class:`StopSignals` (one ``with`` block per :func:`~jaxpar.run.train`
  call) records the first SIGTERM / SIGINT instead of dying; a second SIGINT interrupts.
* :class:`StopAgreement`: with several processes a signal may reach only one of them
  (one evicted pod / node); after a step they agree through JAX's coordination service
  (a barrier and a key-value read, host only) whether any of them was signalled.

Example (the loop of :func:`~jaxpar.run.train`, reduced)::

    >>> import signal
    >>> agreement = StopAgreement(every=10)
    >>> with StopSignals() as signals:
    ...     for step in range(0, 100):
    ...         if step == 2:                    # stands for state, _ = step_fn(state, batch_fn(step))
    ...             signal.raise_signal(signal.SIGTERM)   # the job is evicted during step 2
    ...         if agreement.check(step + 1, signals.received) is not None:
    ...             break                    # every process stops here: save a checkpoint of step + 1
    >>> step + 1, signals.received
    (3, 'SIGTERM')
"""

from __future__ import annotations

import itertools
import signal
import threading
from typing import Any

import jax

from jaxpar.errors import DistributedError

_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_DEFAULT_HANDLERS = {signal.SIGTERM: signal.SIG_DFL, signal.SIGINT: signal.default_int_handler}


def _on_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


class _Catcher:
    """A signal handler that records the first SIGTERM / SIGINT in ``received``; a second SIGINT interrupts."""

    received: str | None = None

    def __call__(self, signum, frame) -> None:
        if self.received is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.received = signal.Signals(signum).name


#: Owned by this module: installed by catch_stop_signals(), emptied by the next StopSignals.__enter__.
_early = _Catcher()


def catch_stop_signals() -> None:
    """Record a SIGTERM / SIGINT from now on: the next :func:`~jaxpar.run.train` stops after
    its first step, with a checkpoint. For jobs of several processes, where JAX's own preemption
    notifier (installed by ``jax.distributed.initialize``) would swallow such a SIGTERM.
    Main thread only; a second SIGINT interrupts.

    Example::

        >>> import signal
        >>> catch_stop_signals()                 # first thing (after jax.distributed.initialize, if any)
        >>> signal.raise_signal(signal.SIGTERM)  # arrives during restore / compilation: recorded, not fatal
        >>> with StopSignals() as signals:       # the loop starts: it counts as received
        ...     signals.received
        'SIGTERM'
        >>> signal.getsignal(signal.SIGTERM) is signal.SIG_DFL   # the early catcher is gone again
        True
    """
    if _on_main_thread():
        for sig in _SIGNALS:
            signal.signal(sig, _early)


class StopSignals(_Catcher):
    """Within ``with``: record the first SIGTERM / SIGINT in ``received`` instead of dying (main
    thread only, ``enabled``); a second SIGINT interrupts. A signal recorded earlier by
    :func:`catch_stop_signals` counts as received. On exit the previous handlers come back,
    except the early catcher, which lasts until the loop starts, not after it.

    Args:
      enabled: False (or off the main thread): install nothing; ``received`` stays None.

    Example::

        >>> with StopSignals() as signals:
        ...     pass                                 # run steps; check signals.received after each
        >>> signals.received is None
        True
    """

    def __init__(self, enabled: bool = True):
        self.enabled = enabled and _on_main_thread()
        self._old: dict = {}

    def __enter__(self) -> "StopSignals":
        if self.enabled:
            for sig in _SIGNALS:
                self._old[sig] = signal.signal(sig, self)
            self.received, _early.received = _early.received, None
        return self

    def __exit__(self, *exc) -> None:
        for sig, old in self._old.items():
            # None: a handler not installed from Python; nothing to give back, so the default
            signal.signal(sig, _DEFAULT_HANDLERS[sig] if old is _early or old is None else old)
        self._old = {}


def coordination_client() -> Any:
    """JAX's coordination-service client (key-value store and barriers), or None with one process.

    The one place jaxpar's loop reads it. JAX 0.10.2 has no public accessor: ``jax.distributed``
    offers only ``initialize`` / ``shutdown`` / ``is_initialized``, and
    ``jax.experimental.multihost_utils.sync_global_devices`` is a device collective (it would wait
    for the device), while the stop agreement must stay on the host. Orbax and
    ``multihost_utils`` itself read the same private ``global_state.client``.

    Returns:
      The client of ``jax.distributed``'s global state, or None when ``jax.process_count() == 1``.
    """
    if jax.process_count() == 1:
        return None
    from jax._src import distributed  # private, see above

    return distributed.global_state.client


#: StopAgreement objects made in this process; one per train() call, so the same count in every process.
_agreements = itertools.count(1)


class StopAgreement:
    """With several processes: agree after a step whether any process got SIGTERM / SIGINT.

    Each signalled process puts ``jaxpar/stop/<call>/<step>/<process>`` into the
    coordination service's key-value store, then every process waits at one
    barrier and lists ``jaxpar/stop/<call>/<step>/``. Keys are only written before
    the barrier, so every process reads the same set: all stop after the same step.
    Host only (no device sync). One process: the local signal, nothing else.

    Args:
      every: agree every this many steps (the ``step`` values given to :meth:`check`).
      client: the coordination client (default: :func:`coordination_client`; None with one process).

    Example::

        >>> agreement = StopAgreement(every=10)      # one process here
        >>> agreement.check(3, "SIGTERM"), agreement.check(4, None)
        ('SIGTERM', None)
    """

    BARRIER_TIMEOUT_S = 3600

    def __init__(self, every: int, client: Any = None):
        self.every = every
        self.client = coordination_client() if client is None else client
        self.prefix = f"jaxpar/stop/{next(_agreements)}"
        self.processes: list[int] = []        # who was signalled (several processes only)

    def check(self, step: int, local: str | None, due: bool = False) -> str | None:
        """The signal that stops every process after ``step``; every process calls it with the same ``step``.

        Args:
          step: the step just finished.
          local: the signal this process received (``"SIGTERM"`` / ``"SIGINT"``), or None.
          due: agree now even off the ``every`` grid (the same in every process).

        Returns:
          The name of the stopping signal (the lowest signalled process's), or None: go on.
        """
        if self.client is None:
            return local
        if step % self.every and not due:
            return None
        if local is not None:
            self.client.key_value_set(f"{self.prefix}/{step}/{jax.process_index()}", local, allow_overwrite=True)
        try:
            self.client.wait_at_barrier("jaxpar_stop", self.BARRIER_TIMEOUT_S * 1000)
        except Exception as e:  # noqa: BLE001 - JaxRuntimeError from the coordination service
            raise DistributedError(f"train: step {step}: the processes could not agree on stopping (a peer died or "
                               f"did not reach step {step} within {self.BARRIER_TIMEOUT_S} s): {e}") from e
        entries = self.client.key_value_dir_get(f"{self.prefix}/{step}/")
        found = sorted((int(key.rstrip("/").rsplit("/", 1)[-1]), value) for key, value in entries)
        if not found:
            return None
        self.processes = [pid for pid, _ in found]
        return found[0][1]
