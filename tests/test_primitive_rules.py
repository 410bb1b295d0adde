"""The one primitive table (jmp_lite/_src/primitive_rules.py): its entries are primitives of the
supported jax, every class has a mode, and the engine's decisions follow the table."""

import importlib
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _jaxpr import eqns

import jmp_lite
from jmp_lite._src import primitive_rules as rules

pytestmark = pytest.mark.unit

# Modules that define primitives jax does not import by itself.
_DEFINING = (
    "jax._src.lax.parallel",
    "jax._src.lax.linalg",
    "jax._src.lax.fft",
    "jax._src.lax.special",
    "jax._src.lax.control_flow",
    "jax._src.ad_checkpoint",
    "jax._src.custom_derivatives",
    "jax._src.state.primitives",
    "jax._src.cudnn.fused_attention_stablehlo",
    "jax._src.cudnn.scaled_matmul_stablehlo",
    "jax._src.callback",
    "jax._src.debugging",
    "jax.experimental.sparse",
    "jax._src.ffi",
    "jax.experimental.multihost_utils",
    "jax._src.pallas.pallas_call",
    "jax._src.tpu_custom_call",
)


def _all_primitive_names():
    for name in _DEFINING:
        try:
            importlib.import_module(name)
        except ImportError:  # a module this jax does not have: its primitives cannot appear either
            continue
    return rules.primitive_names(refresh=True)


def test_every_table_entry_is_a_primitive_of_the_supported_jax():
    known = _all_primitive_names()
    missing = sorted(n for n in rules.TABLE if n not in known)
    assert not missing, (
        f"names in primitive_rules that are not primitives of jax {jax.__version__}: {missing}"
    )


def test_every_primitive_of_the_supported_jax_is_in_the_table():
    """A primitive a new jax adds is classified before it reaches a user (jnp.tile and jnp.stack were
    not)."""
    _all_primitive_names()  # imports the modules that define them
    # jax's own: other libraries' (Equinox's, the suite's own test primitives) run as written and warn;
    # Pallas's live only inside a pallas_call body, which runs as written
    ours = {
        v.name
        for name, module in list(sys.modules.items())
        if name.split(".")[0] == "jax" and ".pallas" not in name
        for v in list(vars(module).values())
        if isinstance(v, jax.extend.core.Primitive)
    }
    unknown = sorted(ours - set(rules.TABLE))
    assert not unknown, f"primitives of jax {jax.__version__} primitive_rules does not classify: {unknown}"


def test_every_class_has_a_mode_and_every_property_a_sensible_class():
    assert set(rules.CLASSES) == {e.kind for e in rules.TABLE.values()}
    for name, entry in rules.TABLE.items():
        assert rules.default_mode(name) in rules.MODES
        if entry.layout:
            assert entry.kind == "movement", name
        if entry.upcastable:  # exact ops only: computing them in float32 changes no value
            assert entry.kind in ("arithmetic", "movement"), name
    assert rules.default_mode("a_primitive_nobody_defined") == "as_written"
    assert rules.kind("a_primitive_nobody_defined") is None
    # the engine's own marks and the bodies it recurses into are in the table
    for name in ("jmp_lite_mark", "jit", "scan", "while", "cond", "remat2", "custom_vjp_call", "shard_map"):
        assert rules.kind(name) in ("annotation", "control"), name


def test_ops_of_ordinary_programs_are_all_in_the_table():
    def program(x, w, i, key):
        h = jax.nn.gelu(x @ w)
        h = (h - h.mean(-1, keepdims=True)) * jax.lax.rsqrt(h.var(-1, keepdims=True) + 1e-5)
        logits = jax.nn.log_softmax(h @ w.T)
        picked = jnp.take_along_axis(logits, i[:, None], axis=-1)
        noise = jax.random.uniform(key, h.shape)
        pooled = jax.ops.segment_sum(h, i, num_segments=3)
        top, _ = jax.lax.top_k(h, 2)
        scanned = jax.lax.scan(lambda c, r: (c + r, c * r), jnp.zeros(x.shape[1]), h)[1]
        return picked.sum() + noise.sum() + pooled.sum() + top.sum() + jnp.sort(h).sum() + scanned.sum()

    args = (jnp.ones((4, 8)), jnp.ones((8, 8)), jnp.array([0, 1, 2, 1]), jax.random.key(0))
    jaxpr = jax.make_jaxpr(jax.grad(program, argnums=(0, 1)))(*args).jaxpr
    unknown = sorted({e.primitive.name for e in eqns(jaxpr)} - set(rules.TABLE))
    assert not unknown


@pytest.mark.parametrize("kind", ["float32", "arithmetic", "movement", "communication"])
def test_the_engine_decides_as_the_table_says(kind):
    # one primitive of each class, under a bf16 policy: float32 math reads float32, the rest bf16
    examples = {
        "float32": ("exp", lambda y: jnp.exp(y)),
        "arithmetic": ("tanh", lambda y: jnp.tanh(y)),
        "movement": ("transpose", lambda y: y.T),
        "communication": ("device_put", lambda y: jax.device_put(y)),
    }
    name, op = examples[kind]
    assert rules.kind(name) == kind

    def f(x, w):
        return op(x @ w) @ w  # the result feeds a contraction, so nothing upcasts it

    jaxpr = jax.make_jaxpr(jmp_lite.autocast(f, "p=f32,c=bf16,o=f32"))(jnp.ones((4, 4)), jnp.ones((4, 4)))
    (dtypes,) = [
        tuple(np.dtype(v.aval.dtype) for v in e.invars) for e in eqns(jaxpr.jaxpr) if e.primitive.name == name
    ]
    want = np.dtype(np.float32) if rules.default_mode(name) == "float32" else np.dtype(jnp.bfloat16)
    assert dtypes == (want,)


def test_a_sparse_product_runs_as_written_under_a_16_bit_policy():
    from jax.experimental import sparse

    matrix = sparse.BCOO.fromdense(jnp.eye(4) * 3.0)
    f = jmp_lite.autocast(lambda m, x: (m @ x).sum(), "p=f32,c=bf16,o=f32")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # classified: no unknown-primitive warning
        value, grad = jax.jit(jax.value_and_grad(f, argnums=1))(matrix, jnp.ones((4, 3)))
    assert float(value) == 36.0 and grad.dtype == jnp.float32 and bool((grad == 3.0).all())
