"""Data parallelism on 8 CPU devices: pmap, shard_map and sharded jit.

One replica's gradients overflow; every replica must take the same decision
and end bitwise equal. 8-device training must match 1-device training on the
same global batch, with the same loss-scale trajectory.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import batches, mlp_loss, mlp_params
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jmp_lite
from jmp_lite import DynamicLossScale, loss_scaling

pytestmark = pytest.mark.composition

N = 8
STEPS = 8
BAD_STEP, BAD_REPLICA = 2, 3


def is_replicated(tree) -> bool:
    """Host-side check that every shard of every array in ``tree`` is bitwise equal.

    It copies every shard to the host. For a
    ``pmap`` result the leading axis is the replica axis; for a ``jax.Array``
    placed with a sharding, every addressable shard of a replicated array must
    hold the same bits.
    """
    for leaf in jax.tree_util.tree_leaves(tree):
        shards = [np.asarray(s.data) for s in getattr(leaf, "addressable_shards", [])] or [np.asarray(leaf)]
        first = np.ascontiguousarray(shards[0]).view(np.uint8)
        if any(not np.array_equal(np.ascontiguousarray(s).view(np.uint8), first) for s in shards[1:]):
            return False
    return True


def data(poison=True):
    xs, ys = batches(jax.random.key(1), STEPS, batch=4 * N)
    if poison:  # one row of replica 3's shard at step 2
        xs = xs.at[BAD_STEP, BAD_REPLICA * 4, 0].set(jnp.inf)
    return xs, ys


def make_tx(**kw):
    return loss_scaling(optax.adam(1e-2), DynamicLossScale(2.0**15, period=3), **kw)


def scaled_grads(params, opt_state, batch):
    ls = jmp_lite.get_loss_scale(opt_state)
    return jax.grad(lambda p: ls.scale(mlp_loss(p, batch)))(params)


def run_single(xs, ys):
    tx = make_tx()

    @jax.jit
    def step(p, s, b):
        u, s = tx.update(scaled_grads(p, s, b), s, p)
        return optax.apply_updates(p, u), s

    p = mlp_params(jax.random.key(0))
    s = tx.init(p)
    scales = []
    for i in range(STEPS):
        p, s = step(p, s, (xs[i], ys[i]))
        scales.append(float(s.loss_scale.loss_scale))
    return p, s, scales


def run_pmap(xs, ys, **kw):
    tx = make_tx(axis_name="d", reduce="mean", **kw)

    def step(p, s, b):
        u, s = tx.update(scaled_grads(p, s, b), s, p)
        return optax.apply_updates(p, u), s, s.loss_scale.loss_scale * 1

    pstep = jax.pmap(step, axis_name="d", donate_argnums=(0, 1))
    p = mlp_params(jax.random.key(0))
    p, s = to_replicas(stack(p)), to_replicas(stack(tx.init(p)))
    batches_ = [to_replicas((shard(xs[i]), shard(ys[i]))) for i in range(STEPS)]
    p, s, scales = loop(pstep, p, s, batches_)
    return p, s, [float(np.asarray(x)[0]) for x in scales], [np.asarray(x) for x in scales]


def loop(step, p, s, batches_):
    """Runs the steps; all but the first (which compiles) under a transfer guard."""
    p, s, scale = step(p, s, batches_[0])
    scales = [scale]
    with jax.transfer_guard("disallow"):
        for b in batches_[1:]:
            p, s, scale = step(p, s, b)
            scales.append(scale)
    return p, s, scales


to_replicas = jax.pmap(lambda t: t)  # places a stacked tree on the devices, pmap-style


def stack(tree):
    return jax.tree_util.tree_map(lambda x: jnp.stack([x] * N), tree)


def shard(a):
    return a.reshape(N, a.shape[0] // N, *a.shape[1:])


def mesh():
    return Mesh(np.array(jax.devices()), ("d",))


def run_shard_map(xs, ys):
    m = mesh()
    tx = make_tx(axis_name="d", reduce="mean")

    def local(p, s, b):
        u, s = tx.update(scaled_grads(p, s, b), s, p)
        return optax.apply_updates(p, u), s, s.loss_scale.loss_scale * 1

    step = jax.jit(
        jax.shard_map(local, mesh=m, in_specs=(P(), P(), P("d")), out_specs=(P(), P(), P())),
        donate_argnums=(0, 1),
    )
    return drive(step, m, xs, ys, tx)


def run_sharded_jit(xs, ys):
    m = mesh()
    tx = make_tx()  # no axis_name: GSPMD reduces the gradients and the check

    def step(p, s, b):
        u, s = tx.update(scaled_grads(p, s, b), s, p)
        return optax.apply_updates(p, u), s, s.loss_scale.loss_scale * 1

    rep = NamedSharding(m, P())
    step = jax.jit(step, out_shardings=(rep, rep, rep), donate_argnums=(0, 1))
    return drive(step, m, xs, ys, tx)


def drive(step, m, xs, ys, tx):
    rep, split = NamedSharding(m, P()), NamedSharding(m, P("d"))
    p = jax.device_put(mlp_params(jax.random.key(0)), rep)
    s = jax.device_put(tx.init(mlp_params(jax.random.key(0))), rep)
    batches_ = [jax.device_put((xs[i], ys[i]), split) for i in range(STEPS)]
    p, s, scales = loop(step, p, s, batches_)
    return p, s, [float(x) for x in scales], scales


RUNNERS = {"pmap": run_pmap, "shard_map": run_shard_map, "sharded_jit": run_sharded_jit}


@pytest.mark.parametrize("mode", RUNNERS)
def test_one_replica_overflowing_keeps_replicas_bitwise_equal(mode):
    assert jax.device_count() == N
    p, s, scales, _ = RUNNERS[mode](*data())
    if mode == "pmap":
        for leaf in jax.tree_util.tree_leaves((p, s)):
            leaf = np.asarray(leaf)
            for r in range(1, N):
                np.testing.assert_array_equal(
                    np.atleast_1d(leaf[r]).view(np.uint8), np.atleast_1d(leaf[0]).view(np.uint8)
                )
        skipped = np.asarray(s.skipped_total)
        assert np.all(skipped == 1)
    else:
        assert is_replicated((p, s))
        assert int(s.skipped_total) == 1
    assert scales[BAD_STEP] == scales[BAD_STEP - 1] / 2


@pytest.mark.parametrize("mode", RUNNERS)
def test_eight_devices_match_one_device(mode):
    xs, ys = data()
    p1, s1, scales1 = run_single(xs, ys)
    p8, s8, scales8, _ = RUNNERS[mode](xs, ys)
    if mode == "pmap":
        p8, s8 = jax.tree_util.tree_map(lambda a: np.asarray(a)[0], (p8, s8))
    assert scales8 == scales1  # identical loss-scale trajectories
    assert int(np.asarray(s8.skipped_total)) == int(s1.skipped_total) == 1
    for a, b in zip(jax.tree_util.tree_leaves(p8), jax.tree_util.tree_leaves(p1)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-6)


@pytest.mark.compiled  # reads the compiled program
def test_reduce_dtype_sets_the_all_reduce_dtype():
    p = mlp_params(jax.random.key(0))
    xs, ys = data(poison=False)
    b = (shard(xs[0]), shard(ys[0]))

    def hlo(reduce_dtype):
        tx = make_tx(axis_name="d", reduce="mean", reduce_dtype=reduce_dtype)

        def step(p, s, b):
            u, s = tx.update(scaled_grads(p, s, b), s, p)
            return optax.apply_updates(p, u), s

        return jax.pmap(step, axis_name="d").lower(stack(p), stack(tx.init(p)), b).as_text()

    def reduced_dtypes(text):
        # The program as lowered: '"stablehlo.all_reduce"(...) ... }) : (tensor<16x4xbf16>) -> ...'.
        # (XLA:CPU later widens a bf16 all-reduce to f32 after rounding; GPUs keep bf16.)
        return set(
            re.findall(r'"stablehlo\.all_reduce".*?\}\) : \(tensor<[0-9x]*?(bf16|f16|f32)>', text, re.S)
        )

    assert "bf16" in reduced_dtypes(hlo(jnp.bfloat16))
    assert "bf16" not in reduced_dtypes(hlo(None))
    _, _, _, raw = run_pmap(xs, ys, reduce_dtype=jnp.bfloat16)
    assert all(np.all(np.asarray(r) == np.asarray(r)[0]) for r in raw)


@pytest.mark.unit
def test_reduce_gradients_matches_a_numpy_mean_and_validates():
    g = jnp.arange(N * 3, dtype=jnp.float32).reshape(N, 3) / 7
    out = jax.pmap(lambda x: jmp_lite.reduce_gradients({"g": x, "i": jnp.int32(1)}, "d"), axis_name="d")(g)
    np.testing.assert_allclose(np.asarray(out["g"])[0], np.asarray(g).mean(0), rtol=1e-6)
    assert np.asarray(out["i"]).tolist() == [1] * N
    half = jax.pmap(
        lambda x: jmp_lite.reduce_gradients(x, "d", reduce_dtype="bf16", reduce="sum"), axis_name="d"
    )(g)
    assert half.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(half)[0], np.asarray(g).sum(0), rtol=2e-2)
    with pytest.raises(ValueError, match="reduce must be one of 'mean', 'sum'; got 'max'"):
        jmp_lite.reduce_gradients(g, "d", reduce="max")
    with pytest.warns(DeprecationWarning, match="use reduce="):
        summed = jax.pmap(lambda x: jmp_lite.reduce_gradients(x, "d", op="sum"), axis_name="d")(g)
    np.testing.assert_allclose(np.asarray(summed)[0], np.asarray(g).sum(0), rtol=1e-6)
    with pytest.raises(ValueError, match="reduce_dtype"):
        jmp_lite.reduce_gradients(g, "d", reduce_dtype="int8")
    with pytest.raises(ValueError, match="need an axis_name"):
        loss_scaling(optax.sgd(1.0), DynamicLossScale(2.0), reduce="mean")
    with pytest.raises(ValueError, match="reduce must be"):
        loss_scaling(optax.sgd(1.0), DynamicLossScale(2.0), axis_name="d", reduce="max")


def test_sharded_jit_with_sharded_params_and_state_matches_one_device():
    xs, ys = data()
    p1, s1, scales1 = run_single(xs, ys)
    m = mesh()
    tx = make_tx()

    def place(tree):  # FSDP-style: shard every leaf whose first axis divides by N
        spec = lambda a: P("d") if a.ndim and a.shape[0] % N == 0 else P()
        return jax.tree_util.tree_map(lambda a: jax.device_put(a, NamedSharding(m, spec(a))), tree)

    def step(p, s, b):
        u, s = tx.update(scaled_grads(p, s, b), s, p)
        return optax.apply_updates(p, u), s, s.loss_scale.loss_scale * 1

    params = mlp_params(jax.random.key(0))
    p, s = place(params), place(tx.init(params))
    shardings = jax.tree_util.tree_map(lambda a: a.sharding, (p, s))
    step = jax.jit(step, out_shardings=(*shardings, NamedSharding(m, P())))
    assert any(not x.sharding.is_fully_replicated for x in jax.tree_util.tree_leaves(s))
    split = NamedSharding(m, P("d"))
    scales = []
    for i in range(STEPS):
        p, s, scale = step(p, s, jax.device_put((xs[i], ys[i]), split))
        scales.append(float(scale))
    assert scales == scales1 and int(s.skipped_total) == 1
    for a, b in zip(jax.tree_util.tree_leaves(p), jax.tree_util.tree_leaves(p1)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-6)


@pytest.mark.all_params  # each dtype and fp8 recipe in CI
@pytest.mark.parametrize(
    "policy, fp8, tol",
    [("p=f32,c=bf16,o=f32", None, 0.02), ("p=f32,c=f16,o=f32", None, 0.005),
     ("p=f32,c=bf16,o=f32", "hybrid,current", 0.1), ("p=f32,c=bf16,o=f32", "hybrid,block", 0.1)],
)  # fmt: skip
def test_a_batch_sharded_on_a_mesh_with_explicit_axes_differentiates_under_16_bit_policies(policy, fp8, tol):
    """``jax.make_mesh``'s default (Explicit axes in jax 0.10), the docs' data-parallel setup: the weight
    gradient contracts the sharded batch axis on both sides, which JAX's Explicit mode refuses to place
    unless the contraction names its result's sharding. jmp_lite's own contractions (16-bit dots that
    accumulate in float32, fp8 current and block scaling) raised ShardingTypeError; now the gradient is
    the float32 one's within the dtype's rounding, jitted and eager, and sharded like the weight."""
    mesh = jax.make_mesh((N,), ("data",))
    assert mesh.axis_types == (jax.sharding.AxisType.Explicit,)
    x = jax.device_put(jax.random.normal(jax.random.key(0), (8 * N, 16)), NamedSharding(mesh, P("data")))
    w = jax.device_put(jax.random.normal(jax.random.key(1), (16, 8)) / 4, NamedSharding(mesh, P()))
    loss = lambda w, x: jnp.mean(jnp.tanh(x @ w) ** 2)  # noqa: E731
    reference = jax.jit(jax.grad(loss))(w, x)
    mixed = jmp_lite.autocast(loss, policy, fp8=fp8)
    jitted = jax.jit(jax.grad(mixed))(w, x)
    with jax.set_mesh(mesh):  # eager steps on Explicit axes run in the mesh's context (docs/distributed.md)
        eager = jax.grad(mixed)(w, x)
    for g in (jitted, eager):
        assert g.sharding.spec == P(None, None) and g.dtype == jnp.float32
        assert float(jnp.linalg.norm(g - reference) / jnp.linalg.norm(reference)) < tol
