"""jmp_lite.memory.residual_bytes: the bytes kept for the backward pass, checked on known residuals,
against JAX's own print_saved_residuals, through jit/scan/Linen, and on the benchmark LM (issue 19)."""

import contextlib
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.ad_checkpoint import print_saved_residuals

import jmp_lite
from jmp_lite.flax.linen import apply_policy
from jmp_lite.memory import Residual, ResidualBytes, residual_bytes, state_bytes

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]


def sin_times_w(x, w):
    return jnp.sin(x) * w


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_known_residuals_exact_bytes(dtype):
    # d/dx = cos(x) * w and d/dw = sin(x): JAX keeps cos(x) and sin(x) (computed) and w (an argument).
    x, w = jnp.ones((3, 5), dtype), jnp.ones((3, 5), dtype)
    n = 15 * np.dtype(dtype).itemsize
    m = residual_bytes(sin_times_w, x, w)
    name = np.dtype(dtype).name
    assert (m.total, m.inputs, m.by_dtype, m.by_scope) == (2 * n, n, {name: 2 * n}, {"": 2 * n})
    computed = sorted((r.primitive, r.shape, r.dtype, r.bytes) for r in m.find())
    assert computed == [("cos", (3, 5), name, n), ("sin", (3, 5), name, n)]
    (arg,) = m.find(kinds=("argument",))
    assert arg.description == "from the argument w" and arg.bytes == n and arg.scope == ""
    # Only what the requested gradients need: w's gradient needs sin(x), x's needs cos(x) and w.
    only_w = residual_bytes(sin_times_w, x, w, argnums=1)
    assert (only_w.total, only_w.inputs, [r.primitive for r in only_w.find()]) == (n, 0, ["sin"])
    only_x = residual_bytes(sin_times_w, x, w, argnums=(0,))
    assert (only_x.total, only_x.inputs, [r.primitive for r in only_x.find()]) == (n, n, ["cos"])


def test_abstract_inputs_are_never_allocated():
    # 2^35 float32 values: 128 GiB, far beyond this machine; tracing only, so it is measured anyway.
    big = jax.ShapeDtypeStruct((1 << 20, 1 << 15), jnp.float32)
    m = residual_bytes(lambda x: jnp.sin(x).sum(), big)
    assert m.total == 4 << 35 and m.by_dtype == {"float32": 4 << 35}


def scoped(x, w):
    with jax.named_scope("outer"):
        y = jnp.sin(x) * w
        with jax.named_scope("inner"):
            z = jnp.tanh(y)
    return z.sum()


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_named_scopes_through_jit_and_nested_jit(dtype):
    x = jax.ShapeDtypeStruct((4, 8), dtype)
    n = 32 * np.dtype(dtype).itemsize
    expected = {"outer": 2 * n, "outer/inner": 2 * n}  # sin, cos; tanh and 1 - tanh^2
    plain = residual_bytes(scoped, x, x)
    assert plain.by_scope == expected

    @jax.jit
    def nested(x, w):
        with jax.named_scope("model"):
            return jax.jit(scoped)(x, w)

    for fun, prefix in ((jax.jit(scoped), ""), (nested, "model/")):
        m = residual_bytes(fun, x, x)
        assert m.by_scope == {prefix + k: v for k, v in expected.items()}, m.by_scope
        # the equation inside the jit made it, not the jit
        assert sorted(r.primitive for r in m.find()) == sorted(r.primitive for r in plain.find())
        assert len(m.find(scope=prefix + "outer")) == 4 and len(m.find(scope=prefix + "outer/inner")) == 2
    assert m.by_scope_prefix(1) == {"model": 4 * n}


def test_vmap_scales_and_checkpoint_recomputes():
    x = jax.ShapeDtypeStruct((4, 8), jnp.float16)
    batched = jax.ShapeDtypeStruct((3, 4, 8), jnp.float16)
    one = residual_bytes(scoped, x, x)
    many = residual_bytes(jax.vmap(scoped), batched, batched)
    assert many.by_scope == {k: 3 * v for k, v in one.by_scope.items()}  # "vmap(outer)" is scope outer
    # under jax.checkpoint nothing computed is kept: the backward pass recomputes it from x and w
    remat = residual_bytes(jax.checkpoint(scoped), x, x)
    assert (remat.total, remat.inputs, len(remat.residuals)) == (0, 2 * 32 * 2, 2)
    assert "(no scope)" not in str(remat) and "0 B in 0 residuals" in str(remat)


