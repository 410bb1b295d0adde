"""FP8 training through the front-ends: ``fp8=`` of Linen's and NNX's ``apply_policy`` and of ``autocast``,
and the delayed-scaling state that ``jmp_lite.flax.TrainState`` and ``LossScaledOptimizer`` carry."""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from _jaxpr import eqns
from flax import nnx, serialization

import jmp_lite
import jmp_lite.flax
import jmp_lite.flax.nnx as jnnx
from jmp_lite import fp8
from jmp_lite.flax import TrainState
from jmp_lite.fp8 import NoFp8ContractionWarning

pytestmark = pytest.mark.composition

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E5M2 = np.dtype(ml_dtypes.float8_e5m2)
RECIPE = "hybrid,delayed,history=8"
# The contractions with a weight in both models below (the attention projections included); "head"
# is opted out by a rule, and the attention scores read no weight.
WEIGHTS = ("first", "query", "key", "value", "out", "general", "einsum")
MATMUL = (((1,), (0,)), ((), ()))


def bits(tree):
    return [np.asarray(x).tobytes() for x in jax.tree_util.tree_leaves(tree)]


def policy_of(compute):
    return f"p=f32,c={compute},o=f32"


class LinenNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Dense(16, name="first")(x)
        x = nn.MultiHeadDotProductAttention(num_heads=2, name="attn")(x)
        x = nn.DenseGeneral((2, 8), name="general")(x).reshape(*x.shape[:-1], 16)
        x = nn.Einsum((16, 16), "btd,df->btf", name="einsum")(x)
        return nn.Dense(4, name="head")(nn.LayerNorm()(x))


