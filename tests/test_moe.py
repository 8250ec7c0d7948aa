"""jaxpar.parallel.moe: routing, capacity and losses against an independent loop-over-tokens reference; expert
parallelism (EP 2/4/8, x DP, x FSDP, x TP, nested in a pipe shard_map) against one device, values and
gradients at fp32 1e-5, dropped-token masks equal; the collectives in the compiled HLO; the expert
weights' bytes per device; named errors. Gated (SwiGLU) experts against Hugging Face Qwen3-MoE's
formula written token by token, and under EP (x DP, x TP, x context) against one device."""
import functools
import math
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P
from flax import nnx

import jaxpar
from conftest import need_devices
from jaxpar.analysis import collectives, count, dot_flops
from jaxpar.adapters._loss_metrics import with_reported_metrics
from jaxpar.parallel import add_zero_axes, tensor_rules
from jaxpar.parallel.moe import (MOE_LOGICAL, TILE_ROWS, MoE, MoEError, balanced, capacity, dispatch_combine,
                                 expert_rules, load_cv, moe_apply, route, send_rows, update_router_bias,
                                 use_router_bias)
from jaxpar.rules import logical_to_spec

TOL = dict(rtol=1e-5, atol=1e-5)
AUX_W, Z_W = 0.3, 0.1


def make_params(seed, D, M, E, *, shared=0, bias=False):
    k = jax.random.split(jax.random.key(seed), 6)
    p = {"router": 0.5 * jax.random.normal(k[0], (D, E)), "w1": 0.3 * jax.random.normal(k[1], (E, D, M)),
         "w2": 0.3 * jax.random.normal(k[2], (E, M, D))}
    if shared:
        p["shared_w1"] = 0.3 * jax.random.normal(k[3], (D, shared))
        p["shared_w2"] = 0.3 * jax.random.normal(k[4], (shared, D))
    if bias:
        p["router_bias"] = 0.2 * jax.random.normal(k[5], (E,))
    return p


def make_inputs(seed, G, T, D, lead=()):
    k1, k2 = jax.random.split(jax.random.key(100 + seed))
    return jax.random.normal(k1, (*lead, G, T, D)), jax.random.normal(k2, (*lead, G, T, D))


def moe_loss(params, x, probe, opts):
    """A scalar of the output and both losses; the routing masks ride along (``route`` is the routing
    ``moe_apply`` runs, XLA computes it once)."""
    y, stats = moe_apply(params, x, **opts)
    bias = params.get("router_bias")
    r = route(x, params["router"], top_k=opts["top_k"], gate=opts["gate"], capacity_factor=opts["capacity_factor"],
              normalize=opts.get("normalize", True), bias=None if bias is None else jax.lax.stop_gradient(bias))
    loss = jnp.sum(y * probe) + AUX_W * stats.aux_loss + Z_W * stats.z_loss
    return loss, (y, stats, r.expert, r.slot, r.kept)


def grad_program(opts):
    return jax.jit(jax.value_and_grad(functools.partial(moe_loss, opts=opts), argnums=(0, 1), has_aux=True))


def assert_trees_close(a, b, **tol):
    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b)):
        if jnp.issubdtype(jnp.asarray(x).dtype, jnp.floating):
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), err_msg=jax.tree_util.keystr(path), **tol)
        else:
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=jax.tree_util.keystr(path))


# ----------------------------------------------------------------- the independent reference (tiny shapes)

def np_gelu(v):
    return 0.5 * v * (1 + np.tanh(np.sqrt(2 / np.pi) * (v + 0.044715 * v ** 3)))


def loop_decisions(p, x, *, top_k, gate, capacity_factor, normalize=True):
    """Numpy, token by token: chosen experts, kept flags (rank-major then position priority), output."""
    p = {k: np.asarray(v, np.float64) for k, v in p.items()}
    x = np.asarray(x, np.float64)
    G, T, _ = x.shape
    E = p["router"].shape[1]
    C = T if capacity_factor is None else min(T, math.ceil(capacity_factor * T * top_k / E))
    chosen, kept = np.zeros((G, T, top_k), int), np.zeros((G, T, top_k), bool)
    for g in range(G):
        for t in range(T):
            logits = x[g, t] @ p["router"]
            scores = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum() if gate == "softmax" \
                else 1 / (1 + np.exp(-logits))
            chosen[g, t] = np.argsort(-(scores + p.get("router_bias", 0.0)), kind="stable")[:top_k]
        used = [0] * E
        for j in range(top_k):
            for t in range(T):
                e = chosen[g, t, j]
                kept[g, t, j] = used[e] < C
                used[e] += 1
    return chosen, kept