def test_scan_residuals_are_stacked_per_step():
    def loop(x, ws):
        def body(c, w):
            with jax.named_scope("cell"):
                return jnp.sin(c * w), None

        return jax.lax.scan(body, x, ws)[0].sum()

    m = residual_bytes(
        loop, jax.ShapeDtypeStruct((8,), jnp.bfloat16), jax.ShapeDtypeStruct((5, 8), jnp.bfloat16)
    )
    # per step: c and w for the product's gradient, cos(c * w) for sin's: a [5, 8] stack of each
    assert m.total + m.inputs == 3 * 5 * 8 * 2, [(r.shape, r.description) for r in m.residuals]
    assert all(r.shape == (5, 8) for r in m.residuals)


def printed_by_jax(fun, *args):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_saved_residuals(fun, *args)
    return sorted(out.getvalue().splitlines())


def short(r: Residual) -> str:
    dtype = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "bool": "bool", "int32": "i32"}[r.dtype]
    return f"{dtype}[{','.join(map(str, r.shape))}] {r.description}"


def test_agrees_with_jax_print_saved_residuals():
    """The one JAX internal in jmp_lite.memory: if JAX changes it, this fails, loudly."""
    from jax._src.ad_checkpoint import _saved_residuals  # noqa: F401  (the function memory.py wraps)

    x = jnp.ones((4, 8), jnp.bfloat16)

    def model(x, w):
        h = scoped(x, w) * jnp.where(x > 0, x, 0.0).sum()  # a boolean mask among the residuals
        return h + jax.nn.softmax(x.astype(jnp.float32) @ w.T.astype(jnp.float32)).sum()

    mine = residual_bytes(model, x, x)
    assert sorted(short(r) for r in mine.residuals) == printed_by_jax(model, x, x)
    assert "bool" in mine.by_dtype and {"float32", "bfloat16"} <= set(mine.by_dtype)
    # under jit, JAX names the jit call site (its own wrapper, or ours): compare up to " from "
    mine = residual_bytes(jax.jit(model), x, x)
    cut = lambda s: s.split(" from ")[0]  # noqa: E731
    assert sorted(cut(short(r)) for r in mine.residuals) == sorted(
        map(cut, printed_by_jax(jax.jit(model), x, x))
    )


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(32)(x))
        x = nn.LayerNorm()(x)
        return nn.Dense(4)(x)


@pytest.mark.parametrize("compute", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
def test_linen_model_by_module_and_dtype(compute):
    x = jax.ShapeDtypeStruct((16, 8), jnp.float32)
    f32 = apply_policy(MLP(), "f32")
    mixed = apply_policy(MLP(), jmp_lite.Policy(jnp.float32, compute, jnp.float32))
    params = jax.eval_shape(f32.init, jax.random.key(0), x)
    full, half = residual_bytes(f32.apply, params, x), residual_bytes(mixed.apply, params, x)
    # Flax opens one named scope per module call: the residuals land in the module that made them.
    # In float32 a Dense keeps only its input, made outside it (relu in MLP, the LayerNorm's output).
    assert set(full.by_scope) == {"MLP", "MLP/LayerNorm_0"}, full.by_scope
    assert full.by_dtype.keys() <= {"float32", "bool"}
    # In 16 bits what is kept is 16-bit (the float32 norm math is rebuilt from it), attributed to modules.
    name = np.dtype(compute).name
    assert half.find(dtype=compute, scope="MLP/Dense_0"), [(r.scope, r.dtype) for r in half.residuals]
    assert half.by_dtype[name] > 0 and half.total < full.total / 2
    computed = [r for r in half.residuals if r.kind == "computed"]
    assert all(r.dtype == name or r.bytes <= 8 * 16 * 4 / 8 for r in computed), computed  # f32: row stats
    # the parameters are arguments: kept, but not counted
    assert (
        full.inputs >= sum(np.dtype(p.dtype).itemsize * p.size for p in jax.tree_util.tree_leaves(params)) / 2
    )
    # concrete arrays and abstract shapes give the same count, under jit too
    concrete = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), (params, x))
    assert residual_bytes(jax.jit(mixed.apply), *concrete).total == half.total