class NnxNet(nnx.Module):
    def __init__(self, rngs):
        self.first = nnx.Linear(8, 16, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(num_heads=2, in_features=16, decode=False, rngs=rngs)
        self.general = nnx.LinearGeneral(16, (2, 8), rngs=rngs)
        self.einsum = nnx.Einsum("btd,df->btf", (16, 16), rngs=rngs)
        self.norm = nnx.LayerNorm(16, rngs=rngs)
        self.head = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
        x = self.attn(self.first(x))
        x = self.einsum(self.general(x).reshape(*x.shape[:-1], 16))
        return self.head(self.norm(x))


def batch(seed, n=4, scale=1.0):
    # drawn on the host: jax.random compiles a program per batch shape, seconds each on CPU
    x = np.random.default_rng(seed).standard_normal((n, 5, 8), np.float32) * np.float32(scale)
    return jnp.asarray(x), jnp.asarray(np.sin(x[..., :4]))


def linen_state(compute="bf16", recipe=RECIPE, tx=None, **create):
    policy = policy_of(compute)
    model = jmp_lite.flax.linen.apply_policy(LinenNet(), policy, {"head": policy}, fp8=recipe)
    variables = model.init(jax.random.key(0), batch(0)[0])
    tx = tx or jmp_lite.loss_scaling(optax.adam(1e-2), jmp_lite.DynamicLossScale(2.0**8))
    state = TrainState.create(apply_fn=model.apply, params=variables, tx=tx, **create)
    # a strongly typed step counter, as apply_gradients returns it: the first step's compile serves the next
    return state.replace(step=jnp.asarray(state.step, jnp.int32))


@pytest.fixture(scope="module")
def linen_fresh():
    """The default untrained Linen state: tests that train it share its model and tx, so one compiled step."""
    return linen_state()


def linen_step(state, x, y, sum_loss=False):
    def loss_fn(variables):
        err = (state.apply_fn(variables, x) - y) ** 2
        return jnp.sum(err) if sum_loss else jnp.mean(err)

    loss, grads = jmp_lite.value_and_grad(loss_fn)(state, state.params)
    return state.apply_gradients(grads=grads), loss


def nnx_setup(compute="bf16", recipe=RECIPE):
    policy = policy_of(compute)
    view = jnnx.apply_policy(NnxNet(nnx.Rngs(0)), policy, {"head": policy}, fp8=recipe)
    tx = jmp_lite.loss_scaling(optax.adam(1e-2), jmp_lite.DynamicLossScale(2.0**8))
    return view, jnnx.LossScaledOptimizer(view, tx)


def nnx_step(view, optimizer, x, y):
    loss_fn = lambda view: jnp.mean((view(x) - y) ** 2)  # noqa: E731
    loss, grads = jmp_lite.value_and_grad(loss_fn)(optimizer, view)
    optimizer.update(view, grads)
    return loss


# One nnx.jit for the file: it compiles once per graph, and nnx.clone of one pair keeps the graph.
nnx_train_step = nnx.jit(nnx_step)


@pytest.fixture(scope="module")
def nnx_template():
    """The default untrained view and optimizer; tests train ``nnx.clone``s of it (one compiled step)."""
    return nnx_setup()


def contractions(jaxpr):
    """(operand dtypes, module labels of its name stack) of every dot_general."""
    found = []
    for e in eqns(jaxpr):
        if e.primitive.name == "dot_general":
            labels = {p.split("#")[0] for p in re.split(r"[/()]", str(e.source_info.name_stack)) if p}
            found.append((tuple(np.dtype(v.aval.dtype) for v in e.invars), labels))
    return found


def check_fp8_contractions(jaxpr, grad_dtype=E5M2):
    dots = contractions(jaxpr)
    forward = [labels for d, labels in dots if d == (E4M3, E4M3)]
    backward = [labels for d, labels in dots if d == (grad_dtype, E4M3)]
    for w in WEIGHTS:  # one fp8 contraction forward, two (d lhs, d rhs) backward, per weight
        assert sum(w in labels for labels in forward) == 1, w
        assert sum(w in labels for labels in backward) == 2, w
    fp8_dots = [d for d, _ in dots if {E4M3, E5M2} & set(d)]
    assert len(forward) == len(WEIGHTS) and len(backward) == 2 * len(WEIGHTS) == len(fp8_dots) - len(forward)
    # the opted-out layer and the attention scores (no weight operand) stay 16-bit, forward and backward;
    # the engine runs the attention as the blockwise kernel, whose contractions carry no module label
    head = [d for d, labels in dots if "head" in labels]
    scores = [d for d, labels in dots if not labels & {*WEIGHTS, "head"}]
    assert len(scores) >= 4  # q k^T and p v, forward and backward
    assert head and scores and not {E4M3, E5M2} & {t for d in head + scores for t in d}


@pytest.mark.parametrize("compute", ["bf16", "f16"])
def test_linen_train_step_contracts_every_weight_in_fp8_forward_and_backward(compute):
    state = linen_state(compute)
    assert "fp8" not in jax.tree_util.tree_structure(state.opt_state).__repr__()  # tx never sees them
    x, y = batch(1)
    jaxpr = jax.make_jaxpr(jax.jit(linen_step))(state, x, y)
    check_fp8_contractions(jaxpr.jaxpr)


@pytest.mark.parametrize("compute", ["bf16", "f16"])
def test_nnx_train_step_contracts_every_weight_in_fp8_forward_and_backward(compute):
    view, optimizer = nnx_setup(compute)
    assert not nnx.state(view.model, jnnx.Fp8Variable)  # the view holds the states, not the model
    assert not nnx.state(optimizer.opt_state, jnnx.Fp8Variable)  # nor the optimizer state
    graphdef, state = nnx.split((view, optimizer))

    def pure(state, x, y):
        view, optimizer = nnx.merge(graphdef, state)
        loss = nnx_step(view, optimizer, x, y)
        return loss, nnx.state((view, optimizer))

    jaxpr = jax.make_jaxpr(jax.jit(pure))(state, *batch(1))
    check_fp8_contractions(jaxpr.jaxpr)


def test_e4m3_recipe_quantizes_the_gradients_to_e4m3_and_a_float32_policy_runs_fp8_too():
    state = linen_state("f32", "e4m3,current")
    assert "fp8" not in state.params  # current scaling: no state
    jaxpr = jax.make_jaxpr(linen_step)(state, *batch(1))
    dots = [d for d, _ in contractions(jaxpr.jaxpr)]
    assert dots.count((E4M3, E4M3)) == 3 * len(WEIGHTS) and E5M2 not in {t for d in dots for t in d}


def test_linen_collection_layout_rules_and_training_move_the_states(linen_fresh):
    state = linen_fresh
    fp8_states = state.params["fp8"]
    # one Fp8State per parameter an fp8 contraction reads, at its path: the opted-out head has none
    assert jax.tree_util.tree_map(jnp.shape, fp8_states)["first"] == {
        "kernel": fp8.Fp8State(fp8_scale=(3,), fp8_amax_history=(3, 8), fp8_amax=(3,))
    }
    assert sorted(fp8_states) == ["attn", "einsum", "first", "general"]
    assert sorted(fp8_states["attn"]) == ["key", "out", "query", "value"]
    step = jax.jit(linen_step)
    x, y = batch(1)
    for _ in range(3):
        state, _ = step(state, x, y)
    history = np.asarray(state.params["fp8"]["first"]["kernel"].fp8_amax_history)
    assert (history[:, :3] > 0).all() and (history[:, 3:] == 0).all()  # once per step: 3 columns
    assert history[0, 0] == float(jnp.abs(x.astype(jnp.bfloat16)).max())  # the input's amax
    assert bits(state.fp8_observed) == bits(jax.tree_util.tree_map(jnp.zeros_like, state.fp8_observed))


def test_nnx_states_follow_the_parameter_paths_and_move_once_per_step(nnx_template):
    view, optimizer = nnx.clone(nnx_template)
    assert "head" not in view.fp8_state and "norm" not in view.fp8_state  # rule and float32 default
    assert isinstance(view.fp8_state["attn"]["query"]["kernel"].get_value(), fp8.Fp8State)
    x, y = batch(1)
    for _ in range(3):
        nnx_train_step(view, optimizer, x, y)
    history = np.asarray(view.fp8_state["first"]["kernel"].get_value().fp8_amax_history)
    assert (history[:, :3] > 0).all() and (history[:, 3:] == 0).all()
    # a parameter no contraction reads keeps its fresh state
    bias = view.fp8_state["first"]["bias"].get_value()
    assert bits(bias) == bits(fp8.init_fp8_state(RECIPE))


def test_autocast_fp8_matches_hand_written_fp8_contractions_bitwise():
    recipe = fp8.Fp8Recipe("hybrid", "delayed", amax_history=4)
    params = {"w1": jax.random.normal(jax.random.key(0), (16, 32)) * 0.3, "w2": jnp.ones((32, 4)) * 0.1}
    x = jax.random.normal(jax.random.key(1), (8, 16))

    def model(params, x):
        return jax.nn.relu(x @ params["w1"]) @ params["w2"]

    f = jmp_lite.autocast(model, "f32", fp8=recipe)
    states = f.init_fp8_state(params, x)
    assert set(states) == {"0"} and sorted(states["0"]) == ["w1", "w2"]  # nested by argument path

    def by_hand(params, states, x):
        w1, w2 = states["0"]["w1"], states["0"]["w2"]
        h = jax.nn.relu(fp8.dot_general(x, params["w1"], MATMUL, recipe=recipe, state=w1))
        return fp8.dot_general(h, params["w2"], MATMUL, recipe=recipe, state=w2)

    def train(forward, states):
        # one compiled gradient per forward, x an argument: the three steps run the same program
        loss = lambda p, s, x: jnp.sum(forward(p, s, x) ** 2)  # noqa: E731
        grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
        params_ = params
        for _ in range(3):
            grads, observed = grad(params_, states, x)
            params_ = jax.tree_util.tree_map(lambda p, g: p - 1e-3 * g, params_, grads)
            states = fp8.update_fp8_state(states, observed, recipe)
        return params_, states

    got = train(lambda p, s, x: f(p, x, fp8_state=s), states)
    assert bits(got) == bits(train(by_hand, states))
    assert float(got[1]["0"]["w1"].fp8_amax_history[0, 0]) == float(jnp.abs(x).max())


def test_the_front_ends_keep_fp8_states_in_one_shape_and_run_on_each_others():
    """Linen's ``variables["fp8"]``, autocast's ``init_fp8_state`` and NNX's ``view.fp8_state`` are nested by
    parameter path; a Linen model's states run under autocast of its ``apply`` and the other way round."""
    recipe, policy = "hybrid,delayed,history=4", "p=f32,c=bf16,o=f32"
    mlp = nn.Sequential([nn.Dense(8), nn.relu, nn.Dense(2)])
    x = jax.random.normal(jax.random.key(1), (4, 3))
    linen = jmp_lite.flax.linen.apply_policy(mlp, policy, fp8=recipe)
    variables = linen.init(jax.random.key(0), x)
    params = variables["params"]
    auto = jmp_lite.autocast(lambda p, x: mlp.apply({"params": p}, x), policy, fp8=recipe)
    fresh = auto.init_fp8_state(params, x)
    assert jax.tree.structure(fresh) == jax.tree.structure({"0": variables["fp8"]})
    assert sorted(fresh["0"]) == ["layers_0", "layers_2"] and sorted(fresh["0"]["layers_0"]) == ["kernel"]

    # states with a history: two Linen steps' amaxes
    def observed_by_linen(states):
        return jax.grad(lambda s: jnp.sum(linen.apply({"params": params, "fp8": s}, x) ** 2))(states)

    states = variables["fp8"]
    for _ in range(2):
        states = fp8.update_fp8_state(states, observed_by_linen(states), recipe)
    out_linen = jax.jit(lambda s: linen.apply({"params": params, "fp8": s}, x))(states)
    out_auto = jax.jit(lambda s: auto(params, x, fp8_state={"0": s}))(states)
    assert bits(out_auto) == bits(out_linen)
    seen = jax.grad(lambda s: jnp.sum(auto(params, x, fp8_state=s) ** 2))({"0": states})
    assert bits(seen["0"]) == bits(observed_by_linen(states))

    model = nnx.Sequential(nnx.Linear(3, 8, rngs=nnx.Rngs(0)), nnx.relu, nnx.Linear(8, 2, rngs=nnx.Rngs(1)))
    view = jnnx.apply_policy(model, policy, fp8=recipe)
    is_var = lambda v: isinstance(v, jnnx.Fp8Variable)  # noqa: E731
    held = jax.tree.map(lambda v: v.get_value(), dict(view.fp8_state), is_leaf=is_var)
    is_state = lambda s: isinstance(s, fp8.Fp8State)  # noqa: E731
    keys = lambda tree, leaf=None: {
        jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree, leaf)[0]
    }  # noqa: E731
    assert keys(held, is_state) == keys(nnx.to_pure_dict(nnx.state(model, nnx.Param)))