def jnp_loop_loss(p, x, probe, chosen, kept, *, gate, normalize=True):
    """The loss for fixed routing decisions, token by token in plain jnp (so it has gradients)."""
    G, T, _ = x.shape
    E, k = p["router"].shape[1], chosen.shape[-1]
    total, P_sum, z_sum, ent_sum = 0.0, jnp.zeros(E), 0.0, 0.0
    for g in range(G):
        for t in range(T):
            logits = x[g, t] @ p["router"]
            scores = jax.nn.softmax(logits) if gate == "softmax" else jax.nn.sigmoid(logits)
            probs = scores / scores.sum()
            w = jnp.stack([scores[e] for e in chosen[g, t]])
            w = w / w.sum() if normalize else w
            y = sum(w[j] * (jax.nn.gelu(x[g, t] @ p["w1"][e]) @ p["w2"][e])
                    for j, e in enumerate(chosen[g, t]) if kept[g, t, j])
            if "shared_w1" in p:
                y = y + jax.nn.gelu(x[g, t] @ p["shared_w1"]) @ p["shared_w2"]
            total = total + jnp.sum(y * probe[g, t])
            P_sum, z_sum = P_sum + probs, z_sum + jax.nn.logsumexp(logits) ** 2
            ent_sum = ent_sum - jnp.sum(probs * jnp.log(probs))
    load = np.bincount(chosen.ravel(), minlength=E)
    aux = E * jnp.sum(load / (G * T * k) * P_sum / (G * T))
    z, ent = z_sum / (G * T), ent_sum / (G * T)
    return total + AUX_W * aux + Z_W * z, (aux, z, ent, load)


LOOP_CASES = [
    dict(top_k=1, gate="softmax", capacity_factor=1.0, normalize=False),
    dict(top_k=2, gate="softmax", capacity_factor=0.75),
    dict(top_k=2, gate="sigmoid", capacity_factor=None),
    dict(top_k=2, gate="sigmoid", capacity_factor=1.0, bias=True, shared=3),
    dict(top_k=1, gate="sigmoid", capacity_factor=2.0, shared=3),
]


