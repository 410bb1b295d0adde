"""Optimizers run eagerly (no jax.jit) inside loss_scaling: the same steps, bit for bit, as under jit.

loss_scaling traces the inner update (``jax.eval_shape``, and ``lax.cond``'s branches with
``skip="cond"``) even when the caller does not jit: the inner transformation's state is then a concrete
array inside a trace, where every operation is staged out. A check that reads values in Python
(``validate.finite_values``) must still work there.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import assert_trees_bitwise_equal

import jmp_lite
from jmp_lite import DynamicLossScale, kahan_summation, loss_scaling, low_precision_state, stochastic_rounding
from jmp_lite._src.base import validate

pytestmark = pytest.mark.composition

HALF = [jnp.bfloat16, jnp.float16]
KEY = jax.random.key(3)

# The inner optimizers for 16-bit parameters; "w" has 8192 elements, so the 8-bit state quantizes it.
INNER = {
    "kahan": lambda: optax.chain(optax.sgd(1e-3), kahan_summation()),
    "stochastic": lambda: optax.chain(optax.sgd(1e-3), stochastic_rounding(KEY)),
    "bf16-state+kahan": lambda: optax.chain(low_precision_state(optax.adam(1e-3)), kahan_summation()),
    "bf16-kahan-state+stochastic": lambda: optax.chain(
        low_precision_state(optax.adam(1e-3), rounding="kahan"), stochastic_rounding(KEY)
    ),
    "int8-state+kahan": lambda: optax.chain(low_precision_state(optax.adam(1e-3), "int8"), kahan_summation()),
    "int8-state+stochastic": lambda: optax.chain(
        low_precision_state(optax.adam(1e-3), "int8"), stochastic_rounding(KEY)
    ),
}


def params_of(dtype):
    rng = np.random.default_rng(0)
    return {
        "w": jnp.asarray(rng.standard_normal((64, 128)), dtype),
        "b": jnp.asarray(rng.standard_normal(128), dtype),
    }


def grads_of(params, step, scale=1.0):
    """Step 1 overflowed (an inf in "w"): loss_scaling skips it."""
    rng = np.random.default_rng(step)
    g = {k: jnp.asarray(rng.standard_normal(p.shape) * 1e-2 * scale, p.dtype) for k, p in params.items()}
    if step == 1:
        g["w"] = g["w"].at[3, 5].set(jnp.inf)
    return g


def run(tx, params, update, steps=3):
    """``steps`` steps of ``update``; returns the parameters and the state after each."""
    state, out = tx.init(params), []
    for step in range(steps):
        scale = jmp_lite.get_loss_scale(state).loss_scale
        updates, state = update(grads_of(params, step, scale), state, params)
        params = optax.apply_updates(params, updates)
        out.append((params, state))
    return out


def exact_jit(f):
    """``jax.jit(f)`` without XLA's excess precision (which keeps a value in float32 across a cast to 16
    bits and back inside a fused program): what an eager run, one operation per program, computes."""
    compiled = {}

    def call(*args):
        if not compiled:
            lowered = jax.jit(f).lower(*args)
            compiled[0] = lowered.compile(compiler_options={"xla_allow_excess_precision": False})
        return compiled[0](*args)

    return call


@pytest.mark.all_params  # each parametrization in CI
@pytest.mark.parametrize("skip", ["cond", "select"])
@pytest.mark.parametrize("dtype", HALF)
def test_eager_kahan_in_loss_scaling_is_bitwise_jit(dtype, skip):
    # skip="cond" (the default off GPU) traces the inner update: its concrete Kahan compensation is checked
    # inside that trace. SGD's update then Kahan's compensation, all in one program or one op at a time.
    tx = loss_scaling(INNER["kahan"](), DynamicLossScale(2.0**8), skip=skip)
    params = params_of(dtype)
    eager = run(tx, params, tx.update)
    # An eager lax.cond compiles its branches as one program, as jit does; "select" runs op by op.
    jitted = jax.jit(tx.update) if skip == "cond" else exact_jit(tx.update)
    assert_trees_bitwise_equal(eager, run(tx, params, jitted))
    (p0, s0), (p1, s1), (p2, s2) = eager
    assert_trees_bitwise_equal((p0, s0.scaled_inner_state), (p1, s1.scaled_inner_state))  # skipped
    assert int(s2.skipped_total) == 1 and bool(s2.last_grads_finite) and p2["w"].dtype == dtype
    assert not np.array_equal(np.asarray(p2["w"]), np.asarray(p1["w"]))


@pytest.mark.parametrize(
    "skip,dtype", [("cond", jnp.bfloat16), ("cond", jnp.float16), ("select", jnp.bfloat16)]
)
@pytest.mark.parametrize("inner", sorted(set(INNER) - {"kahan"}))
def test_eager_update_in_loss_scaling_skips_and_matches_jit(inner, dtype, skip):
    tx = loss_scaling(INNER[inner](), DynamicLossScale(2.0**8), skip=skip)
    params = params_of(dtype)
    eager = run(tx, params, tx.update)
    (p0, s0), (p1, s1), (p2, s2) = eager
    assert_trees_bitwise_equal((p0, s0.scaled_inner_state), (p1, s1.scaled_inner_state))  # skipped
    assert int(s2.skipped_total) == 1 and bool(s2.last_grads_finite) and p2["w"].dtype == dtype
    assert not np.array_equal(np.asarray(p2["w"]), np.asarray(p1["w"]))
    # Adam's moments round differently in one fused program (XLA rewrites some of its arithmetic), so a
    # stochastic or 8-bit rounding may land one 16-bit step apart: the parameters agree within two.
    jitted = run(tx, params, exact_jit(tx.update))[-1][0]
    eps = float(jnp.finfo(dtype).eps)
    for k in p2:
        np.testing.assert_allclose(
            np.asarray(p2[k], np.float32), np.asarray(jitted[k], np.float32), rtol=2 * eps, atol=0
        )


@pytest.mark.unit
@pytest.mark.parametrize("skip", ["cond", "select"])
@pytest.mark.parametrize("dtype", HALF)
def test_eager_update_in_loss_scaling_refuses_a_nonfinite_compensation(dtype, skip):
    # A concrete state is checked even where loss_scaling traces the inner update (skip="cond").
    tx = loss_scaling(INNER["kahan"](), DynamicLossScale(2.0**8), skip=skip)
    params = params_of(dtype)
    state = tx.init(params)
    comp = state.scaled_inner_state[1].kahan_compensation
    bad = state._replace(
        scaled_inner_state=(
            state.scaled_inner_state[0],
            state.scaled_inner_state[1]._replace(
                kahan_compensation={**comp, "b": comp["b"].at[0].set(jnp.nan)}
            ),
        )
    )
    with pytest.raises(ValueError, match=r"kahan_compensation\['b'\] holds values that are not finite"):
        tx.update(grads_of(params, 0, 1.0), bad, params)


@pytest.mark.unit
@pytest.mark.parametrize(
    "trace",
    [
        pytest.param(lambda f: jax.eval_shape(f), id="eval_shape"),
        pytest.param(lambda f: jax.lax.cond(jnp.array(True), f, f), id="cond"),
        pytest.param(lambda f: jax.jit(f)(), id="jit"),
        pytest.param(lambda f: jax.vmap(lambda _: f())(jnp.zeros(2)), id="vmap"),
    ],
)
def test_finite_values_checks_a_concrete_array_inside_any_trace(trace):
    bad = {"c": jnp.array([1.0, jnp.inf], jnp.bfloat16)}

    def f():
        validate.finite_values(bad, "state")
        return jnp.zeros(())

    with pytest.raises(ValueError, match=r"state\['c'\] holds values that are not finite"):
        trace(f)

    def g(x):  # a traced array cannot be read: it passes unchecked
        validate.finite_values({"c": x}, "state")
        return x

    jax.jit(g)(jnp.array([jnp.nan]))
    jax.eval_shape(g, jax.ShapeDtypeStruct((2,), jnp.float32))
    validate.finite_values({"c": jax.ShapeDtypeStruct((2,), jnp.float32)}, "state")  # no values to read
