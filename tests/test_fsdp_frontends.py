"""Sharded training through the front-ends: ``apply_policy(mesh=, fsdp_axis=)`` (Linen and NNX) and
``autocast(mesh=, fsdp_axis=)``. Each parameter moves in the dtype its module's rule reads it in; the
gradients match the unsharded model under the same policy. 8 CPU devices (conftest)."""

from __future__ import annotations

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _jaxpr import eqns
from flax import nnx

import jmp_lite
from jmp_lite._src.tools.collectives import lowered_collectives
from jmp_lite.amp import UnknownPrimitiveWarning
from jmp_lite.distributed import shard_params
from jmp_lite.flax.linen import apply_policy
from jmp_lite.flax.nnx import apply_policy as nnx_apply_policy

pytestmark = pytest.mark.composition

BF16 = "p=f32,c=bf16,o=f32"


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((8,), ("data",))


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x, train=False):
        x = nn.Dense(64)(x)
        x = nn.LayerNorm()(x)
        x = nn.Dropout(0.5, deterministic=not train)(x)
        return nn.Dense(16, name="head")(nn.relu(x))


def data():
    rng = np.random.default_rng(0)
    return jnp.asarray(rng.normal(size=(32, 32)), jnp.float32), jnp.asarray(
        rng.normal(size=(32, 16)), jnp.float32
    )


def max_relative(a, b) -> float:
    return max(
        float(jnp.max(jnp.abs(x - y)) / jnp.max(jnp.abs(y)))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
        if float(jnp.max(jnp.abs(y))) > 0
    )


def linen_grads(model, variables):
    x, y = data()
    return jax.jit(jax.grad(lambda v: jnp.mean((model.apply(v, x) - y) ** 2)))(variables)


@pytest.mark.all_params  # the policy, and a module's own rule: both in CI
@pytest.mark.parametrize("rules, head", [(None, "bf16"), ({"head": "f32"}, "f32")])
def test_linen_gathers_each_kernel_in_its_modules_compute_dtype(mesh, rules, head):
    model = apply_policy(MLP(), BF16, rules, mesh=mesh, fsdp_axis="data")
    x, y = data()
    variables = shard_params(model.init(jax.random.key(0), x), mesh, "data")
    lowered = jax.jit(jax.grad(lambda v: jnp.mean((model.apply(v, x) - y) ** 2))).lower(variables)
    found = lowered_collectives(lowered)
    gathers = sorted((c.shape, c.dtype) for c in found if c.op == "all_gather")
    # Dense_0's kernel (32 x 64, 4 x 64 per device) forward; head's (64 x 16) forward and backward
    assert gathers == [((4, 64), "bf16"), ((8, 16), head), ((8, 16), head)], gathers
    assert {c.dtype for c in found if c.op in ("reduce_scatter", "all_reduce")} == {"f32"}


@pytest.mark.parametrize("rules", [None, {"head": "f32"}])
def test_linen_gradients_match_the_unsharded_model_under_the_same_policy(mesh, rules):
    x, _ = data()
    plain = apply_policy(MLP(), BF16, rules)
    exact = apply_policy(MLP(), "f32")
    sharded = apply_policy(MLP(), BF16, rules, mesh=mesh, fsdp_axis="data")
    variables = plain.init(jax.random.key(0), x)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnknownPrimitiveWarning)  # relu's rule is kept
        grads = linen_grads(sharded, shard_params(variables, mesh, "data"))
    reference, float32 = linen_grads(plain, variables), linen_grads(exact, variables)
    assert max_relative(grads, reference) <= 2 * max_relative(reference, float32) + 1e-3
    specs = jax.tree.map(lambda g: tuple(g.sharding.spec), grads)
    assert specs["params"]["Dense_0"]["kernel"] == ("data", None)


def test_linen_outputs_come_back_sharded_and_dropout_differs_between_devices(mesh):
    x, _ = data()
    model = apply_policy(MLP(), BF16, mesh=mesh, fsdp_axis="data")
    variables = shard_params(model.init(jax.random.key(0), x), mesh, "data")
    same = jnp.tile(x[:4], (8, 1))  # every device's slice holds the same 4 examples
    out = jax.jit(lambda v: model.apply(v, same, train=True, rngs={"dropout": jax.random.key(1)}))(variables)
    assert out.shape == (32, 16) and out.dtype == jnp.float32 and tuple(out.sharding.spec)[0] == "data"
    slices = np.asarray(out).reshape(8, 4, 16)
    assert not np.allclose(slices[0], slices[1])  # each device folds its index into the key
    calm = jax.jit(lambda v: model.apply(v, same))(variables)
    np.testing.assert_allclose(np.asarray(calm).reshape(8, 4, 16)[0], np.asarray(calm).reshape(8, 4, 16)[7])


