"""Bad inputs to public APIs get a clear error at the API boundary (repro R12).

Each test is one row of ``shared/repros/engine/R12_bad_inputs.py`` that was accepted silently or ended
in a deep error from JAX's internals (``ufuncs.py``, ``prng.py``, ``tree_util.py``, an ``IndexError``).
The error must name the argument (or state field), what was wrong and what is accepted. Structure,
shape and dtype checks are static, so they hold under ``jax.jit`` too (checked with ``jax.eval_shape``,
which traces without compiling).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_lite
from jmp_lite import fp8
from jmp_lite.attention import choose_implementation, dot_product_attention

pytestmark = pytest.mark.unit

PB = {"w": jnp.ones(3, jnp.bfloat16)}  # one bfloat16 parameter
Q = jnp.ones((1, 4, 2, 8))


# ---------------------------------------------------------------------------------------------------------
# fp8


def test_accumulate_observed_refuses_observations_of_different_history_lengths():
    s4 = fp8.init_fp8_state(jmp_lite.Fp8Recipe(amax_history=4))
    s8 = fp8.init_fp8_state(jmp_lite.Fp8Recipe(amax_history=8))
    with pytest.raises(
        ValueError, match=r"accumulate_observed.*observed.*fp8_amax_history.*\(3, 8\).*\(3, 4\)"
    ):
        fp8.accumulate_observed(s4, s8)


def test_fp8_report_refuses_a_gradient_no_contraction_of_lhs_and_rhs_produces():
    x, w = jnp.ones((2, 3)), jnp.ones((3, 4))
    with pytest.raises(ValueError, match=r"fp8_report's grad has shape \(5, 5\).*lhs \(2, 3\).*rhs \(3, 4\)"):
        fp8.fp8_report(x, w, "hybrid,current", grad=jnp.ones((5, 5)))
    good = jax.eval_shape(lambda g: fp8.fp8_report(x, w, "hybrid,current", grad=g), jnp.ones((2, 4)))
    assert good.grad is not None  # traced, not compiled


def test_fp8_report_checks_a_state_under_every_recipe():
    """Only delayed scaling reads the state, but a wrong one is not silently dropped under the others."""
    x, w = jnp.ones((2, 3)), jnp.ones((3, 4))
    for recipe in ("hybrid,current", "hybrid,block"):
        with pytest.raises(TypeError, match="fp8_report: state must be an Fp8State .* got str"):
            jax.eval_shape(lambda x, w, r=recipe: fp8.fp8_report(x, w, r, state="junk"), x, w)
    state = fp8.init_fp8_state(jmp_lite.get_fp8_recipe("hybrid,current"))
    jax.eval_shape(lambda x, w: fp8.fp8_report(x, w, "hybrid,current", state=state), x, w)


def test_fp8_dot_general_names_a_bad_result_dtype_as_the_result():
    x, w = jnp.ones((2, 3)), jnp.ones((3, 4))
    for recipe in ("hybrid,current", "hybrid,block"):
        with pytest.raises(
            ValueError, match="preferred_element_type: must be float32, bfloat16 or float16, got int32"
        ):
            jax.eval_shape(
                lambda x, w, r=recipe: fp8.dot_general(
                    x, w, (((1,), (0,)), ((), ())), preferred_element_type=jnp.int32, recipe=r
                ),
                x,
                w,
            )


def test_fp8_report_with_a_block_recipe_needs_the_contractions_layout():
    x, w = jnp.ones((2, 3)), jnp.ones((3, 4))
    report = jax.eval_shape(lambda: fp8.fp8_report(x, w, "hybrid,block"))
    assert report.grad is None
    # the gradient's axes are the output's, in order: (4, 2) is a contraction's shape, not this one's
    with pytest.raises(ValueError, match=r"grad has shape \(4, 2\).*output shape \(2, 4\)"):
        fp8.fp8_report(x, w, "hybrid,block", grad=jnp.ones((4, 2)))
    with pytest.raises(ValueError, match=r"lhs \(2, 3\) and rhs \(4, 3\) do not contract.*dimension_numbers"):
        fp8.fp8_report(x, jnp.ones((4, 3)), "hybrid,mxfp8")
    with pytest.raises(TypeError, match=r"fp8_report: dimension_numbers must be \(\(lhs_contracting"):
        fp8.fp8_report(x, w, "hybrid,block", dimension_numbers=(1, 0))
    with pytest.raises(ValueError, match=r"no axes to contract.*dimension_numbers="):
        fp8.fp8_report(jnp.ones(()), w, "hybrid,block")
    # per-tensor recipes check the layout when one is given
    with pytest.raises(ValueError, match=r"grad has shape \(4, 2\).*output shape \(2, 4\)"):
        fp8.fp8_report(
            x, w, "hybrid,current", grad=jnp.ones((4, 2)), dimension_numbers=(((1,), (0,)), ((), ()))
        )


@pytest.mark.parametrize("recipe", ["hybrid,current", "hybrid,block"])
def test_fp8_dot_general_refuses_axes_beyond_an_operands_rank(recipe):
    x, w = jnp.ones((2, 3)), jnp.ones((3, 4))
    # axis 2 of a 2-D lhs used to wrap around to axis 0
    with pytest.raises(ValueError, match=r"name lhs axes \[2\], but lhs has 2 dimensions \(axes -2 to 1\)"):
        fp8.dot_general(x, w, (((2,), (0,)), ((), ())), recipe=recipe)
    with pytest.raises(ValueError, match=r"name rhs axes \[-3\]"):
        fp8.dot_general(x, w, (((1,), (-3,)), ((), ())), recipe=recipe)
    with pytest.raises(ValueError, match=r"fp8_report: dimension_numbers .* name lhs axes \[5\]"):
        fp8.fp8_report(x, w, recipe, dimension_numbers=(((5,), (0,)), ((), ())))
    negative = jax.eval_shape(
        lambda x, w: fp8.dot_general(x, w, (((-1,), (0,)), ((), ())), recipe=recipe), x, w
    )
    assert negative.shape == (2, 4)  # a negative axis within the rank is accepted


def _fp8_autocast():
    g = jmp_lite.autocast(lambda p, x: x @ p["w"], "p=f32,c=bf16,o=f32", fp8="hybrid,delayed,history=4")
    params, x = {"w": jnp.ones((3, 4))}, jnp.ones((2, 3))
    return g, params, x, g.init_fp8_state(params, x)


def test_autocast_repairs_a_restored_fp8_scale_that_is_not_positive_and_finite():
    """Repaired on use as update_fp8_state repairs it (an empty history gives scale 1), eager and jitted."""
    g, params, x, states = _fp8_autocast()
    want = g(params, x, fp8_state=states)
    jitted = jax.jit(lambda p, x, s: g(p, x, fp8_state=s))  # compiled once: every state has one shape
    for bad in (0.0, float("nan"), float("inf"), -1.0):
        bad_states = {"0": {"w": states["0"]["w"]._replace(fp8_scale=jnp.array([bad, 1.0, bad]))}}
        np.testing.assert_array_equal(g(params, x, fp8_state=bad_states), want)
        np.testing.assert_array_equal(jitted(params, x, bad_states), want)


def test_autocast_fp8_state_reads_the_flat_form_and_refuses_other_leaves():
    g, params, x, states = _fp8_autocast()
    want = g(params, x, fp8_state=states)
    np.testing.assert_array_equal(g(params, x, fp8_state={"0/w": states["0"]["w"]}), want)  # before 0.4
    with pytest.raises(TypeError, match=r"an Fp8State at each weight .*found ArrayImpl at '0/w'"):
        g(params, x, fp8_state={"0": {"w": jnp.ones(3)}})
    with pytest.raises(TypeError, match="got list"):
        g(params, x, fp8_state=[states])


def test_autocast_refuses_fp8_state_fields_that_are_not_float32():
    g, params, x, states = _fp8_autocast()
    ints = {"0": {"w": jax.tree_util.tree_map(lambda a: a.astype(jnp.int32), states["0"]["w"])}}
    with pytest.raises(TypeError, match=r"fp8_scale has dtype int32, expected float32"):
        g(params, x, fp8_state=ints)


# ---------------------------------------------------------------------------------------------------------
# kahan_summation, stochastic_rounding, low_precision_state: restored states


def test_kahan_refuses_a_restored_nan_compensation():
    bad = jmp_lite.KahanSummationState({"w": jnp.full(3, jnp.nan, jnp.bfloat16)})
    with pytest.raises(ValueError, match=r"kahan_compensation\['w'\].*not finite"):
        jmp_lite.kahan_summation().update(PB, bad, PB)
    # Under jit the values are not seen: as documented, the update (and so the parameter) is NaN.
    updates, _ = jax.jit(jmp_lite.kahan_summation().update)(PB, bad, PB)
    assert np.isnan(np.asarray(updates["w"])).all()


def test_kahan_refuses_a_restored_compensation_missing_a_parameter():
    params = {"w": PB["w"], "v": PB["w"]}
    bad = jmp_lite.KahanSummationState({"w": jnp.zeros(3, jnp.bfloat16)})
    tx = jmp_lite.kahan_summation()
    for update in (tx.update, lambda *a: jax.eval_shape(tx.update, *a)):
        with pytest.raises(ValueError, match=r"kahan_compensation lacks \['v'\]"):
            update(params, bad, params)


def test_kahan_refuses_a_restored_compensation_of_the_wrong_shape():
    bad = jmp_lite.KahanSummationState({"w": jnp.zeros(4, jnp.bfloat16)})
    tx = jmp_lite.kahan_summation()
    for update in (tx.update, lambda *a: jax.eval_shape(tx.update, *a)):
        with pytest.raises(ValueError, match=r"kahan_compensation\['w'\] has shape \(4,\), expected \(3,\)"):
            update(PB, bad, PB)


def test_stochastic_rounding_refuses_a_restored_key_that_is_none():
    tx = jmp_lite.stochastic_rounding(jax.random.key(0))
    with pytest.raises(TypeError, match=r"param_rounding_key is None, expected uint32\[2\]"):
        tx.update(PB, jmp_lite.StochasticRoundingState(None), PB)


def test_stochastic_rounding_refuses_a_restored_key_of_float32():
    tx = jmp_lite.stochastic_rounding(jax.random.key(0))
    bad = jmp_lite.StochasticRoundingState(jnp.zeros(2))
    for update in (tx.update, lambda *a: jax.eval_shape(tx.update, *a)):
        with pytest.raises(TypeError, match=r"param_rounding_key has dtype float32, expected uint32"):
            update(PB, bad, PB)


def _adam_state(rounding):
    tx = jmp_lite.low_precision_state(optax.adam(1e-3), rounding=rounding)
    p = {"w": jnp.ones(3)}
    return tx, p, tx.init(p)


def test_low_precision_state_kahan_refuses_a_state_restored_without_compensation():
    tx, p, s = _adam_state("kahan")
    with pytest.raises(TypeError, match=r"state_compensation is None, expected a tuple"):
        tx.update(p, s._replace(state_compensation=None), p)


def test_low_precision_state_kahan_refuses_a_compensation_tuple_too_short():
    tx, p, s = _adam_state("kahan")
    short = s._replace(state_compensation=s.state_compensation[:1])
    for update in (tx.update, lambda *a: jax.eval_shape(tx.update, *a)):
        with pytest.raises(ValueError, match=r"state_compensation has 1 entries, expected 2"):
            update(p, short, p)


def test_low_precision_state_stochastic_refuses_a_state_restored_without_key():
    tx, p, s = _adam_state("stochastic")
    with pytest.raises(TypeError, match=r"state_rounding_key is None, expected uint32\[2\]"):
        tx.update(p, s._replace(state_rounding_key=None), p)


# ---------------------------------------------------------------------------------------------------------
# attention


def test_attention_refuses_a_scale_that_is_not_a_number():
    with pytest.raises(TypeError, match=r"dot_product_attention's scale must be a real number.*'a'"):
        dot_product_attention(Q, Q, Q, scale="a")


def test_attention_refuses_a_nan_scale():
    with pytest.raises(ValueError, match=r"dot_product_attention's scale=nan is not a finite float32"):
        dot_product_attention(Q, Q, Q, scale=float("nan"))


def test_attention_refuses_is_causal_that_is_not_a_bool():
    with pytest.raises(TypeError, match=r"dot_product_attention's is_causal must be True or False.*'yes'"):
        dot_product_attention(Q, Q, Q, is_causal="yes")


def test_attention_refuses_the_tpu_kernel_on_another_backend():
    with pytest.raises(
        ValueError,
        match=r"implementation on the 'cpu' backend \('tpu_flash' needs a TPU backend\) must be one of "
        r"None, 'blockwise', 'xla'; got 'tpu_flash'",
    ):
        dot_product_attention(Q, Q, Q, implementation="tpu_flash")


def test_attention_refuses_a_call_the_tpu_kernel_cannot_take_when_asked_for_it(monkeypatch):
    """On a TPU (faked: nothing runs), a call outside the kernel's constraints is refused, not run wrong."""
    from jmp_lite._src.kernels import attention_kernels

    monkeypatch.setattr(attention_kernels, "_backend_name", lambda: "tpu")
    with pytest.raises(ValueError, match=r"implementation='tpu_flash' cannot take this call: .*128"):
        dot_product_attention(Q, Q, Q, implementation="tpu_flash")


def test_choose_implementation_refuses_a_bias_that_is_not_an_array():
    with pytest.raises(TypeError, match=r"choose_implementation's bias must be a floating array.*str"):
        choose_implementation(Q, Q, Q, bias="x")