def test_table_find_and_prefix():
    m = residual_bytes(scoped, jnp.ones((4, 8)), jnp.ones((4, 8)))
    text = str(m)
    assert text.splitlines()[0].startswith("kept for the backward pass: 512 B in 4 residuals")
    assert re.search(r"outer/inner\s+256 B\s+50.0%", text) and "float32" in text
    assert isinstance(m, ResidualBytes) and "residuals" not in repr(m)  # the list stays out of the repr
    assert len(m.find(trailing_shape=(4, 8))) == 4 and not m.find(trailing_shape=(8, 8))
    assert len(m.find(dtype="float32")) == 4 and not m.find(dtype=jnp.bfloat16)
    assert len(m.find(kinds=("computed", "argument"))) == 5
    assert not m.find(scope="out")  # a prefix of whole names, not of characters
    assert m.by_scope_prefix(1) == {"outer": 512}
    assert "(1 more scopes: 256 B)" in m.table(max_scopes=1)


def test_bad_input_is_named():
    x = jnp.ones(3)
    with pytest.raises(TypeError, match="expects a callable"):
        residual_bytes("sin", x)
    with pytest.raises(TypeError, match=r"argument mode is a str.*functools.partial"):
        residual_bytes(lambda x, mode: x, x, "train")
    with pytest.raises(ValueError, match=r"argnums \[2\] out of range for 2"):
        residual_bytes(sin_times_w, x, x, argnums=2)
    with pytest.raises(TypeError, match="argnums must be an int"):
        residual_bytes(sin_times_w, x, x, argnums="0")
    with pytest.raises(ValueError, match="depth must be an integer >= 1"):
        residual_bytes(sin_times_w, x, x).by_scope_prefix(0)


# --- state_bytes: parameters and optimizer state, per parameter and by component


def test_state_bytes_float32_adam_is_twelve_bytes_per_parameter():
    params = {"w": jnp.ones((300, 10)), "b": jnp.ones(10), "step": jnp.zeros((), jnp.int32)}
    report = state_bytes(params, optax.adam(1e-3).init(params))
    n = 3010  # the floating elements; the int32 leaf is counted in bytes, not as a parameter
    assert report.parameters == n
    # Adam's mu and nu hold an int32 zero for "step" too: integers are "other", with Adam's count.
    assert dict(report.by_component) == {"parameters": 4 * n + 4, "moments": 8 * n, "other": 12}
    assert report.total == 12 * n + 16 and report.bytes_per_parameter == (12 * n + 16) / n
    with pytest.raises(TypeError):
        report.by_component["other"] = 0  # read-only, like the frozen report itself
    with pytest.raises(AttributeError):
        report.total = 0


def test_state_bytes_bfloat16_kahan_and_bfloat16_moments_are_eight_bytes_per_parameter():
    params = {"w": jnp.ones((64, 64), jnp.bfloat16), "b": jnp.zeros(64, jnp.bfloat16)}
    n = 64 * 64 + 64
    tx = optax.chain(jmp_lite.low_precision_state(optax.adam(1e-3)), jmp_lite.kahan_summation())
    report = state_bytes(params, tx.init(params))
    # 2 (parameter) + 2 + 2 (bfloat16 mu, nu) + 2 (compensation) bytes a parameter; one 8-byte key (the
    # state's stochastic rounding), Adam's 4-byte count.
    assert dict(report.by_component) == {
        "parameters": 2 * n,
        "moments": 4 * n,
        "compensation": 2 * n,
        "keys": 8,
        "other": 4,
    }
    assert report.bytes_per_parameter == 8 + 12 / n
    # The same numbers from abstract arrays: nothing allocated.
    abstract = jax.eval_shape(lambda: (params, tx.init(params)))
    assert state_bytes(*abstract) == report