def test_sharded_options_are_checked(mesh):
    with pytest.raises(ValueError, match="both mesh= .* and fsdp_axis="):
        apply_policy(MLP(), BF16, mesh=mesh)
    with pytest.raises(ValueError, match="axis 'model' is not an axis of the mesh"):
        apply_policy(MLP(), BF16, mesh=mesh, fsdp_axis="model")
    with pytest.raises(ValueError, match="reduce_dtype is an option of sharded training"):
        apply_policy(MLP(), BF16, reduce_dtype="bfloat16")
    with pytest.raises(ValueError, match="reduce_scatter='all'; it is one of"):
        apply_policy(MLP(), BF16, mesh=mesh, fsdp_axis="data", reduce_scatter="all")
    with pytest.raises(ValueError, match="delayed fp8 scaling"):
        apply_policy(MLP(), BF16, fp8="hybrid,delayed", mesh=mesh, fsdp_axis="data")
    with pytest.raises(ValueError, match="delayed fp8 scaling"):
        jmp_lite.autocast(lambda p, x: x, BF16, fp8="hybrid,delayed", mesh=mesh, fsdp_axis="data")
    x, _ = data()
    model = apply_policy(MLP(), BF16, mesh=mesh, fsdp_axis="data")
    variables = model.init(jax.random.key(0), x)
    with pytest.raises(ValueError, match=r"mutable=\.\.\.\) is not supported in sharded training"):
        model.apply(variables, x, mutable=["intermediates"])
    with pytest.raises(ValueError, match=r"keyword arguments \['mask'\] hold arrays"):
        model.apply(variables, x, mask=jnp.ones(3))


def test_autocast_shards_like_fsdp(mesh):
    def loss(p, x, y):
        h = jnp.tanh(x @ p["w1"])
        with jmp_lite.float32_region():
            out = h @ p["w2"]
        return jnp.mean((out - y) ** 2)

    rng = np.random.default_rng(2)
    params = {
        "w1": jnp.asarray(rng.normal(size=(32, 64)) * 0.2, jnp.float32),
        "w2": jnp.asarray(rng.normal(size=(64, 16)) * 0.2, jnp.float32),
    }
    x, y = data()
    sharded = jmp_lite.autocast(loss, BF16, mesh=mesh, fsdp_axis="data", reduce_dtype="bfloat16")
    found = lowered_collectives(jax.jit(jax.grad(sharded)).lower(shard_params(params, mesh, "data"), x, y))
    assert sorted((c.shape, c.dtype) for c in found if c.op == "all_gather") == [
        ((4, 64), "bf16"),
        ((8, 16), "f32"),  # read in a float32 region: gathered in float32
        ((8, 16), "f32"),
    ]
    assert {c.dtype for c in found if c.op == "reduce_scatter"} == {"bf16"}
    decorated = jmp_lite.autocast(BF16, mesh=mesh, fsdp_axis="data")(loss)
    unsharded = jax.grad(jmp_lite.autocast(loss, BF16))(params, x, y)
    grads = jax.jit(jax.grad(decorated))(shard_params(params, mesh, "data"), x, y)
    with pytest.warns(UserWarning, match="outside jmp_lite.autocast"):  # the plain float32 program
        exact = jax.grad(loss)(params, x, y)
    assert max_relative(grads, unsharded) <= 2 * max_relative(unsharded, exact) + 1e-3


