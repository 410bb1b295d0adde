"""gradient_diagnostics against a NumPy (ml_dtypes) reference at the edges of each dtype."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jmp_lite

pytestmark = pytest.mark.unit

DTYPES = [np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16), np.dtype(ml_dtypes.float8_e4m3fn)]


def edge_values(dtype):
    """Values at and around every boundary of ``dtype``, in float32, both signs."""
    fi = ml_dtypes.finfo(dtype)
    tiny, max_ = float(fi.tiny), float(fi.max)
    smallest_sub = float(fi.smallest_subnormal)
    vals = [
        0.0, -0.0, tiny, tiny * 0.75, tiny * 1.5, smallest_sub, smallest_sub * 0.5, smallest_sub * 0.4,
        smallest_sub * 0.6, smallest_sub * 1e-3, max_, max_ * 0.5, max_ * 1.01, max_ * 4, 1.0, 3e-3,
        np.inf, -np.inf, np.nan,
    ]  # fmt: skip
    vals = vals + [-v for v in vals if np.isfinite(v) and v != 0]
    with np.errstate(over="ignore"):  # max * 4 is inf in float32 for the float32-range dtypes: fine
        return np.array(vals, np.float32)


def reference(x, dtype, scale):
    """What the fractions must be, from NumPy casts."""
    # XLA (CPU and GPU) flushes float32 denormals to zero, in inputs and results; bfloat16's
    # subnormals are float32 denormals, so under XLA they are zeros.
    ftz = lambda a: np.where(np.abs(a) < np.finfo(np.float32).tiny, np.float32(0), a)  # noqa: E731
    x = ftz(np.asarray(x, np.float32))
    with np.errstate(over="ignore", invalid="ignore"):
        scaled = ftz(x * np.float32(scale))
        cast = ftz(scaled.astype(dtype).astype(np.float32))
    finite = np.isfinite(x)
    nonzero = finite & (x != 0)
    tiny = float(ml_dtypes.finfo(dtype).tiny)
    under = nonzero & (cast == 0)
    sub = (cast != 0) & (np.abs(cast) < tiny)
    over = (np.isfinite(scaled) & ~np.isfinite(cast)) | (finite & ~np.isfinite(scaled))
    n = x.size
    return under.sum() / n, sub.sum() / n, over.sum() / n, (x == 0).sum() / n, (~finite).sum() / n


@pytest.mark.numerics
@pytest.mark.parametrize("scale", [1.0, 2.0**8, 2.0**15])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_fractions_match_numpy_reference_at_dtype_edges(dtype, scale):
    x = edge_values(dtype)
    report = jax.jit(lambda g: jmp_lite.gradient_diagnostics(g, dtype, scale))({"g": x})
    want = reference(x, dtype, scale)
    got = (report.underflow, report.subnormal, report.overflow, report.zeros, report.nonfinite)
    np.testing.assert_allclose([float(v) for v in got], want, rtol=0, atol=1e-7)
    assert float(report.count) == x.size
    # per-leaf fractions of a single leaf are the overall ones
    leaf = report.per_leaf["g"]
    np.testing.assert_allclose([float(leaf.underflow), float(leaf.subnormal), float(leaf.overflow)], want[:3])


@pytest.mark.numerics
def test_each_edge_is_classified_as_numpy_says_for_float16():
    fi = np.finfo(np.float16)
    r = lambda v: jmp_lite.gradient_diagnostics([jnp.array([v], jnp.float32)], jnp.float16)  # noqa: E731
    assert float(r(float(fi.tiny)).subnormal) == 0 and float(r(float(fi.tiny)).underflow) == 0
    assert float(r(float(fi.tiny) / 2).subnormal) == 1  # largest binade of subnormals
    assert float(r(float(fi.smallest_subnormal)).subnormal) == 1
    assert float(r(float(fi.smallest_subnormal) / 2).underflow) == 1  # ties round to even: zero
    assert float(r(float(fi.smallest_subnormal) * 0.6).subnormal) == 1  # rounds up, survives
    assert float(r(float(fi.max)).overflow) == 0
    assert float(r(float(fi.max) * 1.01).overflow) == 1  # past the rounding midpoint to inf
    assert float(r(np.inf).nonfinite) == 1 and float(r(np.inf).overflow) == 0
    assert float(r(np.nan).nonfinite) == 1


@pytest.mark.numerics
def test_histogram_matches_numpy_and_counts_every_nonzero_finite_value():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(10_000) * np.exp2(rng.integers(-40, 10, 10_000))).astype(np.float32)
    x[:100] = 0.0
    x[100:105] = np.inf
    r = jmp_lite.gradient_diagnostics(
        {"a": x[:5000], "b": x[5000:].reshape(50, 100)}, jnp.float16, log2_range=(-30, 5)
    )
    finite = x[np.isfinite(x) & (x != 0)]
    k = np.clip(np.frexp(finite)[1] - 1, -30, 4)  # exact floor(log2|x|)
    want = np.bincount(k + 30, minlength=35)
    np.testing.assert_array_equal(np.asarray(r.histogram), want)
    np.testing.assert_array_equal(np.asarray(r.log2_bins), np.arange(-30, 5))
    assert int(r.histogram.sum()) == finite.size
    # values just below a power of two belong to the binade below it
    below = jmp_lite.gradient_diagnostics([jnp.array([np.nextafter(np.float32(2**-20), 0)])], jnp.float16)
    assert int(below.histogram[np.flatnonzero(np.asarray(below.log2_bins) == -21)[0]]) == 1
    assert float(r.max_abs) == float(np.abs(finite).max())


def test_recommended_scale_and_headroom():
    g = [jnp.array([2.0**-10, -(2.0**-3), 0.0])]  # largest magnitude 2^-3
    r = jmp_lite.gradient_diagnostics(g, jnp.float16, 2.0**4)
    # float16 max is just under 2^16: 2^-3 can be scaled by 2^18 before overflow; margin 3 bits -> 2^15
    assert float(r.recommended_scale) == 2.0**15
    np.testing.assert_allclose(
        float(r.headroom_bits), np.log2(float(np.finfo(np.float16).max)) + 3 - 4, rtol=1e-6
    )
    # the recommendation does not overflow and removes the underflow the unscaled grads have
    tiny_grads = [jnp.array([1e-8, 3e-7, 2.0**-3])]
    assert float(jmp_lite.gradient_diagnostics(tiny_grads, jnp.float16).underflow) > 0
    best = jmp_lite.gradient_diagnostics(tiny_grads, jnp.float16).recommended_scale
    fixed = jmp_lite.gradient_diagnostics(tiny_grads, jnp.float16, best)
    assert float(fixed.underflow) == 0 and float(fixed.overflow) == 0
    # bfloat16 has float32's range: the recommendation is capped at 2^24; all-zero grads too
    assert float(jmp_lite.gradient_diagnostics(g, jnp.bfloat16).recommended_scale) == 2.0**24
    zeros = jmp_lite.gradient_diagnostics([jnp.zeros(3)], jnp.float16)
    assert float(zeros.recommended_scale) == 2.0**24 and float(zeros.headroom_bits) == np.inf
    # already overflowing: no positive scale helps, headroom is negative
    big = jmp_lite.gradient_diagnostics([jnp.array([1e6])], jnp.float16)
    assert float(big.recommended_scale) == 1.0 and float(big.headroom_bits) < 0 and float(big.overflow) == 1


def test_accepts_loss_scale_objects_bf16_leaves_and_rejects_bad_input():
    g = {"w": jnp.array([1e-9, 1.0], jnp.bfloat16)}
    by_object = jmp_lite.gradient_diagnostics(g, jnp.float16, jmp_lite.StaticLossScale(2.0**10))
    by_number = jmp_lite.gradient_diagnostics(g, jnp.float16, 2.0**10)
    assert float(by_object.underflow) == float(by_number.underflow) == 0.0
    assert float(jmp_lite.gradient_diagnostics(g, jnp.float16, jmp_lite.NoOpLossScale()).underflow) == 0.5
    with pytest.raises(TypeError, match="floating dtype"):
        jmp_lite.gradient_diagnostics(g, jnp.int8)
    with pytest.raises(TypeError, match="floating arrays"):
        jmp_lite.gradient_diagnostics({"i": jnp.arange(3)}, jnp.float16)
    with pytest.raises(ValueError, match="no leaves"):
        jmp_lite.gradient_diagnostics({}, jnp.float16)
    with pytest.raises(ValueError, match="margin_bits"):
        jmp_lite.gradient_diagnostics(g, jnp.float16, margin_bits=-1)
    with pytest.raises(ValueError, match="log2_range"):
        jmp_lite.gradient_diagnostics(g, jnp.float16, log2_range=(5, 5))


@pytest.mark.parametrize("bad", [-2.0, 0.0, float("nan"), -2])
def test_a_scale_that_is_not_positive_and_finite_is_refused_or_nan_under_jit(bad):
    g = {"w": jnp.array([1e-6, 1.0])}
    with pytest.raises(
        ValueError, match="gradient_diagnostics.loss_scale.*(positive and finite|finite float32)"
    ):
        jmp_lite.gradient_diagnostics(g, jnp.float16, bad)
    # traced, it cannot be checked in Python: the scale becomes NaN, so every value "overflows"
    traced = jax.jit(lambda s: jmp_lite.gradient_diagnostics(g, jnp.float16, s))(jnp.float32(bad))
    assert np.isnan(float(traced.headroom_bits)) and float(traced.overflow) == 1.0
    ok = jax.jit(lambda s: jmp_lite.gradient_diagnostics(g, jnp.float16, s))(jnp.float32(2.0**10))
    assert float(ok.underflow) == 0.0 and np.isfinite(float(ok.headroom_bits))


@pytest.mark.numerics
def test_runs_under_jit_vmap_and_on_real_gradients():
    # A real jax.grad whose values span 2^-40 .. 2^-5: at scale 1 the ones below float16's
    # smallest subnormal (2^-24; 2^-25 rounds to even, to zero) underflow, and each larger
    # scale rescues more of them.
    coeffs = jnp.ldexp(jnp.float32(1.0), -jnp.arange(5, 41))  # exact powers of two
    grads = jax.grad(lambda p: jnp.sum(p["w"] * coeffs) + 0.0 * jnp.sum(p["b"]))(
        {"w": jnp.zeros(36), "b": jnp.ones(4)}
    )
    jitted = jax.jit(jmp_lite.gradient_diagnostics, static_argnums=1)(grads, jnp.float16)
    eager = jmp_lite.gradient_diagnostics(grads, jnp.float16)
    assert float(jitted.underflow) == float(eager.underflow)
    scales = jnp.array([1.0, 2.0**10, 2.0**20])
    swept = jax.vmap(lambda s: jmp_lite.gradient_diagnostics(grads, jnp.float16, s).underflow)(scales)
    # NumPy: nonzero in float32, zero once scaled and cast to float16, out of all 40 values.
    w = np.asarray(grads["w"])
    want = [np.sum((w * s).astype(np.float16) == 0) / 40 for s in (1.0, 2.0**10, 2.0**20)]
    assert want == [16 / 40, 6 / 40, 0.0]  # 2^-25 and below flush; 2^-25 itself ties to even, to zero
    np.testing.assert_allclose(np.asarray(swept), want, rtol=1e-6)