def test_state_bytes_int8_moments_by_hand_from_the_block_size():
    """bfloat16 parameters, int8 Adam moments (blocks of 256 along the last axis), kahan_summation."""
    params = {"w": jnp.ones((64, 600), jnp.bfloat16), "b": jnp.zeros(600, jnp.bfloat16)}
    tx = optax.chain(jmp_lite.low_precision_state(optax.adam(1e-3), "int8"), jmp_lite.kahan_summation())
    report = state_bytes(params, jax.jit(tx.init)(params))
    w, b = 64 * 600, 600
    blocks = 64 * 3  # ceil(600 / 256) = 3 scales per row of w; b (600 < 4096 elements) stays float32
    expected = {
        "parameters": 2 * (w + b),
        "moments": 2 * w + 2 * 4 * b,  # mu and nu: 1 byte per element of w, 4 per element of b
        "scales": 2 * 4 * blocks,  # one float32 per block, for mu and for nu
        "compensation": 2 * (w + b),
        "keys": 8,  # the moments' rounding key (stochastic rounding, the default)
        "other": 4,
    }
    assert dict(report.by_component) == expected
    assert report.parameters == w + b and report.total == sum(expected.values())
    # 2 + 1 + 1 + 2 a parameter, plus b's float32 moments (6 more bytes each), the scales, count and key
    assert report.bytes_per_parameter == (6 * (w + b) + 6 * b + 2 * 4 * blocks + 12) / (w + b)  # 6.13
    fp8 = optax.chain(
        jmp_lite.low_precision_state(optax.adam(1e-3), "float8_e4m3fn", rounding="stochastic"),
        jmp_lite.stochastic_rounding(jax.random.key(0)),
    )
    report = state_bytes(params, fp8.init(params))
    assert dict(report.by_component) == {
        "parameters": 2 * (w + b),
        "moments": 2 * w + 2 * 4 * b,
        "scales": 2 * 4 * blocks,
        "keys": 16,  # two raw uint32[2] keys
        "other": 4,
    }


def test_state_bytes_names_components_from_field_names_not_positions():
    params = {"w": jnp.ones((16, 512))}
    inner = jmp_lite.low_precision_state(optax.adam(1e-3), "int8", rounding="stochastic")
    tx = jmp_lite.loss_scaling(optax.MultiSteps(inner, 2), jmp_lite.DynamicLossScale(2.0**15))
    report = state_bytes(params, tx.init(params))
    n = 16 * 512
    assert dict(report.by_component) == {
        "parameters": 4 * n,
        "moments": 2 * n,
        "scales": 2 * 4 * 16 * 2,
        "keys": 8,
        "accumulated gradients": 4 * n,  # MultiSteps' acc_grads
        "other": report.by_component["other"],  # counts, loss scale, skip counters and flags
    }
    assert 20 < report.by_component["other"] < 100
    # A typed PRNG key anywhere in a state counts its raw data (8 bytes for threefry), not its nbytes.
    typed = {"rng": jax.random.key(0), "rngs": jax.random.split(jax.random.key(1), 3)}
    assert dict(state_bytes(params, typed).by_component) == {"parameters": 4 * n, "keys": 8 + 24}
    text = str(report)
    assert text.splitlines()[0].startswith(f"{report.bytes_per_parameter:.2f} bytes per parameter")
    assert re.search(r"scales\s+256 B\s+0.0312\s+", text) and "accumulated gradients" in text


def test_state_bytes_counts_a_complex_parameter_as_one_parameter_and_its_moments_as_moments():
    params = {"w": jnp.zeros(1024), "z": jnp.zeros(1024, jnp.complex64)}
    report = state_bytes(params, jax.eval_shape(optax.adam(1e-3).init, params))
    assert report.parameters == 2048
    assert dict(report.by_component) == {"parameters": 12 * 1024, "moments": 24 * 1024, "other": 4}
    assert report.bytes_per_parameter == pytest.approx((36 * 1024 + 4) / 2048)
    only_complex = {"z": jnp.zeros(8, jnp.complex64)}
    assert state_bytes(only_complex, ()).parameters == 8