@pytest.mark.parametrize("recipe", ["hybrid,current", "hybrid,block"])
def test_fp8_under_fsdp_scales_each_devices_slice_of_the_batch_on_its_own(mesh, recipe):
    """Current and block scaling take their amaxes from the values a device holds, as data-parallel
    fp8 training does: the sharded step is the mean of the unsharded fp8 step on each device's 4 rows
    (up to float32 summation order). One amax over the whole batch would move values by fp8 steps."""

    def loss(p, x, y):
        return jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] - y) ** 2)

    rng = np.random.default_rng(3)
    params = {
        "w1": jnp.asarray(rng.normal(size=(32, 64)) * 0.2, jnp.float32),
        "w2": jnp.asarray(rng.normal(size=(64, 16)) * 0.2, jnp.float32),
    }
    x, y = data()
    x = x * jnp.exp2(jnp.arange(32.0) % 8)[:, None]  # the devices' slices span different ranges
    sharded = jmp_lite.autocast(loss, BF16, fp8=recipe, mesh=mesh, fsdp_axis="data")
    value, grads = jax.jit(jax.value_and_grad(sharded))(shard_params(params, mesh, "data"), x, y)
    one = jax.jit(jax.value_and_grad(jmp_lite.autocast(loss, BF16, fp8=recipe)))
    slices = [one(params, x[i * 4 : (i + 1) * 4], y[i * 4 : (i + 1) * 4]) for i in range(8)]
    np.testing.assert_allclose(float(value), np.mean([float(v) for v, _ in slices]), rtol=1e-6)
    mean = jax.tree.map(lambda *g: sum(g) / 8, *(g for _, g in slices))
    assert max_relative(grads, mean) < 1e-5
    whole_value, whole_grads = one(params, x, y)  # the batch in one piece: other amaxes
    assert max_relative(whole_grads, grads) > 1e-3
    if recipe == "hybrid,block":  # the forward's tiles run along K within a row: the same loss
        np.testing.assert_allclose(float(whole_value), float(value), rtol=1e-6)
    else:
        assert abs(float(whole_value) - float(value)) > 1e-4 * float(value)


def test_eager_grad_runs_under_jax_set_mesh_or_on_a_mesh_with_automatic_axes(mesh):
    """JAX types a value sharded on a mesh with explicit axes by that mesh, and an eager ``jax.grad``
    outside ``jax.set_mesh`` cannot place its cotangent: JAX's own rule, not the step's. Under
    ``jax.set_mesh``, and on a mesh with automatic axes, eager gradients equal the jitted ones."""

    def loss(p, x, y):
        return jnp.mean((jnp.tanh(x @ p["w"]) - y) ** 2)

    params = {"w": jnp.asarray(np.random.default_rng(4).normal(size=(32, 16)) * 0.2, jnp.float32)}
    x, y = data()
    step = jmp_lite.autocast(loss, BF16, mesh=mesh, fsdp_axis="data")
    sharded = shard_params(params, mesh, "data")
    jitted = jax.jit(jax.grad(step))(sharded, x, y)
    with pytest.raises(ValueError, match="jax.set_mesh"):
        jax.grad(step)(sharded, x, y)
    with jax.set_mesh(mesh):
        eager = jax.grad(step)(sharded, x, y)
    assert max_relative(eager, jitted) < 1e-6
    auto = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    step = jmp_lite.autocast(loss, BF16, mesh=auto, fsdp_axis="data")
    eager = jax.device_get(jax.grad(step)(shard_params(params, auto, "data"), x, y))
    assert max_relative(eager, jax.device_get(jitted)) < 1e-6


