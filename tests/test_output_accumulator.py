"""A 16-bit contraction whose result only leaves the program as a float32 output (a model's logits
under ``o=float32``) hands out its float32 accumulator on a TPU, outside the 16-bit checkpoint.

Compiled for a v5e chip, that is what keeps a Linen or NNX model's logits one float32 array instead of
a float32 copy beside the 16-bit one (tests/test_compiled_targets.py measures it). Here, on the CPU,
the program traced for a TPU (``scopes.entering(platform="tpu")``, as ``jmp_lite.memory.compiled``
traces it) is checked for what it computes; every other platform keeps the rounded result.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jmp_lite
from jmp_lite._src.engine import scopes

pytestmark = pytest.mark.unit

POLICIES = {"bf16": ("p=f32,c=bf16,o=f32", jnp.bfloat16), "f16": ("p=f32,c=f16,o=f32", jnp.float16)}
CHECKPOINT = "remat2"  # jax.checkpoint's primitive
X = jax.random.normal(jax.random.key(0), (8, 32))
W = jax.random.normal(jax.random.key(1), (32, 16)) / 4


def head(x, w):
    return x @ w  # the contraction is the last op: its result is the program's output


def accumulator(x, w, dtype):
    """What the 16-bit contraction accumulates, unrounded."""
    return lax.dot(x.astype(dtype), w.astype(dtype), preferred_element_type=jnp.float32)


def traced_for(platform, fun):
    """``fun`` traced (and run here) as if compiled for ``platform``: a new jit per platform, so JAX's
    trace cache cannot hand one platform's program to the other."""
    with scopes.entering(platform=platform):
        return jax.jit(lambda *a: fun(*a)).lower(X, W).compile()


@pytest.mark.parametrize("policy", POLICIES)
def test_on_a_tpu_the_output_is_the_float32_accumulator_elsewhere_the_16_bit_result(policy):
    spec, dtype = POLICIES[policy]
    f = jmp_lite.autocast(head, spec)
    on_tpu, on_cpu = traced_for("tpu", f)(X, W), traced_for("cpu", f)(X, W)
    acc = accumulator(X, W, dtype)
    assert on_tpu.dtype == on_cpu.dtype == jnp.float32
    np.testing.assert_array_equal(on_tpu, acc)
    np.testing.assert_array_equal(on_cpu, acc.astype(dtype).astype(jnp.float32))
    assert np.any(np.asarray(on_tpu) != np.asarray(on_cpu))  # the accumulator is not rounded


@pytest.mark.parametrize("policy", POLICIES)
def test_its_gradient_is_the_16_bit_programs_within_rounding(policy):
    spec, dtype = POLICIES[policy]

    def loss(x, w):
        return jnp.sum(jnp.sin(jmp_lite.autocast(head, spec)(x, w)))

    grads = {p: traced_for(p, jax.grad(loss, argnums=(0, 1)))(X, W) for p in ("tpu", "cpu")}
    exact = jax.grad(lambda x, w: jnp.sum(jnp.sin(head(x, w))), argnums=(0, 1))(X, W)
    tolerance = float(jnp.finfo(dtype).eps) * 8
    for tpu, cpu, f32 in zip(grads["tpu"], grads["cpu"], exact):
        assert tpu.dtype == f32.dtype == jnp.float32
        scale = float(jnp.max(jnp.abs(f32)))
        assert float(jnp.max(jnp.abs(tpu - f32))) <= tolerance * scale
        assert float(jnp.max(jnp.abs(tpu - cpu))) <= tolerance * scale


def _top_level(fun, *args):
    with scopes.entering(platform="tpu"):
        return jax.make_jaxpr(fun)(*args).jaxpr


def test_the_contraction_runs_after_the_checkpoint_and_its_cotangent_skips_the_barrier():
    f = jmp_lite.autocast(head, "p=f32,c=bf16,o=f32")
    top = _top_level(f, X, W)
    names = [e.primitive.name for e in top.eqns]
    assert names.index("dot_general") > names.index(CHECKPOINT), names
    (dot,) = [e for e in top.eqns if e.primitive.name == "dot_general"]
    assert np.dtype(dot.params["preferred_element_type"]) == np.float32
    assert {np.dtype(v.aval.dtype) for v in dot.invars} == {np.dtype(jnp.bfloat16)}
    # without the checkpoint (remat_float32=False) there is nothing to run after: the same contraction
    plain = _top_level(jmp_lite.autocast(head, "p=f32,c=bf16,o=f32", remat_float32=False), X, W)
    assert CHECKPOINT not in [e.primitive.name for e in plain.eqns]


@pytest.mark.parametrize(
    "case",
    ["read_again", "returned_twice", "output_bf16", "another_op_last"],
)
def test_a_result_the_program_reads_or_keeps_in_16_bits_stays_rounded(case):
    spec = "p=f32,c=bf16,o=bf16" if case == "output_bf16" else "p=f32,c=bf16,o=f32"
    fun = {
        "read_again": lambda x, w: (lambda y: (y, jnp.sum(y**2)))(head(x, w)),
        "returned_twice": lambda x, w: (lambda y: (y, y))(head(x, w)),
        "output_bf16": head,
        "another_op_last": lambda x, w: head(x, w) * 2.0,
    }[case]
    f = jmp_lite.autocast(fun, spec)
    out = jax.tree.leaves(traced_for("tpu", f)(X, W))[0]
    rounded = out.astype(jnp.bfloat16).astype(out.dtype)
    np.testing.assert_array_equal(out, rounded)
    top = _top_level(f, X, W)
    assert "dot_general" not in [e.primitive.name for e in top.eqns]  # all of it in the checkpoint


def test_a_linen_models_logits_are_the_accumulator_and_train_under_jit_on_a_tpu():
    from jmp_lite._demo.gpt import gpt_model, next_token_loss
    from jmp_lite.flax.linen import apply_policy

    model = gpt_model(layers=1, width=32, heads=2, context=8, vocab=64)
    tokens = jax.random.randint(jax.random.key(2), (2, 9), 0, 64)
    params = model.init(jax.random.key(3), tokens[:, :-1])["params"]
    policy = apply_policy(model, "p=f32,c=bf16,o=f32")
    logits = {}
    for platform in ("tpu", "cpu"):
        with scopes.entering(platform=platform):
            logits[platform] = jax.jit(lambda p, t: policy.apply({"params": p}, t[:, :-1]))(params, tokens)
            loss, grads = jax.jit(jax.value_and_grad(next_token_loss(policy)))(params, tokens)
        assert np.isfinite(float(loss))
        assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))
    tpu, cpu = logits["tpu"], logits["cpu"]
    np.testing.assert_array_equal(tpu.astype(jnp.bfloat16), cpu.astype(jnp.bfloat16))
    assert np.any(np.asarray(tpu) != np.asarray(cpu))