def test_state_bytes_bad_input_is_named():
    with pytest.raises(ValueError, match="params holds no floating or complex array"):
        state_bytes({"step": jnp.zeros((), jnp.int32)}, ())
    with pytest.raises(TypeError, match=r"opt_state\['lr'\] is a str"):
        state_bytes({"w": jnp.ones(2)}, {"lr": "1e-3"})


# --- the LM of benchmarks/lm.py at --size tiny: today's ratios, and issue 19's acceptance thresholds


@pytest.fixture(scope="module")
def lm():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import lm as module
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return module


def t_by_t(m: ResidualBytes, t: int) -> list[Residual]:
    """Attention-sized residuals, [batch, heads or 1, T, T]; not [batch, T, width], even where T == width."""
    return [r for r in m.find(trailing_shape=(t, t)) if len(r.shape) >= 4]


def wide_float32(m: ResidualBytes, full: set[int]) -> list[Residual]:
    """Float32 residuals with more than one full axis (T, width, ...): more than per-row statistics."""
    return [r for r in m.find(dtype=jnp.float32) if sum(d in full for d in r.shape) > 1]


def model_residuals(lm, policy):
    """Residuals of the tiny LM's forward pass (the model alone, without the loss) under ``policy``."""
    layers, width, heads, context, batch = lm.SIZES["tiny"]
    model = apply_policy(lm.GPT(layers, width, heads, context), policy)
    tokens = jax.ShapeDtypeStruct((batch, context), jnp.int32)
    params = jax.eval_shape(model.init, jax.random.key(0), tokens)
    return residual_bytes(model.apply, params, tokens, argnums=0)


@pytest.mark.e2e
def test_lm_tiny_memory_table_ratios(lm, capsys):
    result = lm.memory(["f32", "bf16", "f16-dyn-cond"], "tiny")
    rows = result["memory"]
    with capsys.disabled():
        print(
            "\nlm.py --size tiny --memory ratios to f32:", {n: round(r["ratio"], 3) for n, r in rows.items()}
        )
    assert rows["f32"]["ratio"] == 1.0 and set(rows["f32"]["residual_by_dtype"]) <= {
        "float32",
        "bool",
        "int32",
    }
    for name, half in (("bf16", "bfloat16"), ("f16-dyn-cond", "float16")):
        assert 0.05 < rows[name]["ratio"] < 0.2, rows[name]  # 0.108 measured (contraction outputs kept)
        assert rows[name]["residual_by_dtype"][half] > rows[name]["residual_by_dtype"].get("float32", 0)
    assert rows["f32"]["bytes_per_param"] == pytest.approx(12.0, abs=0.01)  # float32 params, mu, nu
    assert rows["f32"]["bytes_per_param_with_grads"] == pytest.approx(16.0, abs=0.01)
    table = lm._precisions.memory_table(result)
    assert "| bf16 | " in table and "ratio to f32" in table


@pytest.mark.e2e
def test_gpt2_small_is_measured_without_allocating(tmp_path):
    """lm.py --size small --memory: 86M parameters, 16 x 1024 tokens, 53 GB of residuals counted in a
    process whose peak memory stays below what the float32 parameters alone (344 MB) would add."""
    argv = [
        "lm.py",
        "--size",
        "small",
        "--memory",
        "--variants",
        "f32,bf16",
        "--json",
        str(tmp_path / "m.json"),
    ]
    script = (
        "import runpy, sys\n"
        f"sys.argv = {argv!r}\n"
        f"runpy.run_path({str(ROOT / 'benchmarks' / 'lm.py')!r}, run_name='__main__')\n"
        # the peak of this process's own memory map: ru_maxrss would include the parent's, inherited at exec
        "print('maxrss_kb', open('/proc/self/status').read().split('VmHWM:')[1].split()[0])\n"
    )
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    rss_mb = int(done.stdout.split("maxrss_kb")[-1]) / 1024
    assert rss_mb < 600, rss_mb  # measured: 268 MB for both variants
    rows = json.loads((tmp_path / "m.json").read_text())["memory"]
    assert rows["f32"]["params"] > 85e6 and rows["f32"]["residual_bytes"] > 50e9
    assert rows["bf16"]["ratio"] < 1.0