def test_replicas_hold_bitwise_equal_fp8_state_after_ten_pmap_steps():
    n = jax.local_device_count()
    assert n == 8
    tx = jmp_lite.loss_scaling(
        optax.sgd(1e-2), jmp_lite.DynamicLossScale(2.0**8), axis_name="i", reduce="mean"
    )
    state = linen_state(tx=tx, fp8_axis_name="i")
    # n copies (stacked on the host: no compile per leaf shape), laid out over the replicas as pmap returns
    # them, so the first step's compile serves the other nine
    state = jax.tree_util.tree_map(lambda a: np.stack([np.asarray(a)] * n), state)
    mesh = jax.sharding.Mesh(jax.local_devices(), ("i",))
    state = jax.device_put(state, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("i")))
    step = jax.pmap(linen_step, axis_name="i")
    for i in range(10):
        x, y = batch(20 + i, n * 2)
        x = x.reshape(n, 2, 5, 8) * jnp.arange(1, n + 1)[:, None, None, None]  # replica-local data
        state, _ = step(state, x, y.reshape(n, 2, 5, 4))
    local = [float(jnp.abs(x[r].astype(jnp.bfloat16)).max()) for r in range(n)]
    assert len(set(local)) == n  # every replica saw a different amax
    for leaf in jax.tree_util.tree_leaves((state.params, state.fp8_observed)):
        leaf = np.asarray(leaf)
        assert all(leaf[r].tobytes() == leaf[0].tobytes() for r in range(1, n))
    assert float(state.params["fp8"]["first"]["kernel"].fp8_amax_history[0, 0, 0]) == max(local)


