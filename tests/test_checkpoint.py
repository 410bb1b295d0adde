"""Save the whole train state with orbax, restore, continue: bitwise equal."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from _models import batches, mlp_loss, mlp_params

import jmp_lite
from jmp_lite import DynamicLossScale, loss_scaling

pytestmark = pytest.mark.unit


@pytest.mark.composition
def test_orbax_restore_then_continue_is_bitwise_equal(tmp_path):
    params = mlp_params(jax.random.key(0))
    xs, ys = batches(jax.random.key(1), 10)
    xs = xs.at[3, 0, 0].set(jnp.inf)  # a skip before the save
    tx = loss_scaling(optax.adam(1e-2), DynamicLossScale(2.0**15, period=2, min_loss_scale=2.0))

    @jax.jit
    def step(p, s, b):
        ls = jmp_lite.get_loss_scale(s)
        g = jax.grad(lambda q: ls.scale(mlp_loss(q, b)))(p)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    state = (params, tx.init(params))
    for i in range(5):
        state = step(*state, (xs[i], ys[i]))
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(tmp_path / "ckpt", state)
    ckpt.wait_until_finished()

    uninterrupted = state
    for i in range(5, 10):
        uninterrupted = step(*uninterrupted, (xs[i], ys[i]))

    # A target whose hyperparameters differ from the saved ones tells which side each field comes from:
    # arrays from the file, static hyperparameters from the target (docs/checkpoints.md).
    other_tx = loss_scaling(optax.adam(1e-2), DynamicLossScale(2.0**10, period=5, min_loss_scale=1.0))
    other = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, (params, other_tx.init(params)))
    ls = ckpt.restore(tmp_path / "ckpt", other)[1].loss_scale
    assert (ls.period, ls.min_loss_scale) == (5, 1.0)
    saved = state[1].loss_scale
    assert float(saved.loss_scale) != 2.0**10 and int(saved.counter) != 0  # unlike the target's
    assert float(ls.loss_scale) == float(saved.loss_scale) and int(ls.counter) == int(saved.counter)
    assert ls.loss_scale.dtype == jnp.float32 and ls.counter.dtype == jnp.int32

    fresh = (mlp_params(jax.random.key(9)), tx.init(params))
    abstract = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, fresh)
    restored = ckpt.restore(tmp_path / "ckpt", abstract)
    assert (restored[1].loss_scale.period, restored[1].loss_scale.min_loss_scale) == (2, 2.0)
    assert int(restored[1].skipped_total) == 1
    for i in range(5, 10):
        restored = step(*restored, (xs[i], ys[i]))

    assert jax.tree_util.tree_structure(restored) == jax.tree_util.tree_structure(uninterrupted)
    for a, b in zip(jax.tree_util.tree_leaves(restored), jax.tree_util.tree_leaves(uninterrupted)):
        np.testing.assert_array_equal(np.atleast_1d(a).view(np.uint8), np.atleast_1d(b).view(np.uint8))


# --- restores are validated like constructors --------------------------------

D, S, N = jmp_lite.DynamicLossScale, jmp_lite.StaticLossScale, jmp_lite.NoOpLossScale


def flax_restore(saved, target):
    import flax.serialization

    import jmp_lite.flax  # noqa: F401  (registers the loss scales with flax.serialization)

    return flax.serialization.from_bytes({"opt": target}, flax.serialization.to_bytes({"opt": saved}))["opt"]


@pytest.mark.parametrize(
    "saved, target",
    [
        (S(8.0), D(2.0)),
        (N(), D(2.0)),
        (D(8.0), S(2.0)),
        (D(8.0), N()),
        (N(), S(2.0)),
        (S(8.0), N()),
    ],
    ids=lambda x: type(x).__name__,
)
def test_flax_restore_of_another_loss_scale_type_names_both(saved, target):
    saved_name, target_name = type(saved).__name__, type(target).__name__
    with pytest.raises(
        ValueError, match=rf"holds a {saved_name} at '\./opt'.* target there is a {target_name}"
    ):
        flax_restore(saved, target)


def test_flax_restore_clamps_into_the_targets_bounds_and_refuses_corrupt_values():
    with pytest.warns(UserWarning, match="clamped"):
        back = flax_restore(D(2.0**30, max_loss_scale=2.0**30), D(2.0))  # the target's max is 2**24
    assert float(back.loss_scale) == 2.0**24 and back.max_loss_scale == 2.0**24
    with pytest.warns(UserWarning, match="counter=9"):
        back = flax_restore(D(8.0, counter=9, period=10), D(2.0, period=5))
    assert int(back.counter) == 4 and float(back.loss_scale) == 8.0
    with pytest.warns(UserWarning, match="clamped"):
        assert float(flax_restore(D(2.0, min_loss_scale=1.0), D(8.0, min_loss_scale=4.0)).loss_scale) == 4.0
    import flax.serialization

    for scale, counter, words in [
        (-5.0, 0, "positive and finite"),
        (0.0, 0, "positive and finite"),
        (np.nan, 0, "not a finite float32"),
        (np.inf, 0, "not a finite float32"),
        (8.0, -1, r"counter must be a whole number in \[0, "),
    ]:
        raw = flax.serialization.msgpack_serialize(
            {"opt": {"loss_scale": np.float32(scale), "counter": np.int32(counter)}}
        )
        with pytest.raises(ValueError, match=f"restored DynamicLossScale at '\\./opt'.*{words}"):
            flax.serialization.from_bytes({"opt": D(2.0)}, raw)
    raw = flax.serialization.msgpack_serialize({"opt": {"loss_scale": np.float32(-5.0)}})
    with pytest.raises(ValueError, match="restored StaticLossScale.*positive and finite"):
        flax.serialization.from_bytes({"opt": S(2.0)}, raw)
    # valid values restore as they were saved, in float32 and int32
    back = flax_restore(D(8.0, counter=3, period=10), D(2.0, period=5))
    assert (float(back.loss_scale), int(back.counter), back.period) == (8.0, 3, 5)
    assert back.loss_scale.dtype == jnp.float32 and back.counter.dtype == jnp.int32


def test_orbax_restore_out_of_bounds_is_clamped_by_the_first_update(tmp_path):
    # orbax rebuilds the pytree without calling the constructor; the first adjust clamps what it brought in.
    tx = loss_scaling(optax.sgd(0.1), DynamicLossScale(2.0**15, period=5))  # default max: 2**24
    params = {"w": jnp.ones(2)}
    big = loss_scaling(
        optax.sgd(0.1), DynamicLossScale(2.0**30, counter=8, period=10, max_loss_scale=2.0**30)
    )
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(tmp_path / "big", big.init(params))
    ckpt.wait_until_finished()
    restored = ckpt.restore(
        tmp_path / "big", jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, tx.init(params))
    )
    ls = restored.loss_scale
    assert (ls.period, ls.max_loss_scale) == (5, 2.0**24) and float(ls.loss_scale) == 2.0**30
    _, after = jax.jit(tx.update)({"w": jnp.ones(2)}, restored, params)
    assert float(after.loss_scale.loss_scale) == 2.0**24 and int(after.loss_scale.counter) == 0  # grew at c=4
    # Hand-edited values reach adjust the same way: each comes back into [min, max] after one step.
    for bad, finite, want in [(-5.0, True, 2.0), (jnp.nan, False, 2.0**23), (0.0, False, 1.0)]:
        state = jax.tree_util.tree_unflatten(
            jax.tree_util.tree_structure(ls), [jnp.float32(bad), jnp.int32(99)]
        )
        out = jax.jit(lambda s, f: s.adjust(f))(state, jnp.bool_(finite))
        assert float(out.loss_scale) == want, bad
        assert int(out.counter) == 0  # 99 counts as period - 1: the finite step grew the scale and wrapped
