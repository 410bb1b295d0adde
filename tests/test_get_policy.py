"""get_policy: jmp's grammar, Keras names, aliases, and clear errors."""

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jmp_lite import Policy, get_policy

pytestmark = pytest.mark.unit

F16, BF16, F32, F64 = (np.dtype(d) for d in (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64))


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("params=float32,compute=bfloat16,output=float32", (F32, BF16, F32)),
        ("p=f32,c=bf16,o=f32", (F32, BF16, F32)),
        ("c=f16", (F32, F16, F16)),  # params default f32, output follows compute
        ("p=f16", (F16, F16, F16)),  # compute follows params
        ("p=f16,c=bf16", (F16, BF16, BF16)),
        ("o=bf16", (F32, F32, BF16)),
        ("bf16", (BF16, BF16, BF16)),
        ("full", (F32, F32, F32)),
        ("half", (F16, F16, F16)),  # jmp: f16 off TPU
        ("mixed_float16", (F32, F16, F16)),
        ("mixed_bfloat16", (F32, BF16, BF16)),
        ("fp16", (F16, F16, F16)),
        ("FP32", (F32, F32, F32)),
        ("  Params = Float32 , Compute = BFloat16 ", (F32, BF16, BF16)),
        ("p=float64", (F64, F64, F64)),
    ],
)
def test_grammar(spec, expected):
    assert get_policy(spec) == Policy(*expected)


@pytest.mark.parametrize(
    "spec, words",
    [
        ("", "empty"),
        ("p=f32,q=bf16", "unknown key 'q'"),
        ("p=f32,c=int8", "int8"),
        ("p=f32,,c=bf16", "malformed part ''"),
        ("p=f32,c", "malformed part 'c'"),
        ("p==f32", "malformed part"),
        ("p=f32=f16", "malformed part"),
        ("p=f32,p=f16", "param is given twice"),
        ("params=float32,compute=", "malformed part 'compute='"),
        ("float8", "neither a dtype name"),
        ("mixed_float8", "neither a dtype name"),
        ("=f32", "malformed part"),
    ],
)
def test_malformed_strings_raise_value_error_naming_the_part(spec, words):
    with pytest.raises(ValueError, match=words) as info:
        get_policy(spec)
    if spec:
        assert "bfloat16" in str(info.value)  # lists what is accepted


def test_non_string_raises_type_error():
    with pytest.raises(TypeError, match="expects a str"):
        get_policy(None)  # type: ignore[arg-type]


_TOKENS = ["p", "c", "o", "params", "compute", "output", "=", ",", "f32", "bf16", "f16", "x", "int8", " ", ""]


@pytest.mark.property
@given(st.lists(st.sampled_from(_TOKENS), max_size=12).map("".join) | st.text(max_size=30))
@settings(max_examples=400, deadline=None)
def test_any_string_parses_or_raises_value_error(spec):
    try:
        policy = get_policy(spec)
    except ValueError as e:
        assert str(e)
    else:
        assert isinstance(policy, Policy)
        assert get_policy(str(policy)) == policy


_VALID_PART = st.sampled_from(["p=f32", "c=bf16", "o=f16"])
_BROKEN_PART = st.sampled_from(["p=", "=bf16", "c=int8", "z=f32", "o", "c=f16=f32", "p=bf17", ""])


@pytest.mark.property
@given(st.lists(_VALID_PART, max_size=2, unique=True), _BROKEN_PART, st.integers(0, 2))
@settings(max_examples=200, deadline=None)
def test_strings_with_a_broken_part_raise_value_error(valid, broken, where):
    parts = list(valid)
    parts.insert(min(where, len(parts)), broken)
    with pytest.raises(ValueError):
        get_policy(",".join(parts))