def test_multisteps_of_four_microbatches_hold_the_history_of_one_big_batch():
    # Parameters frozen (learning rate 0), so both runs see the same weights at every step and the only
    # difference is how the amaxes of the 4 microbatches reach the state. A sum loss: an example's output
    # gradient does not depend on the batch it is in (docs/fp8.md).
    no_scale = jmp_lite.NoOpLossScale()
    big = linen_state(tx=jmp_lite.loss_scaling(optax.sgd(0.0), no_scale))
    multi = optax.MultiSteps(optax.sgd(0.0), every_k_schedule=4)
    micro = linen_state(tx=jmp_lite.loss_scaling(multi, no_scale))
    step = jax.jit(lambda s, x, y: linen_step(s, x, y, sum_loss=True)[0])
    for i in range(3):
        x, y = batch(40 + i, 8, scale=1.0 + i)
        big = step(big, x, y)
        for j in range(4):
            before = micro.params["fp8"]
            micro = step(micro, x[2 * j : 2 * j + 2], y[2 * j : 2 * j + 2])
            if j < 3:  # accumulating: the state waits, the pending amaxes grow
                assert bits(micro.params["fp8"]) == bits(before)
                assert float(micro.fp8_observed["first"]["kernel"][0]) > 0
        assert bits(micro.params["fp8"]) == bits(big.params["fp8"])
        assert not np.asarray(micro.fp8_observed["first"]["kernel"]).any()


