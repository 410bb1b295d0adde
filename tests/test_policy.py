"""Policy: validation, immutability, casts (eager and under jit), strings."""

import pickle

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jmp_lite
from jmp_lite import Policy, get_policy

pytestmark = pytest.mark.unit

F16, BF16, F32, F64 = (np.dtype(d) for d in (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64))
FLOATS = [F16, BF16, F32, F64, np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2)]


def test_fields_and_jmp_aliases():
    p = Policy(jnp.float32, "bf16", np.float16)
    assert (p.param, p.compute, p.output) == (F32, BF16, F16)
    assert (p.param_dtype, p.compute_dtype, p.output_dtype) == (F32, BF16, F16)
    assert Policy(param_dtype=F32, compute_dtype=BF16, output_dtype=F16) == p
    assert p.with_output_dtype(F32).output == F32
    assert p.with_param(BF16).param == BF16 and p.with_compute(F32).compute == F32
    assert p.with_output(F32) != p


@pytest.mark.parametrize(
    "args, exc, words",
    [
        (("x", 1, None), ValueError, "Policy.param"),
        ((jnp.float32, 1, jnp.float32), TypeError, "Policy.compute"),
        ((jnp.float32, jnp.float32, None), TypeError, "output"),
        ((jnp.int32, jnp.float32, jnp.float32), ValueError, "int32"),
        ((jnp.float32, jnp.bool_, jnp.float32), ValueError, "bool"),
        ((jnp.float32, jnp.float32, jnp.complex64), ValueError, "complex64"),
        ((jnp.float32, jnp.float32, object()), TypeError, "output"),
    ],
)
def test_invalid_fields_name_the_field(args, exc, words):
    with pytest.raises(exc, match=words) as info:
        Policy(*args)
    assert "accepted" in str(info.value)


def test_immutable_hashable_picklable_and_static_under_jit():
    p = get_policy("p=f32,c=bf16,o=f32")
    with pytest.raises(AttributeError):
        p.param = F16  # type: ignore[misc]
    assert hash(p) == hash(get_policy("params=float32,compute=bfloat16,output=float32"))
    assert pickle.loads(pickle.dumps(p)) == p
    traces = []

    def f(x, policy):
        traces.append(policy)
        return policy.cast_to_compute(x)

    jf = jax.jit(f, static_argnums=1)
    assert jf(jnp.ones(2), p).dtype == BF16
    assert jf(jnp.ones(2), get_policy("p=f32,c=bf16,o=f32")).dtype == BF16
    assert len(traces) == 1
    assert jf(jnp.ones(2), p.with_compute(F16)).dtype == F16
    assert len(traces) == 2


@pytest.mark.parametrize("compute", [BF16, F16])
def test_casts_only_floating_arrays(compute):
    p = Policy(F32, compute, F32)
    key = jax.random.key(0)
    tree = {
        "f32": jnp.ones(3),
        "np": np.ones(2, np.float64),
        "i": jnp.arange(3),
        "b": jnp.array([True]),
        "key": key,
        "raw_key": jax.random.PRNGKey(0),
        "none": None,
        "s": "text",
        "py": 1.5,
        "npscalar": np.float32(2.0),
    }
    out = p.cast_to_compute(tree)
    assert out["f32"].dtype == compute and out["np"].dtype == compute
    assert isinstance(out["np"], np.ndarray)  # numpy stays numpy, as in jmp
    for k in ("i", "b", "key", "raw_key", "none", "s", "py", "npscalar"):
        assert out[k] is tree[k], k
    back = p.cast_to_param(out)
    assert back["f32"].dtype == F32


@pytest.mark.parametrize("compute", [BF16, F16])
def test_casts_under_jit_and_no_op_when_dtype_matches(compute):
    p = Policy(F32, compute, F32)
    jaxpr = jax.make_jaxpr(p.cast_to_compute)({"a": jnp.ones(2), "b": jnp.ones(2, compute)})
    converts = [e for e in jaxpr.eqns if e.primitive.name == "convert_element_type"]
    assert len(converts) == 1  # only "a"; "b" already has the compute dtype
    assert not jax.make_jaxpr(p.cast_to_output)(jnp.ones(2)).eqns
    y = jax.jit(lambda x: p.cast_to_output(p.cast_to_compute(x) * 2))(jnp.ones(4))
    assert y.dtype == F32
    # vmap keeps the cast per example
    assert jax.vmap(p.cast_to_compute)(jnp.ones((3, 2))).dtype == compute