def test_acceptance_bf16_keeps_at_most_055_of_float32_at_tiny(lm):
    result = lm.memory(["f32", "bf16"], "tiny")
    assert result["memory"]["bf16"]["ratio"] <= 0.55  # before 16-bit residuals: 0.661


def test_acceptance_attention_keeps_no_t_by_t_array(lm):
    _, _, heads, context, _ = lm.SIZES["tiny"]
    m = model_residuals(lm, "p=f32,c=bf16,o=f32")
    # [batch, heads or 1, T, T]; at tiny the width equals T, so 3-D [batch, T, width] activations are not it
    square = t_by_t(m, context)
    assert not square, sorted({(r.shape, r.dtype, r.primitive) for r in square})


def test_acceptance_float32_residuals_have_at_most_one_full_feature_axis(lm):
    layers, width, heads, context, batch = lm.SIZES["tiny"]
    m = model_residuals(lm, "p=f32,c=bf16,o=f32")
    wide = wide_float32(m, {context, width, 4 * width, 256})  # tokens, width, MLP width, byte vocabulary
    assert not wide, sorted({(r.shape, r.scope, r.primitive) for r in wide})


def test_acceptance_checks_can_pass_on_a_model_built_for_them(lm):
    """The acceptance checks above are not vacuous: programs they accept, and programs they refuse."""
    _, width, _, context, _ = lm.SIZES["tiny"]

    def stats_only(x):  # keeps 16-bit values and float32 per-row statistics
        rstd = jax.lax.stop_gradient(jax.lax.rsqrt(jnp.mean(jnp.square(x), -1, keepdims=True)))
        return (jnp.sin(x.astype(jnp.bfloat16)).astype(jnp.float32) * rstd).sum()

    x = jax.ShapeDtypeStruct((8, context, width), jnp.float32)
    full = {context, width}
    m = residual_bytes(stats_only, x)
    assert [r.shape for r in m.find(dtype=jnp.float32)] == [(8, context, 1)]
    assert not wide_float32(m, full) and not t_by_t(m, context)
    assert wide_float32(residual_bytes(lambda x: jnp.sin(x).sum(), x), full)
    scores = jax.ShapeDtypeStruct((8, 4, context, 64), jnp.bfloat16)
    assert t_by_t(residual_bytes(lambda q: jax.nn.softmax(q @ q.swapaxes(-1, -2)).sum(), scores), context)