@pytest.mark.parametrize("front_end", ["linen", "nnx"])
def test_a_skipped_step_leaves_the_fp8_state_bitwise_unchanged(front_end):
    x, y = batch(1)
    blown = x.at[0, 0, 0].set(jnp.inf)
    if front_end == "linen":
        state = linen_state("f16")
        step = jax.jit(linen_step)
        state, _ = step(state, x, y)
        skipped, _ = step(state, blown, y)
        fp8_of = lambda s: (s.params["fp8"], s.fp8_observed)  # noqa: E731
        assert not bool(skipped.last_step_applied)
        assert bits(fp8_of(skipped)) == bits(fp8_of(state))
        moved, _ = step(skipped, x, y)
        assert bits(fp8_of(moved)) != bits(fp8_of(state))
    else:
        view, optimizer = nnx_setup("f16")
        step = nnx.jit(nnx_step)
        step(view, optimizer, x, y)
        fp8_of = lambda: (  # noqa: E731
            nnx.state(view, jnnx.Fp8Variable),
            nnx.state(optimizer, nnx.PathContains("fp8_observed")),
        )
        before = bits(fp8_of())
        step(view, optimizer, blown, y)
        assert not bool(optimizer.last_step_applied)
        assert bits(fp8_of()) == before
        step(view, optimizer, x, y)
        assert bits(fp8_of()) != before


def test_linen_checkpoint_layout_restore_and_continue_are_bitwise(tmp_path, linen_fresh):
    state = linen_fresh
    step = jax.jit(linen_step)
    xs = [batch(60 + i) for i in range(6)]
    for x, y in xs[:3]:
        state, _ = step(state, x, y)
    saved = serialization.to_state_dict(state)
    # the documented layout: params/fp8/<parameter path>/{fp8_scale, fp8_amax_history, fp8_amax}
    assert {k: v.shape for k, v in saved["params"]["fp8"]["attn"]["query"]["kernel"].items()} == {
        "fp8_scale": (3,),
        "fp8_amax_history": (3, 8),
        "fp8_amax": (3,),
    }
    assert saved["fp8_observed"]["first"]["kernel"].shape == (3,)
    blob = serialization.msgpack_serialize(saved)
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(tmp_path / "linen", state)
    ckpt.wait_until_finished()

    uninterrupted = state
    for x, y in xs[3:]:
        uninterrupted, _ = step(uninterrupted, x, y)
    # the untrained state is the template a restarted run builds (its model and tx: the same compiled step)
    fresh = linen_fresh
    from_msgpack = serialization.from_state_dict(fresh, serialization.msgpack_restore(blob))
    abstract = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, fresh)
    # host copies: orbax's arrays come back committed to a device, which would compile the step anew
    from_orbax = jax.tree_util.tree_map(np.asarray, ckpt.restore(tmp_path / "linen", abstract))
    for restored in (from_msgpack, from_orbax):
        assert isinstance(restored.params["fp8"]["first"]["kernel"], fp8.Fp8State)
        for x, y in xs[3:]:
            restored, _ = step(restored, x, y)
        assert bits(restored) == bits(uninterrupted)


