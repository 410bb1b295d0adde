"""jmp_lite.explain on abstract inputs (its decisions and reasons are tested in test_engine_contract.py)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import jmp_lite
from jmp_lite.flax.linen import apply_policy
from jmp_lite.flax.nnx import apply_policy as nnx_apply_policy

pytestmark = pytest.mark.unit

POLICY = "p=f32,c=bf16,o=f32"


def _dots(e):
    return [(d.scope, d.ran) for d in e.find(primitive="dot_general")]


def test_explain_accepts_shape_dtype_structs_as_residual_bytes_does():
    # explain only traces: jax.eval_shape(model.init, ...) and ShapeDtypeStruct inputs are enough, and
    # they give what the concrete arrays give (a model too large to allocate can be explained)
    x = jnp.ones((2, 3))
    sds = jax.ShapeDtypeStruct(x.shape, x.dtype)

    model = apply_policy(nn.Sequential([nn.Dense(4), nn.tanh, nn.Dense(2)]), POLICY)
    variables = model.init(jax.random.key(0), x)
    abstract = jax.eval_shape(model.init, jax.random.key(0), sds)
    concrete, shaped = jmp_lite.explain(model)(variables, x), jmp_lite.explain(model)(abstract, sds)
    assert _dots(shaped) == _dots(concrete) == [(f"Sequential/layers_{i}", ("bfloat16",) * 2) for i in (0, 2)]
    assert shaped.events == concrete.events and shaped.residuals.total == concrete.residuals.total > 0

    def f(x, w, scale):  # a plain autocast function, an abstract argument next to a Python number
        return (jnp.tanh(x @ w * scale) @ w.T).sum()

    w = jax.ShapeDtypeStruct((3, 4), jnp.float32)
    shaped = jmp_lite.explain(f, POLICY)(sds, w, 2.0)
    concrete = jmp_lite.explain(f, POLICY)(x, jnp.ones((3, 4)), 2.0)
    assert shaped.events == concrete.events and shaped.residuals.total == concrete.residuals.total > 0
    mixed = jmp_lite.explain(f, POLICY)(x, w, scale=2.0)  # one of each, and a keyword
    assert mixed.events == concrete.events

    view = nnx_apply_policy(nnx.Linear(3, 4, rngs=nnx.Rngs(0)), POLICY)  # an NNX view's input
    assert _dots(jmp_lite.explain(view)(sds)) == _dots(jmp_lite.explain(view)(x))
