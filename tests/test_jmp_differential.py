"""jmp code gives bitwise jmp's numbers with ``import jmp_lite as jmp``.

The recipe is DeepMind Haiku's ImageNet example in float16: float32 params,
a policy computing in float16, ``cast_to_compute(grads)``, then
``loss_scale.unscale``, then ``pmean`` over replicas, ``all_finite``,
``adjust`` and ``select_tree``, with the whole state built inside ``pmap``.
Both libraries run it on the same data, including steps where one replica's
gradients overflow, and every step's loss, gradient dtype, params and loss
scale must have the same bits.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmp_lite

pytestmark = pytest.mark.composition

jmp = pytest.importorskip("jmp")

N = jax.local_device_count()
STEPS = 8
OVERFLOW = {2: 0, 5: N - 1}  # step -> replica whose batch overflows float16


def batches():
    rng = np.random.default_rng(0)
    xs = rng.normal(size=(STEPS, N, 4, 3)).astype(np.float32)
    ys = rng.normal(size=(STEPS, N, 4, 2)).astype(np.float32)
    for step, replica in OVERFLOW.items():
        xs[step, replica] *= 3e4  # float16 activations overflow on that replica only
    return xs, ys


def run(lib, make_scale):
    policy = lib.get_policy("p=f32,c=f16,o=f32")

    def init(_):
        w = jnp.linspace(-0.5, 0.5, 6, dtype=jnp.float32).reshape(3, 2)
        return {"w": w, "b": jnp.zeros(2, jnp.float32)}, make_scale(lib)

    def loss_fn(params, x, y):
        params, x = policy.cast_to_compute((params, x))
        out = policy.cast_to_output(x @ params["w"] + params["b"])
        return jnp.mean((out - y) ** 2)

    def step(params, loss_scale, x, y):
        loss, grads = jax.value_and_grad(lambda p: loss_scale.scale(loss_fn(p, x, y)))(params)
        grads = policy.cast_to_compute(grads)
        grads = loss_scale.unscale(grads)
        grads = jax.lax.pmean(grads, axis_name="i")
        grads_dtype = jnp.zeros((), grads["w"].dtype)  # the dtype the reduction ran in
        grads = policy.cast_to_param(grads)
        finite = lib.all_finite(grads)
        loss_scale = loss_scale.adjust(finite)
        new = jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads)
        params = lib.select_tree(finite, new, params)
        return params, loss_scale, loss, grads_dtype, grads

    params, loss_scale = jax.pmap(init, axis_name="i")(jnp.arange(N))
    pstep = jax.pmap(step, axis_name="i")
    trace = []
    for x, y in zip(*batches()):
        params, loss_scale, loss, grads_dtype, grads = pstep(params, loss_scale, x, y)
        # jmp's StaticLossScale is a leafless pytree (a Python float, unreplicated): compare one
        # replica's value in float32 (all replicas hold the same one).
        scale = np.asarray(loss_scale.loss_scale, np.float32).reshape(-1)
        assert (scale == scale[0]).all()
        trace.append((loss, grads_dtype, grads, params, scale[:1]))
    return trace


def bits(x):
    x = np.asarray(x)
    return x.dtype, x.shape, np.ascontiguousarray(x).view(np.uint8).tobytes()


SCALES = {
    "static Python float": lambda lib: lib.StaticLossScale(2.0**15),
    # (jmp's StaticLossScale(jnp.float32(...)) built inside pmap leaks a tracer: not a case.)
    "static 1000": lambda lib: lib.StaticLossScale(1000.0),
    "dynamic Python float": lambda lib: lib.DynamicLossScale(2.0**15, period=2),
    "dynamic float32 factor 3": lambda lib: lib.DynamicLossScale(jnp.float32(2.0**14), period=3, factor=3),
}


@pytest.mark.filterwarnings("ignore:Expected floating type")
@pytest.mark.parametrize("name", SCALES)
def test_haiku_recipe_matches_jmp_bitwise(name):
    ours, theirs = run(jmp_lite, SCALES[name]), run(jmp, SCALES[name])
    for step, (a, b) in enumerate(zip(ours, theirs)):
        for what, x, y in zip(("loss", "grads dtype", "grads", "params", "loss scale"), a, b):
            assert jax.tree_util.tree_map(bits, x) == jax.tree_util.tree_map(bits, y), (name, step, what)
    # The overflow steps were skipped (params unchanged) and a dynamic scale halved there.
    for s in OVERFLOW:
        assert not np.isfinite(np.asarray(ours[s][2]["w"])).all()
        assert jax.tree_util.tree_map(bits, ours[s][3]) == jax.tree_util.tree_map(bits, ours[s - 1][3])
        if name.startswith("dynamic"):
            assert ours[s][4][0] < ours[s - 1][4][0]


@pytest.mark.unit
def test_the_recipe_keeps_float16_gradients_float16_with_a_python_scale_as_jmp():
    trace = run(jmp_lite, SCALES["static Python float"])
    assert trace[0][1].dtype == jnp.float16  # the pmean ran in float16, as in jmp
    trace = run(jmp_lite, SCALES["dynamic float32 factor 3"])
    assert trace[0][1].dtype == jnp.float32  # a float32 array scale promotes, as in jmp