def test_nnx_checkpoint_restore_and_continue_are_bitwise(tmp_path, nnx_template):
    view, optimizer = nnx.clone(nnx_template)
    step = nnx_train_step
    xs = [batch(70 + i) for i in range(6)]
    for x, y in xs[:3]:
        step(view, optimizer, x, y)
    state = nnx.state((view, optimizer))
    pure = nnx.to_pure_dict(state)
    # the documented layout: the view's fp8_state/<parameter path> holds the Fp8State's three fields
    assert jax.tree_util.tree_map(jnp.shape, pure[0]["fp8_state"]["first"]["kernel"]) == fp8.Fp8State(
        (3,), (3, 8), (3,)
    )
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(tmp_path / "nnx", pure)
    ckpt.wait_until_finished()
    for x, y in xs[3:]:
        step(view, optimizer, x, y)
    uninterrupted = bits(nnx.state((view, optimizer)))

    view, optimizer = nnx.clone(nnx_template)  # new, untrained objects with the same graph
    fresh = nnx.state((view, optimizer))
    restored = ckpt.restore(tmp_path / "nnx", jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, pure))
    restored = jax.tree_util.tree_map(np.asarray, restored)  # host copies, as for Linen: no second compile
    nnx.replace_by_pure_dict(fresh, restored)
    nnx.update((view, optimizer), fresh)
    for x, y in xs[3:]:
        step(view, optimizer, x, y)
    assert bits(nnx.state((view, optimizer))) == uninterrupted


@pytest.mark.parametrize("compute", ["bf16", "f16"])
def test_nnx_checkpoint_of_the_model_and_the_optimizer_keeps_the_fp8_state(tmp_path, nnx_template, compute):
    """The NNX habit (docs/checkpoints.md): save nnx.state(model) and nnx.state(optimizer). The model
    holds no fp8 state; the optimizer holds the view's Fp8Variables (the same variables), so the
    restored run continues bit for bit. Before, it restarted every scale at 1, silently."""
    setup = (lambda: nnx.clone(nnx_template)) if compute == "bf16" else (lambda: nnx_setup(compute))
    view, optimizer = setup()
    kernel = view.fp8_state["first"]["kernel"]
    assert optimizer.fp8_state["first"]["kernel"] is kernel  # shared, not a copy
    xs = [batch(80 + i) for i in range(4)]
    for x, y in xs[:2]:
        nnx_train_step(view, optimizer, x, y)
    saved = {
        "model": nnx.to_pure_dict(nnx.state(view.model)),
        "optimizer": nnx.to_pure_dict(nnx.state(optimizer)),
    }
    assert "fp8_state" not in saved["model"] and "first" in saved["optimizer"]["fp8_state"]
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(tmp_path / compute, saved)
    ckpt.wait_until_finished()
    for x, y in xs[2:]:
        nnx_train_step(view, optimizer, x, y)
    uninterrupted = bits(nnx.state((view, optimizer)))

    view, optimizer = setup()  # fresh objects: the view's fp8 states start again at scale 1
    target = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, saved)
    restored = jax.tree_util.tree_map(np.asarray, ckpt.restore(tmp_path / compute, target))
    for node, pure in ((view.model, restored["model"]), (optimizer, restored["optimizer"])):
        state = nnx.state(node)
        nnx.replace_by_pure_dict(state, pure)
        nnx.update(node, state)
    assert bits(view.fp8_state["first"]["kernel"].get_value()) != bits(fp8.init_fp8_state(RECIPE))
    for x, y in xs[2:]:
        nnx_train_step(view, optimizer, x, y)
    assert bits(nnx.state((view, optimizer))) == uninterrupted