@pytest.mark.parametrize("case", LOOP_CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_one_device_matches_a_loop_over_tokens(case):
    opts = {k: v for k, v in case.items() if k not in ("bias", "shared")}
    p = make_params(1, D=4, M=5, E=4, shared=case.get("shared", 0), bias=case.get("bias", False))
    x, probe = make_inputs(1, G=2, T=6, D=4)
    (loss, (y, stats, expert, slot, kept)), grads = grad_program(opts)(p, x, probe)
    chosen, ref_kept = loop_decisions(p, x, **opts)
    np.testing.assert_array_equal(np.asarray(expert), chosen)
    np.testing.assert_array_equal(np.asarray(kept), ref_kept)
    ref = jax.value_and_grad(functools.partial(jnp_loop_loss, chosen=chosen, kept=ref_kept, gate=opts["gate"],
                                               normalize=opts.get("normalize", True)), argnums=(0, 1), has_aux=True)
    (ref_loss, (aux, z, ent, load)), ref_grads = ref(p, x, probe)
    np.testing.assert_allclose(loss, ref_loss, **TOL)
    assert_trees_close(grads, ref_grads, **TOL)
    np.testing.assert_allclose([stats.aux_loss, stats.z_loss, stats.entropy], [aux, z, ent], **TOL)
    np.testing.assert_array_equal(stats.load, load)
    assert int(stats.dropped) == int((~ref_kept).sum())
    if case["capacity_factor"] is None:
        assert int(stats.dropped) == 0
    elif case["capacity_factor"] <= 1.0:
        assert int(stats.dropped) > 0, "the case is meant to drop tokens"


# ----------------------------------------------------------------- expert parallelism against one device

G, T, D, M, E = 8, 8, 8, 16, 8
BATCH_AXES = ("data", "fsdp", "expert")     # EP devices are data parallel for the other layers


def mesh_and_rules(sizes):
    mesh = jaxpar.make_mesh(sizes, devices=jax.devices()[:math.prod(sizes.values())])
    return mesh, tuple(tensor_rules(batch_axes=BATCH_AXES)) + expert_rules(mesh.axis_names)


def param_specs(params, mesh, rules, lead=()):
    """Each parameter's spec by its logical names, plus ZeRO's ``fsdp`` axis (as jaxpar places state)."""
    sizes = dict(mesh.shape)
    specs = {}
    for name, v in params.items():
        logical = (*(None,) * len(lead), *MOE_LOGICAL[name])
        spec = logical_to_spec(logical, rules, mesh, shape=v.shape)
        spec = P(*lead, *spec[len(lead):])
        specs[name] = add_zero_axes(spec, v.shape, logical, ("fsdp",), sizes) if sizes["fsdp"] > 1 else spec
    return specs


def place(tree, specs, mesh):
    return {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in tree.items()}


EP_CASES = {
    "ep2": ({"expert": 2}, dict(top_k=2, gate="softmax", capacity_factor=1.0), {}),
    "ep4": ({"expert": 4}, dict(top_k=1, gate="softmax", capacity_factor=1.25, normalize=False), {}),
    "ep8": ({"expert": 8}, dict(top_k=2, gate="sigmoid", capacity_factor=None), dict(bias=True)),
    "data2xexpert4": ({"data": 2, "expert": 4}, dict(top_k=2, gate="softmax", capacity_factor=2.0), dict(shared=8)),
    "fsdp2xexpert4": ({"fsdp": 2, "expert": 4}, dict(top_k=2, gate="sigmoid", capacity_factor=1.0), {}),
    "expert2xtensor4": ({"expert": 2, "tensor": 4}, dict(top_k=2, gate="softmax", capacity_factor=1.0),
                        dict(shared=8)),
}


def reference(params, x, probe, opts):
    out = grad_program(opts)(params, x, probe)
    return jax.tree.map(np.asarray, out)


def exchange_sizes(rows: int, weights: int, counts: int, forward_and_backward=True) -> Counter:
    """The all-to-alls of one MoE layer's exchange, ``{(bytes, in a loop): count}``: the counts, then the
    first round's rows out and back (backward: the cotangents' rows out and the weights, the rows' and the
    weights' gradients back), and the further rounds' loops (which run only when a peer has more to send)."""
    first = {(counts, False): 1, (rows, False): 2}
    more = {(rows, True): 2}
    if forward_and_backward:
        first |= {(rows, False): 4, (weights, False): 2}
        more = {(rows, True): 5, (weights, True): 2}
    return Counter(first) + Counter(more)


def a2a_check(compiled, mesh, opts, forward_and_backward=True, *, Tg=T, Dm=D, Eg=E):
    """The routed rows' all-to-alls over ``expert`` (:func:`exchange_sizes`), each rows one ``[E_p, S, D]``
    float32; no all-gather over ``expert``. Returns the bytes of one rows all-to-all."""
    colls = collectives(compiled, mesh)
    sizes = dict(mesh.shape)
    shards, peers = math.prod(sizes[a] for a in BATCH_AXES), sizes["expert"]
    C = capacity(Tg, Eg, opts["top_k"], opts["capacity_factor"])
    tokens = Tg // sizes.get("context", 1)         # a device's part of each row (context parallelism)
    send = send_rows(G // shards, tokens, opts["top_k"], Eg, peers, C, dropless=opts["capacity_factor"] is None)
    a2a = [c for c in colls if c.kind == "all-to-all"]
    assert count(colls, "all-to-all", axes=("expert",)) == len(a2a), a2a
    expected = exchange_sizes(peers * send * Dm * 4, peers * send * 4, Eg * 4, forward_and_backward)
    assert Counter((c.bytes, c.in_loop) for c in a2a) == expected, (a2a, expected)
    gathers = [c for c in colls if c.kind == "all-gather" and (c.axes is None or "expert" in c.axes)]
    assert not gathers, gathers
    return peers * send * Dm * 4


@pytest.mark.parametrize("name", list(EP_CASES))
def test_expert_parallel_matches_one_device(name):
    sizes, opts, extra = EP_CASES[name]
    need = math.prod(sizes.values())
    if jax.device_count() < need:
        pytest.skip(f"needs {need} devices")
    params = make_params(2, D, M, E, **extra)
    x, probe = make_inputs(2, G, T, D)
    ref = reference(params, x, probe, opts)
    mesh, rules = mesh_and_rules(sizes)
    xspec = NamedSharding(mesh, P(BATCH_AXES))
    with jaxpar.use_rules(mesh, rules):
        args = (place(params, param_specs(params, mesh, rules), mesh), jax.device_put(x, xspec),
                jax.device_put(probe, xspec))
        compiled = grad_program(opts).lower(*args).compile()
        out = compiled(*args)
    assert_trees_close(out, ref, **TOL)            # loss, y, stats, routing masks, gradients (params and x)
    (_, (_, stats, _, _, kept)), _ = out
    if opts["capacity_factor"] is None:
        assert int(stats.dropped) == 0
    elif opts["capacity_factor"] <= 1.25:
        assert int(stats.dropped) > 0 and not kept.all(), "the case is meant to drop tokens"
    a2a_check(compiled, mesh, opts)


@need_devices(4)
def test_forward_has_two_all_to_alls_and_the_expert_weights_stay_sharded():
    opts = dict(top_k=2, gate="softmax", capacity_factor=1.0)
    params = make_params(3, D, M, E)
    x, _ = make_inputs(3, G, T, D)
    mesh, rules = mesh_and_rules({"expert": 4})
    with jaxpar.use_rules(mesh, rules):
        specs = param_specs(params, mesh, rules)
        args = (place(params, specs, mesh), jax.device_put(x, NamedSharding(mesh, P(BATCH_AXES))))
        compiled = jax.jit(functools.partial(moe_apply, **opts)).lower(*args).compile()
        y, _ = compiled(*args)
    np.testing.assert_allclose(y, moe_apply(params, x, **opts)[0], **TOL)
    # G/n = 8/4 groups per device, C = ceil(1.0 * 8 * 2 / 8) = 2: S = 2 * (8/4) * 2 rows a peer, [4, 8, 8] float32
    assert a2a_check(compiled, mesh, opts, forward_and_backward=False) == 4 * 8 * D * 4
    for name in ("w1", "w2"):                      # memory: each device holds exactly 1/E_p of the experts
        shards = args[0][name].addressable_shards
        assert len(shards) == 4 and {s.data.nbytes for s in shards} == {args[0][name].nbytes // 4}


@need_devices(4)
def test_micro_batches_with_the_step_load_sum_to_the_whole_batch():
    """Gradient accumulation, exact: a forward pre-pass sums the micro-batches' loads; each micro-batch's
    aux and z losses, weighted by its share of the tokens and with ``balance_load`` = that global load,
    add up to the whole batch's loss and gradients (EP 4, two micro-batches of 4 rows)."""
    opts = dict(top_k=2, gate="softmax", capacity_factor=1.0)
    params = make_params(9, D, M, E)
    x, probe = make_inputs(9, G, T, D)
    (ref_loss, (_, ref_stats, *_)), ref_grads = reference(params, x, probe, opts)

    def micro_loss(params, x, probe, balance_load):
        y, stats = moe_apply(params, x, **opts, balance_load=balance_load)
        share = x.shape[0] / G
        return jnp.sum(y * probe) + share * (AUX_W * stats.aux_loss + Z_W * stats.z_loss), stats

    mesh, rules = mesh_and_rules({"expert": 4})
    with jaxpar.use_rules(mesh, rules):
        forward = jax.jit(lambda p, x: moe_apply(p, x, **opts)[1].load)
        step = jax.jit(jax.value_and_grad(micro_loss, has_aux=True))
        micro = [(x[:4], probe[:4]), (x[4:], probe[4:])]
        load = sum(forward(params, mx) for mx, _ in micro)                 # the pre-pass
        outs = [step(params, mx, mp, load) for mx, mp in micro]
        stale = [step(params, mx, mp, None)[0][0] for mx, mp in micro]     # each micro-batch's own load
    np.testing.assert_array_equal(load, ref_stats.load)
    np.testing.assert_allclose(sum(o[0][0] for o in outs), ref_loss, **TOL)
    assert_trees_close(jax.tree.map(lambda *g: sum(g), *[o[1] for o in outs]), ref_grads[0], **TOL)
    assert abs(float(sum(stale)) - float(ref_loss)) > 1e-4      # without the step's load it is not exact


@need_devices(8)
def test_nested_in_a_pipe_shard_map_matches_one_device():
    opts = dict(top_k=2, gate="softmax", capacity_factor=1.0)
    params = jax.tree.map(lambda *a: jnp.stack(a), make_params(4, D, M, E), make_params(5, D, M, E))
    x, probe = make_inputs(4, G, T, D, lead=(2,))
    refs = [reference(jax.tree.map(lambda a: a[s], params), x[s], probe[s], opts) for s in range(2)]
    mesh, rules = mesh_and_rules({"pipe": 2, "expert": 4})

    def stage(p, x, probe):                        # each pipe stage runs its own layer on its own tokens
        (loss, (y, stats, *_)), grads = grad_program(opts)(jax.tree.map(lambda a: a[0], p), x[0], probe[0])
        return loss[None], y[None], jax.tree.map(lambda a: a[None], grads)

    with jaxpar.use_rules(mesh, rules):
        specs = param_specs(params, mesh, rules, lead=("pipe",))
        xs = jax.device_put(x, NamedSharding(mesh, P("pipe", BATCH_AXES)))
        args = (place(params, specs, mesh), xs, jax.device_put(probe, xs.sharding))
        f = jax.jit(jax.shard_map(stage, mesh=mesh, in_specs=P("pipe"), out_specs=P("pipe"), axis_names={"pipe"},
                                  check_vma=False))
        compiled = f.lower(*args).compile()
        loss, y, grads = compiled(*args)
    for s, ((ref_loss, (ref_y, *_)), ref_grads) in enumerate(refs):
        np.testing.assert_allclose(loss[s], ref_loss, **TOL)
        np.testing.assert_allclose(y[s], ref_y, **TOL)
        assert_trees_close(jax.tree.map(lambda a: a[s], grads), ref_grads, **TOL)
    a2a_check(compiled, mesh, opts)


@need_devices(4)
def test_a_batch_rule_without_the_expert_axis_still_matches():
    """The batch is split over ``expert`` on entry (a local slice) and gathered on exit."""
    opts = dict(top_k=2, gate="sigmoid", capacity_factor=1.0)
    params = make_params(6, D, M, E)
    x, _ = make_inputs(6, G, T, D)
    mesh, _ = mesh_and_rules({"expert": 4})
    rules = tuple(tensor_rules(batch_axes=("data", "fsdp"))) + expert_rules(mesh.axis_names)
    with jaxpar.use_rules(mesh, rules):
        compiled = jax.jit(functools.partial(moe_apply, **opts)).lower(params, x).compile()
        y, stats = compiled(params, x)
    ref_y, ref_stats = moe_apply(params, x, **opts)
    assert_trees_close((y, stats), (ref_y, ref_stats), **TOL)
    assert count(collectives(compiled, mesh), "all-to-all", axes=("expert",)) == 5     # the first round's 3, 2 more


@need_devices(8)
def test_expert_parameters_and_adam_state_per_device_are_one_over_ep():
    """jaxpar's sharded init with the rule ``experts -> expert`` (data2 x expert4): each device holds
    exactly ``2 * (E / E_p) * D * M * 4`` bytes of expert weights, and the same of each Adam moment."""
    from jaxpar.step import init_train_state
    mesh = jaxpar.make_mesh({"data": 2, "expert": 4}, devices=jax.devices()[:8])
    strategy = jaxpar.Strategy(extra_rules=expert_rules(mesh.axis_names))
    state, _ = init_train_state(lambda: MoE(D, M, E, shared_mlp=8, rngs=nnx.Rngs(0)), optax.adam(1e-3), mesh,
                                strategy)
    adam = state.opt_state[0]
    for tree in (state.params, adam.mu, adam.nu):
        per_device = {}
        for name in ("w1", "w2"):
            for shard in tree[name].addressable_shards:
                per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
        assert len(per_device) == 8 and set(per_device.values()) == {2 * (E // 4) * D * M * 4}
        assert sum(tree[n].nbytes for n in ("w1", "w2")) == 4 * 2 * (E // 4) * D * M * 4
        assert {s.data.nbytes for s in tree["router"].addressable_shards} == {D * E * 4}   # replicated


def test_module_is_moe_apply_on_its_parameters():
    layer = MoE(D, M, E, top_k=2, gate="sigmoid", capacity_factor=1.0, shared_mlp=4, router_bias=True,
                rngs=nnx.Rngs(3))
    assert layer.w1.out_sharding == ("experts", "embed", "mlp") and layer.router.out_sharding == ("embed", None)
    assert "router_bias" not in layer.params() and not jax.tree.leaves(nnx.state(layer, nnx.Not(nnx.Param)))
    x, _ = make_inputs(7, 2, T, D)
    y, stats = layer(x)                                   # outside a step: no bias
    ref = moe_apply(layer.params(), x, top_k=2, gate="sigmoid", capacity_factor=1.0)
    assert_trees_close((y, stats), ref, rtol=0, atol=0)
    bias = jnp.asarray(np.random.default_rng(0).normal(size=(2, E)), jnp.float32)
    with use_router_bias(bias):                           # in a step: each call reads its site's row
        (y1, y2), _ = with_reported_metrics(balanced(lambda v: (layer(v)[0], layer(v)[0])))(x)
    for got, row in ((y1, bias[0]), (y2, bias[1])):
        want = moe_apply({**layer.params(), "router_bias": row}, x, top_k=2, gate="sigmoid", capacity_factor=1.0)[0]
        assert_trees_close(got, want, rtol=0, atol=0)
    assert not np.allclose(y1, y2) and not np.allclose(y1, y)


def test_bias_balancing_evens_the_load():
    """Aux-loss-free balancing: repeated bias updates on a skewed router lower the load's CV."""
    params = make_params(8, D, M, E)
    router = params["router"] + jnp.array([3.0, 3.0] + [0.0] * (E - 2))   # experts 0 and 1 are favoured
    x, _ = make_inputs(8, G, T, D)

    @jax.jit
    def steps(bias):
        def body(bias, _):
            load = jnp.sum(jax.nn.one_hot(route(x, router, top_k=2, bias=bias).expert, E), axis=(0, 1, 2))
            return update_router_bias(bias, load, 0.01), load_cv(load)
        return jax.lax.scan(body, bias, None, length=200)

    bias, cvs = steps(jnp.zeros(E))
    assert float(cvs[0]) > 0.6 and float(cvs[-20:].mean()) < 0.5 * float(cvs[0]), cvs   # measured: 0.64 -> 0.29
    assert float(bias[0]) < 0 and float(bias[1]) < 0 and bool(jnp.all(bias[2:] > 0)), bias


@pytest.mark.parametrize("kwargs, match", [
    (dict(experts=8, top_k=9), "top_k=9 must be an int in \\[1, experts=8\\]"),
    (dict(experts=8, top_k=0), "top_k=0"),
    (dict(capacity_factor=0), "capacity_factor=0 must be a finite number > 0"),
    (dict(capacity_factor=-1.0), "capacity_factor=-1.0"),
    (dict(capacity_factor=float("nan")), "capacity_factor=nan"),
    (dict(gate="relu"), "gate='relu' is not a known gate; choose one of \\('softmax', 'sigmoid'\\)"),
    (dict(activation="relu"), "activation='relu' is not a known activation; choose one of \\('gelu', 'silu'\\)"),
])
def test_bad_options_are_named(kwargs, match):
    opts = dict(experts=8, top_k=2, gate="softmax", capacity_factor=1.0) | kwargs
    with pytest.raises(MoEError, match=match):
        MoE(4, 8, opts.pop("experts"), **opts, rngs=nnx.Rngs(0))


@need_devices(4)
def test_experts_not_divisible_by_the_expert_axis_and_uneven_batches_are_named():
    mesh, rules = mesh_and_rules({"expert": 4})
    x, _ = make_inputs(0, 8, 4, D)
    with jaxpar.use_rules(mesh, rules):
        with pytest.raises(MoEError, match="experts=6 is not divisible by the expert-parallel mesh axes expert=4"):
            jax.jit(functools.partial(moe_apply, top_k=2)).lower(make_params(0, D, M, 6), x)
        with pytest.raises(MoEError, match="got 6 groups .* expert=4 \\(total 4\\)"):
            jax.jit(functools.partial(moe_apply, top_k=2)).lower(make_params(0, D, M, 8), x[:6])


# ----------------------------------------------------------------- gated (SwiGLU) experts: w1 gate, w3 up, w2 down

GD, GM, GT = 12, 20, 6          # embed, mlp, tokens per row: unequal, tiny


def make_gated(seed, D, M, E, *, shared=0):
    """Gated expert weights: ``make_params``' plus ``w3`` (and ``shared_w3``), of the same scale."""
    p = make_params(seed, D, M, E, shared=shared)
    k = jax.random.split(jax.random.key(1000 + seed), 2)
    p["w3"] = 0.3 * jax.random.normal(k[0], (E, D, M))
    if shared:
        p["shared_w3"] = 0.3 * jax.random.normal(k[1], (D, shared))
    return p


def hf_sparse_moe_block(p, x, *, top_k, normalize, activation):
    """Hugging Face Qwen3-MoE's ``Qwen3MoeSparseMoeBlock`` for one token, in plain jnp, mapped over the
    tokens (the router is HF's ``gate.weight.T``, ``w1``/``w3``/``w2`` its experts' ``gate_proj`` /
    ``up_proj`` / ``down_proj`` transposed): ``probs = softmax(logits, float32)``, ``w, idx = topk(probs,
    k)``, ``w /= w.sum()`` when ``norm_topk_prob``, ``y = sum_k w_k * down(act(gate(x)) * up(x))``; plus
    the shared experts, ungated (DeepSeek's), when ``p`` has them."""
    act = {"silu": jax.nn.silu, "gelu": jax.nn.gelu}[activation]

    def mlp(h, gate, up, down):
        return (act(h @ gate) * (h @ up)) @ down

    def token(h):
        probs = jax.nn.softmax((h @ p["router"]).astype(jnp.float32))
        w, idx = jax.lax.top_k(probs, top_k)
        w = w / w.sum() if normalize else w
        y = sum(w[j] * mlp(h, p["w1"][idx[j]], p["w3"][idx[j]], p["w2"][idx[j]]) for j in range(top_k))
        return y + mlp(h, p["shared_w1"], p["shared_w3"], p["shared_w2"]) if "shared_w1" in p else y

    return jax.vmap(jax.vmap(token))(x)


@pytest.mark.parametrize("activation, normalize, shared", [("silu", True, 0), ("silu", False, 7), ("gelu", True, 0)],
                         ids=["swiglu-norm_topk_prob", "swiglu-raw_probs-shared", "geglu"])
def test_gated_experts_on_one_device_are_the_hugging_face_formula(activation, normalize, shared):
    """Dropless, one device: ``moe_apply`` with ``w3`` is Qwen3-MoE's block, output and gradients (x and
    every weight) within 1e-5."""
    opts = dict(top_k=2, gate="softmax", capacity_factor=None, normalize=normalize, activation=activation)
    p = make_gated(11, GD, GM, 5, shared=shared)
    x, probe = make_inputs(11, 2, GT, GD)
    y_of = {"jaxpar": lambda p, x: moe_apply(p, x, **opts)[0],
            "hf": functools.partial(hf_sparse_moe_block, top_k=2, normalize=normalize, activation=activation)}
    out = {}
    for name, fn in y_of.items():
        loss = lambda p, x, fn=fn: jnp.sum(fn(p, x) * probe)      # noqa: E731
        out[name] = jax.jit(lambda p, x, fn=fn, loss=loss: (fn(p, x), jax.grad(loss, argnums=(0, 1))(p, x)))(p, x)
    assert_trees_close(out["jaxpar"], out["hf"], **TOL)
    assert set(out["jaxpar"][1][0]) == set(p) and float(jnp.abs(out["jaxpar"][1][0]["w3"]).max()) > 0


GATED_EP_CASES = {      # mesh, capacity factor, shared experts' width, rules put first
    "ep4-dropless": ({"expert": 4}, None, 0, ()),
    "data2xexpert2-cf1": ({"data": 2, "expert": 2}, 1.0, 0, ()),
    "expert2xtensor4-cf1.25-shared": ({"expert": 2, "tensor": 4}, 1.25, 8, ()),
    "context2xexpert2xtensor2-cf1.25": ({"context": 2, "expert": 2, "tensor": 2}, 1.25, 0, (("length", "context"),)),
}


@pytest.mark.parametrize("name", list(GATED_EP_CASES))
def test_gated_experts_under_expert_parallelism_match_one_device(name):
    """SwiGLU experts (w3 split like w1: over ``expert``, and its ``mlp`` over ``tensor``) under EP equal
    one device: loss, output, stats, routing masks and every gradient at 1e-5; the exchange's all-to-alls
    (:func:`exchange_sizes`)."""
    sizes, cf, shared, first_rules = GATED_EP_CASES[name]
    need = math.prod(sizes.values())
    if jax.device_count() < need:
        pytest.skip(f"needs {need} devices")
    opts = dict(top_k=2, gate="softmax", capacity_factor=cf, activation="silu")
    params = make_gated(12, GD, GM, 8, shared=shared)
    x, probe = make_inputs(12, 8, 8, GD)
    ref = reference(params, x, probe, opts)
    mesh, rules = mesh_and_rules(sizes)
    rules = first_rules + rules
    xspec = NamedSharding(mesh, P(BATCH_AXES))
    with jaxpar.use_rules(mesh, rules):
        specs = param_specs(params, mesh, rules)
        args = (place(params, specs, mesh), jax.device_put(x, xspec), jax.device_put(probe, xspec))
        compiled = grad_program(opts).lower(*args).compile()
        out = compiled(*args)
    assert specs["w3"] == specs["w1"]
    assert_trees_close(out, ref, **TOL)
    (_, (_, stats, _, _, kept)), _ = out
    assert (int(stats.dropped) == 0) if cf is None else (int(stats.dropped) > 0 and not kept.all())
    a2a_check(compiled, mesh, opts, Tg=8, Dm=GD)


def test_gated_module_adds_w3_and_keeps_the_other_weights():
    plain = MoE(GD, GM, 5, capacity_factor=None, shared_mlp=7, init_std=0.3, rngs=nnx.Rngs(4))
    layer = MoE(GD, GM, 5, capacity_factor=None, shared_mlp=7, gated=True, activation="silu", init_std=0.3,
                rngs=nnx.Rngs(4))
    p = layer.params()
    assert set(p) == {"router", "w1", "w2", "w3", "shared_w1", "shared_w2", "shared_w3"}
    assert p["w3"].shape == (5, GD, GM) and layer.w3.out_sharding == MOE_LOGICAL["w3"] == MOE_LOGICAL["w1"]
    assert p["shared_w3"].shape == (GD, 7) and MOE_LOGICAL["shared_w3"] == MOE_LOGICAL["shared_w1"]
    assert_trees_close(plain.params(), {k: p[k] for k in plain.params()}, rtol=0, atol=0)
    x, _ = make_inputs(13, 2, GT, GD)
    ref = moe_apply(p, x, top_k=2, capacity_factor=None, activation="silu")
    assert layer.options["activation"] == "silu" and plain.options["activation"] == "gelu"
    assert_trees_close(layer(x), ref, rtol=0, atol=0)


def test_bad_activation_and_w3_shapes_are_named():
    p = make_gated(14, GD, GM, 4, shared=3)
    x, _ = make_inputs(14, 2, GT, GD)
    with pytest.raises(MoEError, match="activation='tanh' is not a known activation; choose one of"):
        moe_apply(p, x, activation="tanh")
    with pytest.raises(MoEError, match=r"params\['w3'\] .* shape \(4, 20, 12\).*params\['w1'\] \(got \(4, 12, 20\)\)"):
        moe_apply({**p, "w3": p["w2"]}, x)
    with pytest.raises(MoEError, match=r"params\['shared_w3'\].*params\['shared_w1'\] \(got none\)"):
        moe_apply({k: v for k, v in p.items() if k != "shared_w1"}, x)


# ----------------------------------------------------------------- the sorted dispatch against GShard's dense one

def dense_dispatch(x, expert, slot, weight, w1, w2, w3=None, *, capacity, activation="gelu"):
    """GShard's one-hot dispatch (jaxpar's before the sorted one): a ``[G, E, C, D]`` buffer, every expert on
    its ``C`` slots, a weighted one-hot combine."""
    E = w1.shape[0]
    onehot = jnp.einsum("gtke,gtkc->gtec", jax.nn.one_hot(expert, E), jax.nn.one_hot(slot, capacity))
    combine = jnp.einsum("gtke,gtkc->gtec", jax.nn.one_hot(expert, E) * weight[..., None],
                         jax.nn.one_hot(slot, capacity))
    xe = jnp.einsum("gtec,gtd->gecd", onehot, x)
    act = {"gelu": jax.nn.gelu, "silu": jax.nn.silu}[activation]
    h = act(jnp.einsum("gecd,edm->gecm", xe, w1))
    h = h if w3 is None else h * jnp.einsum("gecd,edm->gecm", xe, w3)
    return jnp.einsum("gtec,gecd->gtd", combine, jnp.einsum("gecm,emd->gecd", h, w2))


@pytest.mark.parametrize("cf, gated, tile", [
    pytest.param(None, True, 4, id="dropless-gated-tile4"),
    pytest.param(1.25, False, 4, id="cf1.25-tile4", marks=pytest.mark.exhaustive),
    pytest.param(0.5, True, 32, id="cf0.5-gated", marks=pytest.mark.exhaustive),
    pytest.param(None, False, 1, id="dropless-tile1", marks=pytest.mark.exhaustive)])
def test_sorted_dispatch_equals_the_dense_one(cf, gated, tile, monkeypatch):
    """One device, tiles smaller than an expert's rows (several tiles an expert, a partial last one):
    the output and the gradients of x, the weights and every expert weight equal GShard's dense dispatch."""
    monkeypatch.setitem(TILE_ROWS, jax.default_backend(), tile)
    p = make_gated(21, GD, GM, 6) if gated else make_params(21, GD, GM, 6)
    x, probe = make_inputs(21, 3, 16, GD)
    r = route(x, p["router"], top_k=2, capacity_factor=cf)
    act = "silu" if gated else "gelu"
    args = (x, r.weight, p["w1"], p["w2"], p.get("w3"))

    def loss(fn, x, weight, w1, w2, w3, **kw):
        return jnp.sum(fn(x, r.expert, r.slot, weight, w1, w2, w3=w3, capacity=r.capacity, activation=act, **kw)
                       * probe)

    got = jax.jit(jax.value_and_grad(functools.partial(loss, dispatch_combine), argnums=(0, 1, 2, 3, 4)))(*args)
    want = jax.jit(jax.value_and_grad(functools.partial(loss, dense_dispatch), argnums=(0, 1, 2, 3, 4)))(*args)
    assert_trees_close(got, want, **TOL)
    assert cf is None or not bool(r.kept.all()), "the case is meant to drop"


@need_devices(4)
def test_a_skewed_dropless_routing_takes_more_rounds_and_still_matches():
    """Dropless EP 4 with every token's first choice on expert 0: one peer gets every device's first
    choices, more than S = 1.25 x the mean, so the exchange runs several rounds; values, statistics and
    gradients equal one device's, also with tiles of 4 rows."""
    opts = dict(top_k=2, gate="softmax", capacity_factor=None)
    params = make_params(22, D, M, E)
    params["router"] = params["router"].at[:, 0].add(50.0)
    x, probe = make_inputs(22, G, T, D)
    x = jnp.abs(x) + 0.1                           # x @ router favours expert 0 for every token
    ref = reference(params, x, probe, opts)
    assert (ref[0][1][2][..., 0] == 0).all()
    mesh, rules = mesh_and_rules({"expert": 4})
    assert G // 4 * T > send_rows(G // 4, T, 2, E, 4, T, dropless=True)       # one peer's rows > S: rounds
    with jaxpar.use_rules(mesh, rules):
        xspec = NamedSharding(mesh, P(BATCH_AXES))
        args = (place(params, param_specs(params, mesh, rules), mesh), jax.device_put(x, xspec),
                jax.device_put(probe, xspec))
        for tile in (32, 4):
            with pytest.MonkeyPatch.context() as mp:
                mp.setitem(TILE_ROWS, "cpu", tile)
                assert_trees_close(grad_program(opts).lower(*args).compile()(*args), ref, **TOL)


def test_dropless_experts_compute_the_routed_rows_and_memory_is_linear_in_the_tokens():
    """Dropless on one device: the compiled GEMM FLOPs (the tile loops' trips at their bound, routed rows
    / tile + E) are within 1.15x a dense MLP of width k M on the same tokens, forward and backward; the
    temporaries at 8192 tokens a row are at most 4.2x those at 2048 (the dense dispatch's grew as T^2)."""
    D_, M_, E_, k = 32, 64, 8, 2
    p = make_params(23, D_, M_, E_)
    dense = {"w1": jnp.zeros((D_, k * M_)), "w2": jnp.zeros((k * M_, D_))}

    def moe_loss(p, x):
        return jnp.sum(moe_apply(p, x, top_k=k, capacity_factor=None)[0])

    def mlp_loss(p, x):
        return jnp.sum(jax.nn.gelu(x @ p["w1"]) @ p["w2"])

    temps = {}
    for tokens in (2048, 8192):
        x = jnp.zeros((1, tokens, D_))
        moe = jax.jit(jax.grad(moe_loss, argnums=(0, 1))).lower(p, x).compile()
        temps[tokens] = moe.memory_analysis().temp_size_in_bytes
    text = moe.as_text()
    tiles = 8192 * k / TILE_ROWS["cpu"] + E_
    f0, f1, f2 = (dot_flops(text, u) for u in (0.0, 1.0, 2.0))
    assert f2 - 2 * f1 + f0 == 0                  # one device: no exchange, no rounds
    routed = f0 + tiles * (f1 - f0)
    twin = dot_flops(jax.jit(jax.grad(mlp_loss, argnums=(0, 1))).lower(dense, x).compile().as_text())
    assert routed <= 1.15 * twin, (routed, twin)
    assert temps[8192] <= 4.2 * temps[2048], temps