class NnxMLP(nnx.Module):
    def __init__(self, rngs, norm=None):
        self.l1 = nnx.Linear(32, 64, rngs=rngs)
        self.norm = norm or nnx.LayerNorm(64, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.head = nnx.Linear(64, 16, rngs=rngs)

    def __call__(self, x):
        return self.head(jax.nn.relu(self.drop(self.norm(self.l1(x)))))


def sharded_view(mesh, rules=None, model=None):
    model = model or NnxMLP(nnx.Rngs(0))
    nnx.update(model, shard_params(nnx.state(model), mesh, "data"))
    return model, nnx_apply_policy(model, BF16, rules, mesh=mesh, fsdp_axis="data")


def nnx_loss(view):
    x, y = data()
    return jnp.mean((view(x) - y) ** 2)


@pytest.mark.all_params  # the policy, and a module's own rule: both in CI
@pytest.mark.parametrize("rules, head", [(None, "bf16"), ({"head": "f32"}, "f32")])
def test_nnx_gathers_each_kernel_in_its_modules_compute_dtype(mesh, rules, head):
    model, view = sharded_view(mesh, rules)
    model.eval()
    graphdef, params, rest = nnx.split(view, nnx.Param, ...)
    lowered = jax.jit(jax.grad(lambda p, r: nnx_loss(nnx.merge(graphdef, p, r)))).lower(params, rest)
    found = lowered_collectives(lowered)
    gathers = sorted((c.shape, c.dtype) for c in found if c.op == "all_gather")
    assert gathers == [((4, 64), "bf16"), ((8, 16), head), ((8, 16), head)], gathers
    assert {c.dtype for c in found if c.op in ("reduce_scatter", "all_reduce")} == {"f32"}


def test_linen_and_nnx_reduce_scatter_on_a_ring_when_asked_with_the_collectives_gradients(mesh):
    x, y = data()
    linen = {
        how: apply_policy(MLP(), BF16, mesh=mesh, fsdp_axis="data", reduce_scatter=how)
        for how in ("collective", "ring")
    }
    variables = shard_params(linen["ring"].init(jax.random.key(0), x), mesh, "data")
    grads = {how: linen_grads(model, variables) for how, model in linen.items()}
    assert max_relative(grads["ring"], grads["collective"]) < 1e-6
    lowered = jax.jit(jax.grad(lambda v: jnp.mean((linen["ring"].apply(v, x) - y) ** 2))).lower(variables)
    assert {c.op for c in lowered_collectives(lowered)} == {"all_gather", "all_reduce", "collective_permute"}
    model = NnxMLP(nnx.Rngs(0))
    model.eval()
    nnx.update(model, shard_params(nnx.state(model), mesh, "data"))
    view = nnx_apply_policy(model, BF16, mesh=mesh, fsdp_axis="data", reduce_scatter="ring")
    graphdef, params, rest = nnx.split(view, nnx.Param, ...)
    lowered = jax.jit(jax.grad(lambda p, r: nnx_loss(nnx.merge(graphdef, p, r)))).lower(params, rest)
    assert {c.op for c in lowered_collectives(lowered)} == {"all_gather", "all_reduce", "collective_permute"}


def test_nnx_gradients_match_the_unsharded_model_and_rng_counts_are_written_back(mesh):
    rules = {"head": "f32"}
    model, view = sharded_view(mesh, rules)
    model.eval()
    reference_model = NnxMLP(nnx.Rngs(0))
    reference_model.eval()
    plain = nnx_apply_policy(reference_model, BF16, rules)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnknownPrimitiveWarning)
        grads = nnx.jit(nnx.grad(nnx_loss))(view)
    reference = nnx.grad(nnx_loss)(plain)
    exact = nnx.grad(nnx_loss)(nnx_apply_policy(reference_model, "f32"))
    assert max_relative(grads, reference) <= 2 * max_relative(reference, exact) + 1e-3
    # the f32-ruled head is gathered in float32: its gradient is float32's to the order of sums
    head = nnx.state(grads, nnx.Param)["model"]["head"]["kernel"]
    ref_head = nnx.state(reference, nnx.Param)["model"]["head"]["kernel"]
    assert float(jnp.max(jnp.abs(head.get_value() - ref_head.get_value()))) < 1e-5
    model.train()
    count = lambda: int(model.drop.rngs.count.get_value())  # noqa: E731
    before = count()
    out = view(jnp.tile(data()[0][:4], (8, 1)))
    assert out.shape == (32, 16) and tuple(out.sharding.spec)[0] == "data"
    assert count() == before + 1  # the dropout's RNG count advanced once, on every device alike
    slices = np.asarray(out).reshape(8, 4, 16)
    assert not np.allclose(slices[0], slices[1])  # each device draws its own mask


def test_nnx_batch_statistics_in_training_are_refused(mesh):
    rngs = nnx.Rngs(0)
    _, view = sharded_view(mesh, model=NnxMLP(rngs, norm=nnx.BatchNorm(64, rngs=rngs)))
    with pytest.raises(ValueError, match="updates state that differs between devices"):
        view(data()[0])
    with pytest.raises(ValueError, match=r"keyword arguments \['mask'\] hold arrays"):
        view(data()[0], mask=jnp.ones(3))