@pytest.mark.unit
def test_fp8_argument_errors_name_what_is_accepted(linen_fresh, nnx_template):
    dense, policy = nn.Dense(2), "p=f32,c=bf16,o=f32"
    linear = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    apply_policies = [
        lambda **kw: jmp_lite.flax.linen.apply_policy(dense, policy, **kw),
        lambda **kw: jnnx.apply_policy(linear, "compute=bf16", **kw),
        lambda **kw: jmp_lite.autocast(lambda x: x, policy, **kw),
    ]
    for make in apply_policies:
        with pytest.raises(ValueError, match="'hybrid', 'e4m3'"):
            make(fp8="formats=e5m2")
        with pytest.raises(ValueError, match="history"):
            make(fp8="hybrid,delayed,history=0")
        with pytest.raises(TypeError, match="Fp8Recipe or a recipe string"):
            make(fp8=8)
    with pytest.raises(ValueError, match="float64"):
        jmp_lite.flax.linen.apply_policy(dense, "p=f64,c=f64,o=f64", fp8="hybrid")
    with pytest.raises(ValueError, match="float64"):
        jmp_lite.autocast(lambda x: x, "float64", fp8="hybrid,current")
    with pytest.raises(ValueError, match="accumulate=False"):
        jmp_lite.flax.linen.apply_policy(dense, policy, accumulate=False, fp8="hybrid")

    # delayed scaling without its states
    f = jmp_lite.autocast(lambda w, x: x @ w, policy, fp8="hybrid,delayed")
    w, x = jnp.ones((4, 2)), jnp.ones((3, 4))
    with pytest.raises(ValueError, match="fp8_state=states"):
        f(w, x)
    with pytest.raises(ValueError, match=r"name no array argument.*\['0', '1'\]"):
        f(w, x, fp8_state={"weights": fp8.init_fp8_state("hybrid,delayed")})
    with pytest.raises(ValueError, match="float64"):
        f(np.ones((4, 2)), np.ones((3, 4)), fp8_state=f.init_fp8_state(w, x))
    model = jmp_lite.flax.linen.apply_policy(dense, policy, fp8="hybrid,delayed")
    with pytest.raises(ValueError, match="lack; create them with this model's init"):
        model.apply(dense.init(jax.random.key(0), x), x)

    # a weight read by two contractions cannot share one delayed state
    tied = jmp_lite.autocast(lambda w, x: (x @ w) @ w.T, policy, fp8="hybrid,delayed")
    with pytest.raises(ValueError, match=r"'0' \(2 contractions\)"):
        tied.init_fp8_state(w, x)

    # the training wrappers refuse gradients that drop the observations, and states without a recipe
    state = linen_fresh
    without = {"params": jax.tree_util.tree_map(jnp.zeros_like, state.params["params"])}
    with pytest.raises(ValueError, match="no 'fp8' entry"):
        state.apply_gradients(grads=without)
    with pytest.raises(ValueError, match="pass fp8_recipe="):
        TrainState.create(apply_fn=lambda *a: None, params=state.params, tx=optax.sgd(0.1))
    view, optimizer = nnx.clone(nnx_template)

    def update(view, optimizer):
        grads = nnx.grad(lambda v: jnp.sum(v(batch(1)[0])))(view)  # nnx.Param only
        optimizer.update(view, grads)

    with pytest.raises(ValueError, match="no gradient for them"):  # raised while tracing: nothing compiles
        nnx.jit(update)(view, optimizer)
    # eagerly too, and before anything moves: the refused step leaves model and optimizer as they were
    ones = jax.tree_util.tree_map(jnp.ones_like, nnx.state(view, nnx.Param))  # a step that would move
    before = jax.tree_util.tree_map(np.asarray, (nnx.state(view), nnx.state(optimizer)))
    with pytest.raises(ValueError, match="no gradient for them"):
        optimizer.update(view, ones)
    after = jax.tree_util.tree_map(np.asarray, (nnx.state(view), nnx.state(optimizer)))
    jax.tree_util.tree_map(np.testing.assert_array_equal, after, before)


# ---------------------------------------------------------------------------------------------------------
# A model fp8 reads no weight of: a convolution-only network (Hugging Face FlaxResNet, FlaxRegNet)


class LinenConvNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(8, (3, 3))(x))
        return nn.Conv(4, (3, 3))(x).mean((1, 2))


class NnxConvNet(nnx.Module):
    def __init__(self, rngs):
        self.conv1 = nnx.Conv(3, 8, (3, 3), rngs=rngs)
        self.conv2 = nnx.Conv(8, 4, (3, 3), rngs=rngs)

    def __call__(self, x):
        return self.conv2(nnx.relu(self.conv1(x))).mean((1, 2))


def images(seed):
    x = np.random.default_rng(seed).standard_normal((2, 8, 8, 3), np.float32)
    return jnp.asarray(x), jnp.asarray(np.sin(x[:, 0, 0, :2]).repeat(2, axis=1))


