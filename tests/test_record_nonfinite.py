"""loss_scaling(record_nonfinite=True) and describe_skip: skipped steps that say where.

An inf is injected into one parameter's gradient (under jit, pmap and shard_map, in one replica
only); describe_skip must name exactly that parameter's path, and keep naming it through later
applied steps until the next skipped step.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jmp_lite
from jmp_lite import DynamicLossScale, loss_scaling

pytestmark = pytest.mark.unit

N = 8
SKIPS = ["cond", "select"]
TARGET = ("encoder", "layers_3", "attn", "query", "kernel")
OTHER = ("head", "bias")


def make_params(dtype=jnp.float32):
    shapes = {
        "encoder": {
            "layers_3": {
                "attn": {"query": {"kernel": (4, 4), "bias": (4,)}, "key": {"kernel": (4, 4)}},
                "mlp": {"kernel": (4, 8)},
            }
        },
        "head": {"kernel": (8, 2), "bias": (2,)},
    }
    leaves, treedef = jax.tree_util.tree_flatten(shapes, is_leaf=lambda x: isinstance(x, tuple))
    keys = jax.random.split(jax.random.key(0), len(leaves))
    return treedef.unflatten([(0.1 * jax.random.normal(k, s)).astype(dtype) for k, s in zip(keys, leaves)])


def loss_fn(params):
    return sum(jnp.sum(jnp.sin(p.astype(jnp.float32))) for p in jax.tree_util.tree_leaves(params))


def poison(tree, bad, path):
    """``tree`` with ``inf`` added to element 0 of the leaf at ``path`` where ``bad``."""
    if not path:
        return tree.at[(0,) * tree.ndim].add(jnp.where(bad, jnp.inf, 0.0).astype(tree.dtype))
    return {**tree, path[0]: poison(tree[path[0]], bad, path[1:])}


def make_step(tx, path=TARGET):
    def step(params, opt_state, bad):
        ls = jmp_lite.get_loss_scale(opt_state)
        grads = poison(jax.grad(lambda p: ls.scale(loss_fn(p)))(params), bad, path)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return step


def name(path):
    return "/".join(path)


@pytest.mark.parametrize("skip", SKIPS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_jit_names_exactly_the_parameter_whose_gradient_was_not_finite(skip, dtype):
    params = make_params(dtype)
    tx = loss_scaling(optax.adam(1e-2), DynamicLossScale(2.0**10), skip=skip, record_nonfinite=True)
    step = jax.jit(make_step(tx))
    state = tx.init(params)
    assert jmp_lite.describe_skip(state).paths == ()
    assert str(jmp_lite.describe_skip(state)) == "no step skipped yet: no non-finite gradient recorded"
    p, state = step(params, state, jnp.bool_(True))
    report = jmp_lite.describe_skip(state)
    assert report.paths == (name(TARGET),)
    assert (report.skipped_total, report.consecutive_skips, report.last_step_applied) == (1, 1, False)
    assert str(report) == (
        "last step skipped (1 in a row, 1 skipped in total); non-finite gradients in 1 leaf:\n"
        "  encoder/layers_3/attn/query/kernel"
    )
    flags = jax.tree_util.tree_leaves_with_path(state.nonfinite_leaves)
    assert [jax.tree_util.keystr(k, simple=True, separator="/") for k, v in flags if v] == [name(TARGET)]
    assert jax.tree_util.tree_structure(state.nonfinite_leaves) == jax.tree_util.tree_structure(params)
    assert all(v.dtype == jnp.bool_ and v.shape == () for _, v in flags)
    # The skipped step kept the parameters.
    jax.tree_util.tree_map(np.testing.assert_array_equal, p, params)


@pytest.mark.parametrize("skip", SKIPS)
def test_applied_steps_keep_the_record_of_the_last_skipped_step(skip):
    params = make_params()
    tx = loss_scaling(optax.adam(1e-2), DynamicLossScale(2.0**10), skip=skip, record_nonfinite=True)
    step_target, step_other = jax.jit(make_step(tx)), jax.jit(make_step(tx, OTHER))
    p, s = step_target(params, tx.init(params), jnp.bool_(True))
    for _ in range(3):
        p, s = step_target(p, s, jnp.bool_(False))
    report = jmp_lite.describe_skip(s)
    assert report.paths == (name(TARGET),)
    assert (report.skipped_total, report.consecutive_skips, report.last_step_applied) == (1, 0, True)
    assert str(report).startswith("last step applied; the last skipped step (1 skipped in total) had")
    # The next skipped step replaces the record: only the leaf that is non-finite now.
    p, s = step_other(p, s, jnp.bool_(True))
    assert jmp_lite.describe_skip(s).paths == (name(OTHER),)
    # Two leaves in one step: both, in the gradients' leaf order.
    s = tx.update(poison(poison(params, True, OTHER), True, TARGET), s, p)[1]
    assert jmp_lite.describe_skip(s).paths == (name(TARGET), name(OTHER))


def stack(tree):
    return jax.tree_util.tree_map(lambda x: jnp.stack([x] * N), tree)


@pytest.mark.composition
@pytest.mark.parametrize("skip", SKIPS)
def test_pmap_records_a_leaf_that_one_replica_saw_on_every_replica(skip):
    assert jax.device_count() == N
    params = make_params()
    tx = loss_scaling(
        optax.adam(1e-2), DynamicLossScale(2.0**10), axis_name="d", skip=skip, record_nonfinite=True
    )
    step = jax.pmap(make_step(tx), axis_name="d")
    bad = jnp.arange(N) == 3  # the inf is in replica 3's gradients only
    p, s = step(stack(params), stack(tx.init(params)), bad)
    for leaf in jax.tree_util.tree_leaves(s.nonfinite_leaves):
        assert np.asarray(leaf).tolist() == [bool(leaf[0])] * N  # every replica holds the same record
    report = jmp_lite.describe_skip(s)
    assert report.paths == (name(TARGET),) and report.replicas == {}
    assert report.skipped_total == 1 and not report.last_step_applied
    jax.tree_util.tree_map(np.testing.assert_array_equal, p, stack(params))  # all replicas skipped
    p, s = step(p, s, jnp.zeros(N, bool))
    assert jmp_lite.describe_skip(s).paths == (name(TARGET),)
    assert jmp_lite.describe_skip(s).last_step_applied


@pytest.mark.composition
def test_pmap_without_axis_name_says_which_replicas_recorded_a_leaf():
    params = make_params()
    tx = loss_scaling(optax.sgd(0.1), DynamicLossScale(2.0**10), record_nonfinite=True)
    _, s = jax.pmap(make_step(tx))(stack(params), stack(tx.init(params)), jnp.arange(N) == 3)
    report = jmp_lite.describe_skip(s)
    assert report.paths == (name(TARGET),) and report.replicas == {name(TARGET): (3,)}
    assert str(report).endswith("encoder/layers_3/attn/query/kernel  (replicas [3])")


@pytest.mark.composition
def test_shard_map_records_a_leaf_that_one_replica_saw_on_every_replica():
    params = make_params()
    tx = loss_scaling(optax.sgd(0.1), DynamicLossScale(2.0**10), axis_name="d", record_nonfinite=True)
    step = make_step(tx)

    def local(p, s, bad):
        s = step(p, s, bad[0])[1]
        return jax.tree_util.tree_map(lambda x: x[None], s)  # one row per replica, as pmap stacks

    mesh = Mesh(np.array(jax.devices()), ("d",))
    sharded = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P("d")), out_specs=P("d")))
    s = sharded(params, tx.init(params), jnp.arange(N) == 5)
    report = jmp_lite.describe_skip(s)
    assert report.paths == (name(TARGET),) and report.replicas == {}  # every replica recorded it


def inject_tx():
    return optax.inject_hyperparams(optax.adam)(learning_rate=1e-2)


COMPOSITIONS = {
    "element_of_chain": lambda ls, **kw: optax.chain(
        loss_scaling(optax.scale_by_adam(), ls, **kw), optax.add_decayed_weights(0.1), optax.scale(-1e-2)
    ),
    "around_chain": lambda ls, **kw: loss_scaling(
        optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2)), ls, **kw
    ),
    "multisteps": lambda ls, **kw: loss_scaling(
        optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2), ls, **kw
    ),
    "inject_hyperparams": lambda ls, **kw: loss_scaling(inject_tx(), ls, **kw),
}


@pytest.mark.composition
@pytest.mark.parametrize("skip", SKIPS)
@pytest.mark.parametrize("kind", COMPOSITIONS)
def test_composes_with_chain_multisteps_and_inject_hyperparams(kind, skip):
    params = make_params()
    tx = COMPOSITIONS[kind](DynamicLossScale(2.0**10), skip=skip, record_nonfinite=True)

    @jax.jit
    def step(p, s, bad):
        grads = poison(jax.grad(lambda q: jmp_lite.get_loss_scale(s).scale(loss_fn(q)))(p), bad, TARGET)
        return jmp_lite.apply_scaled_gradients(tx, grads, s, p)

    p, s = params, tx.init(params)
    for bad in (False, True, False, False):
        before = p
        p, s, finite = step(p, s, jnp.bool_(bad))
        assert bool(finite) == (not bad)
        if bad:
            jax.tree_util.tree_map(np.testing.assert_array_equal, p, before)
    report = jmp_lite.describe_skip(s)
    assert report.paths == (name(TARGET),) and report.skipped_total == 1 and report.last_step_applied


@pytest.mark.composition
def test_linen_train_state_and_nnx_optimizer():
    import flax.linen as nn
    from flax import nnx

    from jmp_lite.flax import TrainState
    from jmp_lite.flax.nnx import LossScaledOptimizer

    tx = loss_scaling(optax.adam(1e-2), DynamicLossScale(2.0**10), record_nonfinite=True)

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Dense(4, name="query")(x)
            return nn.Dense(2, name="out")(x)

    model = Block()
    params = model.init(jax.random.key(0), jnp.ones((1, 3)))["params"]
    state = TrainState.create(apply_fn=model.apply, params=params, tx=tx)

    @jax.jit
    def linen_step(state, bad):
        grads = jax.grad(
            lambda p: state.loss_scale.scale(state.apply_fn({"params": p}, jnp.ones((1, 3))).sum())
        )
        return state.apply_gradients(grads=poison(grads(state.params), bad, ("query", "kernel")))

    state = linen_step(state, jnp.bool_(True))
    assert jmp_lite.describe_skip(state).paths == ("query/kernel",)
    assert jmp_lite.describe_skip(state.opt_state).paths == ("query/kernel",)

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.encoder = nnx.Linear(3, 4, rngs=rngs)
            self.layers = nnx.List([nnx.Linear(4, 4, rngs=rngs) for _ in range(2)])

        def __call__(self, x):
            x = self.encoder(x)
            for layer in self.layers:
                x = layer(x)
            return x

    net = Net(nnx.Rngs(0))
    optimizer = LossScaledOptimizer(net, tx)

    @nnx.jit
    def nnx_step(net, optimizer, bad):
        grads = nnx.grad(lambda m: optimizer.loss_scale.scale(m(jnp.ones((1, 3))).sum()))(net)
        kernel = grads["layers"][1]["kernel"]
        kernel[...] = poison(kernel[...], bad, ())
        optimizer.update(net, grads)

    nnx_step(net, optimizer, jnp.bool_(True))
    assert jmp_lite.describe_skip(optimizer).paths == ("layers/1/kernel",)
    assert jmp_lite.describe_skip(optimizer.opt_state).paths == ("layers/1/kernel",)
    nnx_step(net, optimizer, jnp.bool_(False))
    assert jmp_lite.describe_skip(optimizer).paths == ("layers/1/kernel",)
    assert jmp_lite.describe_skip(optimizer).last_step_applied


# A value the step moves to the host, or back: XLA's infeed/outfeed, send/recv, and the custom calls
# behind jax.debug.callback, io_callback and pure_callback.
HOST_TRANSFER = re.compile(
    r"\s(infeed|outfeed|send|recv|send-done|recv-done)\(|is_host_transfer=true|custom_call_target=\"[^\"]*callback"
)


def compiled_text(fn, *args):
    return fn.lower(*args).compile().as_text()


@pytest.mark.parametrize("skip", SKIPS)
@pytest.mark.compiled  # reads the compiled program
def test_the_compiled_step_has_no_host_transfer_and_no_extra_conditional(skip):
    params = make_params()
    args = (params, jnp.bool_(False))
    texts = {}
    for record in (False, True):
        tx = loss_scaling(optax.adam(1e-2), DynamicLossScale(2.0**10), skip=skip, record_nonfinite=record)
        texts[record] = compiled_text(jax.jit(make_step(tx)), params, tx.init(params), args[1])
        pmapped = compiled_text(
            jax.pmap(
                make_step(
                    loss_scaling(
                        optax.adam(1e-2),
                        DynamicLossScale(2.0**10),
                        axis_name="d",
                        skip=skip,
                        record_nonfinite=record,
                    )
                ),
                axis_name="d",
            ),
            stack(params),
            stack(tx.init(params)),
            jnp.zeros(N, bool),
        )
        assert not HOST_TRANSFER.search(texts[record]) and not HOST_TRANSFER.search(pmapped)
    # The record is a select outside the skip's cond: no second conditional, none at all with select.
    assert texts[True].count(" conditional(") == texts[False].count(" conditional(") == (skip == "cond")
    # The pattern does see a host transfer when there is one.
    tx = loss_scaling(optax.adam(1e-2), DynamicLossScale(2.0**10), skip=skip, record_nonfinite=True)

    def leaky(p, s, bad):
        out = make_step(tx)(p, s, bad)
        jax.debug.callback(lambda x: None, out[1].nonfinite_leaves)
        return out

    assert HOST_TRANSFER.search(compiled_text(jax.jit(leaky), params, tx.init(params), args[1]))


@pytest.mark.parametrize("skip", SKIPS)
def test_the_record_adds_no_copy_to_a_donated_step(skip):
    # jit drops the unused inputs last_grads_finite and skip_limit_reached and pairs donated buffers
    # with outputs of the same type in order: a record after them would pair with the wrong outputs,
    # and XLA would copy two scalars per leaf every step.
    params = make_params()

    def copies(record):
        tx = loss_scaling(optax.adam(1e-2), DynamicLossScale(2.0**10), skip=skip, record_nonfinite=record)
        step = jax.jit(make_step(tx), donate_argnums=(0, 1))
        return re.findall(r"= (\S+) copy\(", compiled_text(step, params, tx.init(params), jnp.bool_(False)))

    assert copies(True) == copies(False)


@pytest.mark.composition
def test_with_axis_name_the_check_stays_one_collective():
    params = make_params()

    def collectives(record):
        tx = loss_scaling(optax.sgd(0.1), DynamicLossScale(2.0**10), axis_name="d", record_nonfinite=record)
        jaxpr = jax.make_jaxpr(make_step(tx), axis_env=[("d", N)])(params, tx.init(params), jnp.bool_(False))
        names = re.findall(r"\b(pmin|pmax|psum|all_gather)\[", str(jaxpr))
        return sorted(names)

    assert collectives(False) == ["pmin"]
    assert collectives(True) == ["pmax"]  # one vector of per-leaf flags instead of one flag


def test_default_state_is_unchanged_no_new_leaves():
    params = make_params()
    for ls in (DynamicLossScale(2.0**10), jmp_lite.StaticLossScale(8.0), jmp_lite.NoOpLossScale()):
        tx = loss_scaling(optax.adam(1e-2), ls)
        state = tx.init(params)
        assert state.nonfinite_leaves is None
        fields = [getattr(state, f) for f in jmp_lite.LossScalingState._fields if f != "nonfinite_leaves"]
        assert jax.tree_util.tree_leaves(state) == jax.tree_util.tree_leaves(fields)
        new = jax.jit(tx.update)(poison(params, True, TARGET), state, params)[1]
        assert new.nonfinite_leaves is None
        assert jax.tree_util.tree_structure(new) == jax.tree_util.tree_structure(state)
    recorded = loss_scaling(optax.adam(1e-2), DynamicLossScale(2.0**10), record_nonfinite=True).init(params)
    default = loss_scaling(optax.adam(1e-2), DynamicLossScale(2.0**10)).init(params)
    assert len(jax.tree_util.tree_leaves(recorded)) == len(jax.tree_util.tree_leaves(default)) + len(
        jax.tree_util.tree_leaves(params)
    )


def test_raise_if_skip_limit_reached_names_the_paths():
    params = make_params()
    tx = loss_scaling(
        optax.sgd(0.1), DynamicLossScale(2.0**10), max_consecutive_skips=2, record_nonfinite=True
    )
    step = jax.jit(make_step(tx))
    p, s = step(params, tx.init(params), jnp.bool_(True))
    p, s = jax.jit(make_step(tx, OTHER))(p, s, jnp.bool_(True))
    with pytest.raises(
        jmp_lite.SkipLimitReachedError, match=r"non-finite on the last skipped step: head/bias$"
    ):
        jmp_lite.raise_if_skip_limit_reached(s)
    # On a pmap-stacked state: the leaves of the first replica that hit the limit.
    tx = loss_scaling(
        optax.sgd(0.1), DynamicLossScale(2.0**10), max_consecutive_skips=1, record_nonfinite=True
    )
    _, s = jax.pmap(make_step(tx))(stack(params), stack(tx.init(params)), jnp.arange(N) == 6)
    with pytest.raises(
        jmp_lite.SkipLimitReachedError, match=r"replica\(s\) \[6\].*encoder/layers_3/attn/query/kernel"
    ):
        jmp_lite.raise_if_skip_limit_reached(s)
    # Without recording, the message is as before.
    tx = loss_scaling(optax.sgd(0.1), DynamicLossScale(2.0**10), max_consecutive_skips=1)
    s = jax.jit(make_step(tx))(params, tx.init(params), jnp.bool_(True))[1]
    with pytest.raises(jmp_lite.SkipLimitReachedError, match=r"produce inf/NaN$"):
        jmp_lite.raise_if_skip_limit_reached(s)


def test_clear_errors():
    params = make_params()
    state = loss_scaling(optax.sgd(0.1), DynamicLossScale(2.0**10)).init(params)
    with pytest.raises(
        ValueError, match=r"describe_skip needs jmp_lite.loss_scaling\(\.\.\., record_nonfinite=True\)"
    ):
        jmp_lite.describe_skip(state)
    with pytest.raises(ValueError, match="does not check finiteness"):
        jmp_lite.describe_skip(loss_scaling(optax.sgd(0.1), jmp_lite.NoOpLossScale()).init(params))
    with pytest.raises(ValueError, match="expected exactly one jmp_lite.loss_scaling state"):
        jmp_lite.describe_skip(optax.sgd(0.1).init(params))
    with pytest.raises(ValueError, match="record_nonfinite=True .* check_finite=True"):
        loss_scaling(optax.sgd(0.1), jmp_lite.NoOpLossScale(), record_nonfinite=True)
    with pytest.raises(TypeError, match="loss_scaling.record_nonfinite must be True or False, got 1"):
        loss_scaling(optax.sgd(0.1), DynamicLossScale(2.0), record_nonfinite=1)
    recording = loss_scaling(optax.sgd(0.1), DynamicLossScale(2.0**10), record_nonfinite=True)
    with pytest.raises(ValueError, match="a state without nonfinite_leaves"):
        recording.update(params, state, params)
    with pytest.raises(ValueError, match="tree structure differs from that of the params given to init"):
        recording.update({"w": jnp.ones(2)}, recording.init(params), params)
    with pytest.raises(TypeError, match="describe_skip reads the skip flag on the host"):
        jax.jit(jmp_lite.describe_skip)(recording.init(params))


def test_a_single_array_of_parameters():
    tx = loss_scaling(optax.sgd(0.1), DynamicLossScale(2.0**10), record_nonfinite=True)
    _, s = tx.update(jnp.array([jnp.nan, 1.0]), tx.init(jnp.ones(2)))
    assert jmp_lite.describe_skip(s).paths == ("",)
    assert "(the gradient itself, a single array)" in str(jmp_lite.describe_skip(s))


def test_nnx_flags_are_plain_arrays_without_the_params_sharding():
    # nnx.Optimizer turns each Variable of tx.init's state into an OptVariable with the Variable's
    # metadata; a Param's sharding on a scalar flag would fail as soon as the optimizer is built.
    from flax import nnx

    from jmp_lite.flax.nnx import LossScaledOptimizer

    tx = loss_scaling(optax.adam(1e-2), DynamicLossScale(2.0**10), record_nonfinite=True)
    with jax.set_mesh(jax.make_mesh((2, 4), ("a", "b"))):
        init = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("a", "b"))
        model = nnx.Linear(4, 8, kernel_init=init, rngs=nnx.Rngs(0))
        optimizer = LossScaledOptimizer(model, tx)
        specs = nnx.get_partition_spec(nnx.state(optimizer)).opt_state
    assert specs.nonfinite_leaves["kernel"].get_value() == P()
    assert specs.scaled_inner_state[0].mu["kernel"].get_value() == P("a", "b")
