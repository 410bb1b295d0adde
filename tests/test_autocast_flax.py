"""autocast with Flax Linen (same dtypes as apply_policy), NNX split/merge, and Equinox."""

import importlib.util
import pathlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _jaxpr import eqns
from flax import nnx

import jmp_lite
import jmp_lite.flax

pytestmark = pytest.mark.composition

POLICY = "p=f32,c=bf16,o=f32"
BF16, F32 = np.dtype(jnp.bfloat16), np.dtype(jnp.float32)


def _dot_operands(jaxpr):
    return [tuple(v.aval.dtype for v in e.invars) for e in eqns(jaxpr) if e.primitive.name == "dot_general"]


class _Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Dense(32)(x)
        x = nn.LayerNorm()(x)
        x = jax.nn.gelu(nn.Dense(32)(x))
        return nn.Dense(4)(x)


def test_linen_apply_same_dtypes_as_apply_policy():
    model, x = _Net(), jnp.ones((8, 16))
    variables = model.init(jax.random.key(0), x)
    auto = jmp_lite.autocast(model.apply, POLICY)
    policed = jmp_lite.flax.linen.apply_policy(model, POLICY)
    a = jax.make_jaxpr(auto)(variables, x).jaxpr
    b = jax.make_jaxpr(policed.apply)(variables, x).jaxpr
    assert _dot_operands(a) == _dot_operands(b) == [(BF16, BF16)] * 3
    assert auto(variables, x).dtype == policed.apply(variables, x).dtype == F32
    ga = jax.grad(lambda v: auto(v, x).sum())(variables)
    gb = jax.grad(lambda v: policed.apply(v, x).sum())(variables)
    assert jax.tree.map(lambda t: t.dtype, ga) == jax.tree.map(lambda t: t.dtype, gb)
    # the two differ only in rounding
    for u, w in zip(jax.tree.leaves(ga), jax.tree.leaves(gb)):
        np.testing.assert_allclose(u, w, rtol=0.1, atol=0.05)


def test_nnx_model_through_split_and_merge():
    model = nnx.Sequential(nnx.Linear(16, 32, rngs=nnx.Rngs(0)), nnx.LayerNorm(32, rngs=nnx.Rngs(1)))
    graphdef, state = nnx.split(model)

    @jmp_lite.autocast(POLICY)
    def forward(state, x):
        return nnx.merge(graphdef, state)(x)

    x = jnp.ones((4, 16))
    out = jax.jit(forward)(state, x)
    np.testing.assert_allclose(out, model(x), rtol=0.05, atol=0.05)
    assert out.dtype == F32
    assert _dot_operands(jax.make_jaxpr(forward)(state, x).jaxpr) == [(BF16, BF16)]
    grads = jax.grad(lambda s: forward(s, x).sum())(state)
    assert all(g.dtype == F32 for g in jax.tree.leaves(grads))


def test_equinox_example_trains_with_autocast_and_loss_scaling():
    pytest.importorskip("equinox")
    path = pathlib.Path(__file__).parent.parent / "examples" / "equinox_autocast.py"
    spec = importlib.util.spec_from_file_location("equinox_autocast", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    losses = example.train(steps=30, policy="p=f32,c=f16,o=f32")
    assert all(np.isfinite(losses))
    assert losses[-1] < 0.5 * losses[0]
