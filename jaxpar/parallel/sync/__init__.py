"""Relaxed synchronisation of K model replicas on one SPMD mesh (the ``replica`` axis).

What is *exact* here: local SGD / DiLoCo and EASGD (their communication really happens only at
sync steps). What is *simulated* exactly inside one synchronous program: gradient delays
(bounded staleness) and dropped stragglers (backup workers). What is *modelled*: the wall-clock
time those would save (seeded straggler times). See ``docs/relaxed_sync.md``.

    >>> import jaxpar
    >>> from jaxpar.parallel.sync import diloco
    >>> jaxpar.Strategy(sync=diloco(every=20)).name({"replica": 4, "data": 2})
    'r4-dp2-diloco-h20'
"""
from jaxpar.parallel.sync._kinds import (SYNC_KINDS, Backup, DiLoCo, EASGD, Stale, SyncError, Synchronous, backup, check_sync, diloco,
                                         easgd, local_sgd, make_sync, stale, synchronous)

__all__ = ["SYNC_KINDS", "Backup", "DiLoCo", "EASGD", "Stale", "SyncError", "Synchronous", "backup", "check_sync",
           "diloco", "easgd", "local_sgd", "make_sync", "stale", "synchronous"]