class Lookup(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        return nn.Dense(8)(nn.Embed(64, 32)(tokens))


def test_an_embedding_read_in_bf16_and_widened_moves_in_bf16_and_keeps_its_rounding(mesh):
    # the engine reads a module's parameter in bf16 and widens an embedding table to float32 for the
    # lookup (so that the lookup's gradient sums in float32): the table moves in bf16, rounded as the
    # unsharded program rounds it, and the backward keeps no gathered table (8 x 64 x 32 elements)
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, 64, (16, 4)), jnp.int32)
    plain = apply_policy(Lookup(), BF16)
    sharded = apply_policy(Lookup(), BF16, mesh=mesh, fsdp_axis="data")
    variables = plain.init(jax.random.key(0), tokens)

    def loss(model):
        return lambda v: jnp.mean(jnp.tanh(model.apply(v, tokens)) ** 2)

    placed = shard_params(variables, mesh, "data")
    found = lowered_collectives(jax.jit(jax.grad(loss(sharded))).lower(placed))
    assert {(c.shape, c.dtype) for c in found if c.op == "all_gather"} == {
        ((8, 32), "bf16"),
        ((4, 8), "bf16"),
    }
    _, backward = jax.vjp(jax.jit(loss(sharded)), placed)
    assert all(r.size < 8 * 64 * 32 for r in jax.tree.leaves(backward) if hasattr(r, "size"))
    np.testing.assert_allclose(jax.jit(loss(sharded))(placed), loss(plain)(variables), rtol=2e-6)
    reference = jax.grad(loss(plain))(variables)
    exact = jax.grad(loss(apply_policy(Lookup(), "f32")))(variables)
    assert (
        max_relative(jax.jit(jax.grad(loss(sharded)))(placed), reference)
        <= 2 * max_relative(reference, exact) + 1e-3
    )


class Tied(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        embed = nn.Embed(64, 32)
        return embed.attend(nn.Dense(32)(embed(tokens)))  # the output layer reads the table transposed


@pytest.mark.all_params  # each parametrization in CI
@pytest.mark.parametrize("policy", ["f32", BF16])
def test_a_parameter_read_transposed_is_not_kept_for_the_backward_either(mesh, policy):
    tokens = jnp.asarray(np.random.default_rng(4).integers(0, 64, (16, 4)), jnp.int32)
    model = apply_policy(Tied(), policy, mesh=mesh, fsdp_axis="data")
    variables = shard_params(model.init(jax.random.key(0), tokens), mesh, "data")
    _, backward = jax.vjp(jax.jit(lambda v: model.apply(v, tokens).astype(jnp.float32).mean()), variables)
    kept = [r.addressable_shards[0].data.shape for r in jax.tree.leaves(backward) if isinstance(r, jax.Array)]
    # the table is 64 x 32 (8 x 32 per device) and the Dense kernel 32 x 32 (4 x 32): only shards are kept
    assert not {(64, 32), (32, 64), (32, 32)} & {tuple(s) for s in kept}, kept


@pytest.mark.parametrize("front_end", ["autocast", "linen"])
def test_causal_attention_under_fsdp_runs_the_attention_kernel_and_matches_the_unsharded_model(
    mesh, front_end
):
    """Inside FSDP's ``shard_map`` the causal mask is typed per device; the attention rewrite still takes
    the chain (it ran as written before: a float32 [T, T] softmax per layer) and its loops keep their
    carries' per-device types. T = 512: the kernel loops over several key blocks."""
    from jmp_lite._demo.gpt import gpt_model, next_token_loss

    model = gpt_model(layers=1, width=64, heads=4, context=512, vocab=128)
    tokens = jax.random.randint(jax.random.key(3), (8, 513), 0, 128)
    params = model.init(jax.random.key(0), tokens[:, :-1])["params"]
    if front_end == "autocast":
        loss = next_token_loss(model)
        sharded = jmp_lite.autocast(loss, BF16, mesh=mesh, fsdp_axis="data")
        unsharded = jmp_lite.autocast(loss, BF16)
    else:
        sharded = next_token_loss(apply_policy(model, BF16, mesh=mesh, fsdp_axis="data"))
        unsharded = next_token_loss(apply_policy(model, BF16))
    placed = shard_params(params, mesh, "data")
    program = jax.make_jaxpr(jax.grad(sharded))(placed, tokens)
    softmaxes = [e.outvars[0].aval.shape for e in eqns(program.jaxpr) if e.primitive.name == "exp"]
    assert not [s for s in softmaxes if s[-2:] == (512, 512)], "a T x T softmax is left"
    grads = jax.jit(jax.grad(sharded))(placed, tokens)
    reference = jax.jit(jax.grad(unsharded))(params, tokens)
    exact = jax.jit(jax.grad(next_token_loss(model)))(params, tokens)
    assert max_relative(grads, reference) <= 2 * max_relative(reference, exact) + 1e-3
