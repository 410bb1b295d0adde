"""jmp_lite.export_params: 16-bit inference weights are half the bytes; training checkpoints are not."""

import importlib.util
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx, serialization

import jmp_lite

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
HALF = {"bf16": jnp.bfloat16, "f16": jnp.float16}


def load_benchmark():
    spec = importlib.util.spec_from_file_location(
        "checkpoint_sizes", ROOT / "benchmarks" / "checkpoint_sizes.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.e2e
def test_measured_sizes_training_checkpoints_equal_exports_half():
    sizes = load_benchmark().measure()
    train = [row["training_checkpoint"] for row in sizes.values()]
    # float32 master params + float32 Adam moments in every run: the same size (the dynamic
    # loss scale adds a few bytes of hyperparameters)
    assert max(train) - min(train) < 200, sizes
    for row in sizes.values():
        assert row["training_checkpoint"] > 2.9 * row["params_float32"]  # params + two Adam moments
        for exported in ("exported_bfloat16", "exported_float16"):
            assert 0.49 < row[exported] / row["params_float32"] < 0.51, row


@pytest.mark.parametrize("half", HALF)
def test_linen_params_serialize_to_half_and_restore_close(half):
    model = nn.Sequential([nn.Dense(64), nn.relu, nn.Dense(10)])
    x = jax.random.normal(jax.random.key(0), (4, 32))
    params = model.init(jax.random.key(1), x)["params"]
    exported = jax.jit(lambda p: jmp_lite.export_params(p, half))(params)
    assert {leaf.dtype for leaf in jax.tree_util.tree_leaves(exported)} == {np.dtype(HALF[half])}
    full, small = serialization.to_bytes(params), serialization.to_bytes(exported)
    assert 0.49 < len(small) / len(full) < 0.52, (len(small), len(full))
    restored = serialization.from_bytes(exported, small)
    for a, b in zip(jax.tree_util.tree_leaves(restored), jax.tree_util.tree_leaves(exported), strict=True):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    want = model.apply({"params": params}, x)
    got = model.apply({"params": jmp_lite.cast_to_full(restored)}, x)
    np.testing.assert_allclose(got, want, rtol=0.05, atol=0.05)


@pytest.mark.parametrize("half", HALF)
def test_nnx_state_stays_a_state_and_halves(half):
    model = nnx.Sequential(nnx.Linear(32, 64, rngs=nnx.Rngs(0)), nnx.Linear(64, 10, rngs=nnx.Rngs(1)))
    state = nnx.state(model, nnx.Param)
    exported = jmp_lite.export_params(state, half)
    assert isinstance(exported, nnx.State)
    assert all(
        isinstance(v, nnx.Param)
        for v in jax.tree_util.tree_leaves(exported, is_leaf=lambda v: isinstance(v, nnx.Variable))
    )
    assert {leaf.dtype for leaf in jax.tree_util.tree_leaves(exported)} == {np.dtype(HALF[half])}
    full = serialization.to_bytes(nnx.to_pure_dict(state))
    small = serialization.to_bytes(nnx.to_pure_dict(exported))
    assert 0.49 < len(small) / len(full) < 0.52
    # the export loads into a 16-bit inference copy of the model
    inference = nnx.Sequential(
        nnx.Linear(32, 64, param_dtype=HALF[half], dtype=HALF[half], rngs=nnx.Rngs(2)),
        nnx.Linear(64, 10, param_dtype=HALF[half], dtype=HALF[half], rngs=nnx.Rngs(3)),
    )
    nnx.update(inference, exported)
    x = jax.random.normal(jax.random.key(0), (4, 32))
    np.testing.assert_allclose(
        inference(x.astype(HALF[half])).astype(jnp.float32), model(x), rtol=0.05, atol=0.05
    )


def test_only_floating_arrays_are_cast():
    key = jax.random.key(0)
    tree = {
        "w": jnp.ones(3),
        "w64": np.ones(3, np.float64),
        "already": jnp.ones(3, jnp.bfloat16),
        "step": jnp.array(3),
        "mask": np.array([True, False]),
        "key": key,
        "z": jnp.ones(2, jnp.complex64),
        "lr": 0.1,
        "none": None,
    }
    out = jmp_lite.export_params(tree)  # bfloat16 by default
    assert out["w"].dtype == jnp.bfloat16 and out["w64"].dtype == jnp.bfloat16
    assert isinstance(out["w64"], np.ndarray)  # numpy stays numpy
    for name in ("already", "step", "mask", "key", "z", "lr"):
        assert out[name] is tree[name], name
    assert out["none"] is None
    assert tree["w"].dtype == jnp.float32  # a copy: the input is untouched


def test_abstract_targets_get_the_export_dtype():
    tree = {"w": jax.ShapeDtypeStruct((2, 3), jnp.float32), "n": jax.ShapeDtypeStruct((), jnp.int32)}
    out = jmp_lite.export_params(tree, "f16")
    assert out["w"] == jax.ShapeDtypeStruct((2, 3), jnp.float16)
    assert out["n"] is tree["n"]


@pytest.mark.parametrize("spelling", ["bfloat16", "BF16", jnp.bfloat16, np.dtype("bfloat16")])
def test_dtype_spellings(spelling):
    assert jmp_lite.export_params(jnp.ones(2), spelling).dtype == jnp.bfloat16


def test_float16_overflow_is_refused_naming_the_leaf_but_bfloat16_keeps_it():
    params = {"dense": {"kernel": jnp.array([1.0, 1e5])}}
    with pytest.raises(
        ValueError, match=r"\['dense'\]\['kernel'\] has a weight of magnitude 100000.*export bfloat16"
    ):
        jmp_lite.export_params(params, "f16")
    assert float(jmp_lite.export_params(params, "bf16")["dense"]["kernel"][1]) == pytest.approx(1e5, rel=1e-2)
    # an inf already in the weights is not the export's doing: it is kept
    assert np.isinf(jmp_lite.export_params({"w": jnp.array([jnp.inf])}, "f16")["w"]).all()


@pytest.mark.parametrize(
    ("dtype", "error", "match"),
    [
        ("int8", ValueError, r"must be a floating dtype, got 'int8'; accepted: bfloat16 \('bf16'\)"),
        (jnp.int32, TypeError, r"must be a floating dtype"),
        ("bf17", ValueError, r"got 'bf17'; accepted: bfloat16"),
        (3, TypeError, r"got 3; accepted"),
        (None, TypeError, r"got None; accepted"),
        ("float8_e4m3fn", ValueError, r"fp8 format, which needs a per-tensor scale"),
    ],
)
def test_bad_dtype_is_refused_with_what_is_accepted(dtype, error, match):
    with pytest.raises((TypeError, ValueError), match=match) as info:
        jmp_lite.export_params({"w": jnp.ones(2)}, dtype)
    if error is ValueError:
        assert info.type is ValueError
