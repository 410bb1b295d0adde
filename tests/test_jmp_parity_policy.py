"""Policy and get_policy give the same results as jmp 0.0.4 wherever jmp works."""

import jax
import jax.numpy as jnp
import jmp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jmp_lite

pytestmark = pytest.mark.unit

JMP_NAMES = ["bf16", "bfloat16", "f16", "float16", "f32", "float32", "full", "f64", "float64", "half"]
JMP_KEYS = [("p", "params"), ("c", "compute"), ("o", "output")]


def same_policy(ours: jmp_lite.Policy, theirs: jmp.Policy) -> bool:
    return (
        ours.param_dtype == np.dtype(theirs.param_dtype)
        and ours.compute_dtype == np.dtype(theirs.compute_dtype)
        and ours.output_dtype == np.dtype(theirs.output_dtype)
    )


@pytest.mark.property
@given(
    st.lists(st.tuples(st.sampled_from([0, 1, 2]), st.booleans(), st.sampled_from(JMP_NAMES)), max_size=3),
    st.sampled_from(JMP_NAMES),
)
@settings(max_examples=200, deadline=None)
def test_get_policy_matches_jmp(parts, bare):
    seen, pieces = set(), []
    for field, long, name in parts:
        if field in seen:  # jmp lets a later key win; we reject repeats (documented)
            continue
        seen.add(field)
        pieces.append(f"{JMP_KEYS[field][int(long)]}={name}")
    for spec in ([",".join(pieces)] if pieces else []) + [bare]:
        assert same_policy(jmp_lite.get_policy(spec), jmp.get_policy(spec)), spec


@pytest.mark.parametrize("spec", ["p=f32,c=bf16,o=f32", "c=f16", "bf16", "p=f16,c=f16,o=f32"])
def test_casts_match_jmp_bitwise(spec):
    ours, theirs = jmp_lite.get_policy(spec), jmp.get_policy(spec)
    tree = {
        "x": jnp.linspace(-2, 2, 7),
        "n": np.linspace(0, 1, 3),
        "i": jnp.arange(3),
        "s": 1.5,
        "h": jnp.ones(2, jnp.bfloat16),
    }
    for method in ("cast_to_param", "cast_to_compute", "cast_to_output"):
        a, b = getattr(ours, method)(tree), getattr(theirs, method)(tree)
        for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
            assert type(x) is type(y) or (isinstance(x, jax.Array) and isinstance(y, jax.Array))
            assert np.asarray(x).dtype == np.asarray(y).dtype
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_str_parses_in_both_directions():
    for spec in ["p=f32,c=bf16,o=f32", "p=f16,c=f16,o=f16", "p=f64,c=f32,o=bf16"]:
        theirs = jmp.get_policy(spec)
        ours = jmp_lite.get_policy(spec)
        assert jmp_lite.get_policy(str(theirs)) == ours
        assert same_policy(ours, jmp.get_policy(str(ours)))


def test_cast_to_full_and_half_match_jmp():
    x = {"a": jnp.ones(2, jnp.bfloat16), "b": jnp.ones(2)}
    for ours, theirs in (
        (jmp_lite.cast_to_full, jmp.cast_to_full),
        (jmp_lite.cast_to_half, jmp.cast_to_half),
    ):
        assert jax.tree_util.tree_map(lambda v: v.dtype, ours(x)) == jax.tree_util.tree_map(
            lambda v: v.dtype, theirs(x)
        )
    assert jmp_lite.half_dtype() == jmp.half_dtype()