NOTHING_IN_FP8 = r"no contraction of this model reads a weight, so nothing runs in fp8"


@pytest.mark.parametrize("compute", ["bf16", "f16"])
def test_a_convolution_only_model_trains_as_without_fp8_and_says_nothing_runs_in_fp8(compute):
    """Before: Linen's init returned an empty "fp8" collection that its apply refused, autocast's
    update_fp8_state refused the empty states its init_fp8_state returned, and NNX ran silently."""
    policy, (x, y) = policy_of(compute), images(0)
    tx = jmp_lite.loss_scaling(optax.adam(1e-2), jmp_lite.DynamicLossScale(2.0**8))
    key = jax.random.key(0)

    def linen_run(model, variables):
        state = TrainState.create(apply_fn=model.apply, params=variables, tx=tx)
        step = jax.jit(linen_step)
        for _ in range(2):
            state, _ = step(state, x, y)
        return jax.jit(model.apply)(state.params, x), state.params

    plain = jmp_lite.flax.linen.apply_policy(LinenConvNet(), policy)
    want, want_params = linen_run(plain, plain.init(key, x))
    for recipe in (RECIPE, "hybrid,current", "hybrid,block"):
        model = jmp_lite.flax.linen.apply_policy(LinenConvNet(), policy, fp8=recipe)
        with pytest.warns(NoFp8ContractionWarning, match=NOTHING_IN_FP8):
            variables = model.init(key, x)
        assert ("fp8" in variables, variables.get("fp8")) == (
            (True, {}) if recipe == RECIPE else (False, None)
        )
        got, params = linen_run(model, variables)  # apply, TrainState: the program without fp8, bit for bit
        assert bits(got) == bits(want) and bits(params["params"]) == bits(want_params)

    # NNX: the view warns on its first call (it is built before the model runs), once
    def nnx_run(view):
        optimizer = jnnx.LossScaledOptimizer(view, tx)
        for _ in range(2):
            nnx_train_step(view, optimizer, x, y)
        return nnx.state(view.model, nnx.Param)

    want = nnx_run(jnnx.apply_policy(NnxConvNet(nnx.Rngs(0)), policy))
    view = jnnx.apply_policy(NnxConvNet(nnx.Rngs(0)), policy, fp8=RECIPE)
    with pytest.warns(NoFp8ContractionWarning, match=NOTHING_IN_FP8) as caught:
        assert bits(nnx_run(view)) == bits(want)
    assert len([w for w in caught if w.category is NoFp8ContractionWarning]) == 1
    fresh = fp8.init_fp8_state(RECIPE)
    assert all(bits(v.get_value()) == bits(fresh) for v in jax.tree_util.tree_leaves(
        view.fp8_state, is_leaf=lambda v: isinstance(v, jnnx.Fp8Variable)
    ))  # fmt: skip

    # autocast: init_fp8_state finds no weight, and the docs' step runs with the empty states
    f = jmp_lite.autocast(lambda p, x: LinenConvNet().apply(p, x), policy, fp8=RECIPE)
    params = LinenConvNet().init(key, x)
    with pytest.warns(NoFp8ContractionWarning, match=NOTHING_IN_FP8):
        states = f.init_fp8_state(params, x)
    assert states == {}

    @jax.jit
    def autocast_step(params, states, opt_state):
        loss_fn = lambda p, s: jnp.mean((f(p, x, fp8_state=s) - y) ** 2)  # noqa: E731
        _, (grads, observed) = jmp_lite.value_and_grad(loss_fn, argnums=(0, 1))(opt_state, params, states)
        updates, opt_state = tx.update(grads, opt_state, params)
        finite = jmp_lite.get_loss_scaling_state(opt_state).last_grads_finite
        states = fp8.update_fp8_state(states, observed, RECIPE, finite=finite)
        return optax.apply_updates(params, updates), states, opt_state

    new_params, new_states, _ = autocast_step(params, states, tx.init(params))
    assert new_states == {} and bits(new_params) != bits(params)
    assert fp8.accumulate_observed({}, {}) == {}
    with pytest.raises(TypeError, match="found None"):  # no states at all is still refused
        fp8.update_fp8_state(None, None, RECIPE)
