"""The compatibility table's rules of memory offloading (``Strategy.offload``, feature ``OF``).

Offloading changes where the state lives between steps, not what a step computes: every program that
:func:`jaxpar.make_train_step` composes streams the offloaded fields to the device first. Relaxed
synchronisation is the exception: its replicas' parameters and moments live in ``TrainState.sync``,
and the local kinds run inner and outer programs of their own, which offloading does not place. Offloaded
activations do not run in a pipeline, which keeps every micro-batch's residuals in one device buffer; the
host update (``Offload.update="host"``) does not run inside weight stashing's pipeline.

Example:
    >>> from jaxpar import Strategy
    >>> from jaxpar.options import Offload
    >>> from jaxpar.parallel.sync import synchronous
    >>> s = Setting(Strategy(sync=synchronous(), offload=Offload(optimizer=True)), {"replica": 2})
    >>> [(p.features, p.error.__name__) for p in offload_problems(s)]
    [(('RS', 'OF'), 'OffloadError')]
"""
from __future__ import annotations

from jaxpar.compat._settings import NO_FLUSH, Problem, Setting, replicas_on, value_name
from jaxpar.errors import OffloadError

#: The optimizers of ``optimizer.name`` whose update does not run in host memory (``Offload.update="host"``:
#: they create device arrays beside the host-resident state, an ``OffloadError`` when the step is traced;
#: tests/test_offload_cost.py checks this list against every optimizer). The planner proposes no host update
#: for them.
HOST_UPDATE_REFUSED = ("lars", "lamb", "muon")


def offload_problems(s: Setting) -> list[Problem]:
    """Offloading against relaxed synchronisation (RS x OF), offloaded activations against pipelines
    (PP / 2B / ST x OF: the optimizer state and the master weights compose), and the host update against
    weight stashing (ST x OF: its per-stage updates run inside the pipeline).

    Args:
      s: the setting.

    Returns:
      The pair's :class:`Problem`, or none.
    """
    offload = s.strategy.offload
    if offload is None:
        return []
    out = []
    if offload.activations and s.size("pipe") > 1:
        code = NO_FLUSH.get(s.strategy.schedule, "PP")
        out.append(Problem((code, "OF"), ("offload", "schedule", "pipe"),
                           "{n[offload]}.activations={names} with {n[schedule]}={sched!r} on {n[pipe]}={p}: a pipeline "
                           "keeps each micro-batch's residuals in one buffer on the device, which a residual offloaded "
                           "to host memory cannot be written into. Offload the optimizer state and the master weights "
                           "only (activations=()), or use the remat policy 'full'.",
                           {"names": offload.activations, "sched": s.strategy.schedule, "p": s.size("pipe")},
                           OffloadError))
    if offload.update == "host" and s.strategy.schedule == "pipedream" and s.size("pipe") > 1:
        out.append(Problem(("ST", "OF"), ("offload", "schedule", "pipe"),
                           "{n[offload]}.update='host' with {n[schedule]}='pipedream' on {n[pipe]}={p}: weight "
                           "stashing updates each stage inside the pipeline, on the device, between its micro-batches, "
                           "where no host computation runs. Use update='device' (the offloaded state is streamed in), "
                           "or another schedule.", {"p": s.size("pipe")}, OffloadError))
    if not replicas_on(s):
        return out
    return out + [Problem(("RS", "OF"), ("sync", "offload"),
                    "{n[offload]}={o!r} with {n[sync]}={sync} on {n[replica]}={r}: relaxed synchronisation keeps each "
                    "replica's parameters and optimizer state in TrainState.sync and runs programs of its own, which "
                    "offloading does not place in host memory. Drop {n[offload]}, or fold the replicas into the data "
                    "axis.", {"o": offload.label, "sync": value_name(s.strategy.sync or "sync"), "r": s.size("replica")},
                    OffloadError)]
