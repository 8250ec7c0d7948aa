"""The mesh axes jaxpar's strategies know, in mesh order (outermost first), without JAX: :mod:`jaxpar.mesh`
builds meshes of them and the cost model (:mod:`jaxpar.cost`) sizes its plans by them.

    >>> AXES.index("pipe") < AXES.index("data") < AXES.index("tensor")
    True
"""

#: The axes every mesh has. ``pipe`` is outermost (least traffic), ``tensor`` innermost (most traffic).
STANDARD_AXES = ("pipe", "data", "fsdp", "tensor")
REPLICA = "replica"   # the outermost axis of relaxed synchronisation (jaxpar.parallel.sync), present only when > 1
CONTEXT = "context"   # the sequence axis of context parallelism (jaxpar.parallel.context), beside tensor, only when > 1
EXPERT = "expert"     # the axis of expert parallelism (jaxpar.parallel.moe), inside the data axes, only when > 1
#: Every axis :class:`jaxpar.MeshSpec` names, in mesh order (``replica``, ``expert`` and ``context`` only when > 1).
AXES = (REPLICA, "pipe", "data", "fsdp", EXPERT, CONTEXT, "tensor")
