"""Mixture of experts with expert parallelism (EP) over an ``expert`` mesh axis.

- :mod:`jaxpar.parallel.moe._routing`: top-k softmax / sigmoid gates, the per-group capacity rule, the
  load-balancing and z losses, the aux-loss-free bias update and the per-call statistics.
- :mod:`jaxpar.parallel.moe._dispatch`: the dense capacity dispatch, and EP (two ``all_to_all`` over ``expert``
  in a ``shard_map``) when the rules shard the ``experts`` logical axis; the experts' MLPs, plain
  ``act(x w1) w2`` or gated ``(act(x w1) * (x w3)) w2`` (SwiGLU with ``activation="silu"``).
- :mod:`jaxpar.parallel.moe._grouped`: the experts' GEMMs as grouped Pallas Triton kernels on a GPU mesh
  (:func:`use_moe_kernel` picks them or the tile loop).
- :mod:`jaxpar.parallel.moe._layer`: :func:`moe_apply` (a pure function of a parameter dict) and :class:`MoE`.
- :mod:`jaxpar.parallel.moe._balance`: inside a train step each layer reports its load and balances with
  the whole step's (micro-batches, pipelines), with nothing in the user's loss.

Without rules (or with ``experts`` unsharded) the layer is one dense computation: the reference that
every sharded run equals, drops included (capacity is per batch row, which no strategy splits).

>>> import jax, jax.numpy as jnp, jaxpar
>>> from flax import nnx
>>> layer = MoE(embed=4, mlp=8, experts=4, top_k=2, capacity_factor=1.0, rngs=nnx.Rngs(0))
>>> x = jax.random.normal(jax.random.key(1), (4, 6, 4))
>>> y1, s1 = layer(x)                                        # one device: the reference
>>> mesh = jaxpar.make_mesh({"expert": 4}, devices=jax.devices()[:4])
>>> rules = (("batch", "expert"), ("length", None), ("embed", None), ("mlp", None)) + expert_rules(
...     mesh.axis_names)
>>> with jaxpar.use_rules(mesh, rules):
...     y4, s4 = jax.jit(moe_apply, static_argnames=("top_k", "capacity_factor"))(
...         layer.params(), x, top_k=2, capacity_factor=1.0)
>>> bool(jnp.allclose(y1, y4, atol=1e-6)), int(s1.dropped) == int(s4.dropped)
(True, True)
"""
from jaxpar.parallel.moe._dispatch import (ACTIVATIONS, DROPLESS_SEND_FACTOR, TILE_ROWS, activation_fn, dispatch_combine, expert_rules,
                                         routed_mlp, send_rows, tile_rows)
from jaxpar.parallel.moe._grouped import MOE_KERNELS, current_moe_kernel, use_moe_kernel
from jaxpar.parallel.moe._balance import (LAYER_LOADS, Balance, Probe, balanced, prepass_loads, probe, reported_loads,
                                          use_router_bias, use_step_loads)
from jaxpar.parallel.moe._layer import (MOE_LOGICAL, MoE, MoECalls, count_moe_calls, moe_apply, need_router_bias,
                                        router_bias, shared_mlp)
from jaxpar.errors import moved_getattr
from jaxpar.parallel.moe._routing import (GATES, MoEError, MoEStats, Routing, buffer_slots, capacity, check_options,
                                          load_balancing_loss, load_cv, route, routing_stats, top_k_experts,
                                          update_router_bias)

__all__ = [
    "ACTIVATIONS", "activation_fn", "GATES", "MOE_LOGICAL", "MoE", "MoECalls", "MoEError", "MoEStats", "Routing",
    "count_moe_calls", "use_step_loads", "LAYER_LOADS", "router_bias", "use_router_bias",
    "need_router_bias", "reported_loads", "Balance", "Probe", "balanced", "prepass_loads", "probe",
    "buffer_slots", "capacity", "check_options", "dispatch_combine", "expert_rules", "routed_mlp", "send_rows",
    "TILE_ROWS", "tile_rows", "DROPLESS_SEND_FACTOR", "MOE_KERNELS", "current_moe_kernel", "use_moe_kernel",
    "load_balancing_loss", "load_cv", "moe_apply", "route", "routing_stats", "shared_mlp",
    "top_k_experts", "update_router_bias",
]
__getattr__ = moved_getattr(__name__)     # the names that moved out, for one release (jaxpar.errors.MOVED)