@pytest.mark.numerics
@pytest.mark.parametrize("compute", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
def test_gradients_with_16_bit_residuals_match_the_path_that_keeps_float32(lm, compute):
    """Issue 19: the engine's 16-bit residuals (remat_float32) and the attention kernel change what the
    backward pass keeps and how it recomputes, not the gradients: they agree with the path that keeps
    JAX's own residuals within 16-bit tolerance, and are as close to float32's as that path is."""
    layers, width, heads, context, _ = lm.SIZES["tiny"]
    gpt = lm.GPT(layers, width, heads, context)
    tokens = jax.random.randint(jax.random.key(1), (2, context), 0, 256)
    policy = jmp_lite.Policy(jnp.float32, compute, jnp.float32)
    params = apply_policy(gpt, "f32").init(jax.random.key(0), tokens)

    def grads(model):
        loss = lambda p: jnp.mean(jnp.square(model.apply(p, tokens)))  # noqa: E731
        return jax.tree_util.tree_leaves(jax.jit(jax.grad(loss))(params))

    def bytes_kept(model):
        return residual_bytes(model.apply, params, tokens, argnums=0).total

    old = apply_policy(gpt, policy, remat_float32=False, attention=False)
    new = apply_policy(gpt, policy)  # remat_float32=True, attention=True
    reference, before, after = grads(apply_policy(gpt, "f32")), grads(old), grads(new)
    assert bytes_kept(new) < 0.7 * bytes_kept(old)  # the paths differ in what they keep

    norm = lambda x: float(np.linalg.norm(np.asarray(x, np.float64)))  # noqa: E731
    total = norm(np.concatenate([np.ravel(r) for r in reference]))
    eps = float(jnp.finfo(compute).eps)
    ours, theirs = [], []
    for a, b, r in zip(after, before, reference, strict=True):
        assert a.dtype == b.dtype == jnp.float32
        if norm(r) < 1e-6 * total:  # the attention key bias: softmax ignores it, its gradient is rounding
            assert norm(a) < 1e-5 * total and norm(b) < 1e-5 * total
            continue
        # the two 16-bit paths differ by no more than the rounding each has against float32
        assert norm(a - b) <= 2 * norm(b - r) + eps * norm(r), (a.shape, norm(a - b), norm(b - r))
        ours.append(norm(a - r) / norm(r))
        theirs.append(norm(b - r) / norm(r))
    assert sum(ours) <= 1.25 * sum(theirs), (ours, theirs)  # rounding in other places, not more of it


@pytest.mark.parametrize("options", [{}, {"attention": False}], ids=["kernel", "no_kernel"])
def test_an_integer_attention_mask_is_recomputed_not_kept(options):
    """Hugging Face's Flax GPT-2 combines an int32 attention_mask with a boolean causal mask; the
    bf16 policy kept the (B, 1, T, T) int32 mask per layer for the backward pass (8.4 MB of 89.4 MB
    at T=256). Masks are rebuilt in the backward pass like boolean ones: nothing T x T is kept."""
    t, b, c, h = 64, 2, 16, 2

    class Attn(nn.Module):
        @nn.compact
        def __call__(self, x, attention_mask):
            q, k, v = (nn.Dense(c)(x).reshape(b, t, h, c // h) for _ in range(3))
            causal = jnp.broadcast_to(nn.make_causal_mask(jnp.ones((1, t), bool), dtype=bool), (b, 1, t, t))
            padding = jnp.broadcast_to(attention_mask[:, None, None, :], causal.shape)
            mask = nn.combine_masks(padding, causal)
            bias = jax.lax.select(
                mask > 0, jnp.zeros(mask.shape), jnp.full(mask.shape, jnp.finfo(jnp.float32).min)
            )
            weights = nn.dot_product_attention_weights(q, k, bias=bias)
            return jnp.einsum("...hqk,...khd->...qhd", weights, v).sum()

    x = jax.ShapeDtypeStruct((b, t, c), jnp.float32)
    am = jnp.ones((b, t), jnp.int32)
    params = jax.eval_shape(apply_policy(Attn(), "f32").init, jax.random.key(0), x, am)
    model = apply_policy(Attn(), "p=f32,c=bf16,o=f32", **options)
    kept = residual_bytes(lambda p, x: model.apply(p, x, am), params, x, argnums=0)
    assert [(r.shape, r.dtype) for r in kept.find(trailing_shape=(t, t))] == []


@pytest.mark.parametrize("activation", [jax.nn.relu, jax.nn.gelu, jax.nn.silu], ids=["relu", "gelu", "silu"])
def test_an_activation_is_rebuilt_from_the_matmul_result_it_reads_not_kept_beside_it(activation):
    """``jax.nn.relu`` is a ``custom_jvp``: the 16-bit checkpoint's policy has no abstract rule for the
    call and kept its output beside the matmul result it is rebuilt from (two hidden-size arrays per MLP
    where one is needed). Every activation keeps one, as gelu and silu (jitted) always did."""

    def mlp(w1, w2, x):
        return jnp.sum(activation(x @ w1) @ w2)

    w1, w2, x = jnp.ones((16, 64)), jnp.ones((64, 16)), jnp.ones((32, 16))
    kept = residual_bytes(jmp_lite.autocast(mlp, "p=f32,c=bf16,o=f32"), w1, w2, x, argnums=(0, 1))
    hidden = [(r.shape, r.dtype) for r in kept.find() if r.shape == (32, 64)]
    assert hidden == [((32, 64), "bfloat16")], [r.description for r in kept.find()]
    grads = jax.grad(jmp_lite.autocast(mlp, "p=f32,c=bf16,o=f32"), argnums=(0, 1))(w1, w2, x)
    plain = jax.grad(jmp_lite.autocast(mlp, "p=f32,c=bf16,o=f32", remat_float32=False), argnums=(0, 1))(
        w1, w2, x
    )
    for a, b in zip(grads, plain):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