def test_fp8_storage_policy_named_clearly():
    p = Policy(F32, F32, ml_dtypes.float8_e4m3fn)
    assert str(p) == "p=f32,c=f32,o=float8_e4m3fn"
    assert get_policy(str(p)) == p
    assert p.cast_to_output(jnp.ones(2)).dtype == np.dtype(ml_dtypes.float8_e4m3fn)


@pytest.mark.property
@given(st.sampled_from(FLOATS), st.sampled_from(FLOATS[:4]), st.sampled_from(FLOATS))
@settings(max_examples=100, deadline=None)
def test_str_round_trips(p, c, o):
    policy = Policy(p, c, o)
    assert get_policy(str(policy)) == policy
    assert get_policy(str(policy).upper().replace(",", " , ")) == policy


@pytest.mark.parametrize("fp8", [ml_dtypes.float8_e4m3fn, "float8_e5m2"])
def test_fp8_compute_is_rejected(fp8):
    with pytest.raises(ValueError, match="Policy.compute: float8.*storage format"):
        Policy(F32, fp8, F32)
    with pytest.raises(ValueError, match="storage format"):
        get_policy("p=f32,c=float8_e4m3fn")


def test_half_dtype_and_preferred_half_dtype():
    assert jmp_lite.half_dtype() == jnp.float16  # CPU, as jmp
    assert jmp_lite.preferred_half_dtype() == jnp.bfloat16

    class FakeGpu:
        platform = "gpu"

        def __init__(self, cc):
            self.compute_capability = cc

    assert jmp_lite.preferred_half_dtype(FakeGpu("8.0")) == jnp.bfloat16
    assert jmp_lite.preferred_half_dtype(FakeGpu("9.0")) == jnp.bfloat16
    assert jmp_lite.preferred_half_dtype(FakeGpu("7.5")) == jnp.float16
    assert jmp_lite.preferred_half_dtype(FakeGpu(None)) == jnp.float16
    assert jmp_lite.preferred_half_dtype(FakeGpu("gfx90a")) == jnp.float16  # ROCm string: no crash


def test_preferred_half_dtype_takes_backend_names_and_says_what_it_accepts():
    assert jmp_lite.preferred_half_dtype("cpu") == jnp.bfloat16
    if not any(d.platform == "gpu" for d in jax.devices()):
        with pytest.raises(ValueError, match="no 'gpu' backend.*jax.Device, None .*or the name of a backend"):
            jmp_lite.preferred_half_dtype("gpu")
    with pytest.raises(TypeError, match="takes a jax.Device .*None .*backend name"):
        jmp_lite.preferred_half_dtype(3)


def test_cast_to_full_and_half():
    assert jmp_lite.cast_to_full({"a": jnp.ones(1, BF16)})["a"].dtype == F32
    assert jmp_lite.cast_to_half(jnp.ones(1)).dtype == np.dtype(jmp_lite.half_dtype())


def test_numpy_dtype_strings_and_bytes_are_accepted_alike_as_jmp_passes_them_through():
    import jmp

    f32_f16 = jmp_lite.Policy(jnp.float32, jnp.float16, jnp.float32)
    for spec in (("f4", "f2", "f4"), (b"f4", b"f2", b"f4"), ("float32", "<f2", b"float32")):
        policy = jmp_lite.Policy(*spec)
        assert policy == f32_f16
        theirs = jmp.Policy(*(np.dtype(s) for s in spec))
        x = {"a": jnp.ones(2, jnp.float32)}
        assert policy.cast_to_compute(x)["a"].dtype == theirs.cast_to_compute(x)["a"].dtype
    with pytest.raises(ValueError, match="Policy.compute must be a floating dtype, got int32"):
        jmp_lite.Policy("f4", "i4", "f4")
    with pytest.raises(ValueError, match="Policy.param: Unknown dtype 'q9'.*accepted"):
        jmp_lite.Policy(b"q9", "f4", "f4")


def test_dtype_to_names_matches_str_and_jmp_keys():
    import jmp._src.policy as jmp_policy

    for dtype in (np.float16, jnp.float16, jnp.bfloat16, np.float32, jnp.float32, np.dtype("float64")):
        names = jmp_lite.dtype_to_names[dtype]
        assert str(jmp_lite.Policy(dtype, dtype, dtype)) == ",".join(f"{k}={names[0]}" for k in "pco")
        if np.dtype(dtype) != np.float32:  # jmp prints float32 as "full", we print "f32" (both parse)
            assert names[:2] == jmp_policy.dtype_to_names[np.dtype(dtype).type][:2]
    assert set(jmp_policy.dtype_to_names) <= set(jmp_lite.dtype_to_names)
    with pytest.raises(KeyError):
        jmp_lite.dtype_to_names[np.int32]
