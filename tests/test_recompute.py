"""``recompute="wide_contractions"``: under the 16-bit checkpoint, a contraction whose result is wider than
its operands (an MLP's up-projection) is run again in the backward pass, with the elementwise math that
reads it, instead of kept. Counted here by tracing (``residual_bytes``) and from the program the engine
emits; what the compiler makes of it (one layer's hidden state rebuilt at a time) is in
test_compiled_targets.py."""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jmp_lite
import jmp_lite.flax.nnx as jnnx
from jmp_lite.amp import autocast
from jmp_lite.flax.linen import apply_policy
from jmp_lite.memory import residual_bytes

pytestmark = pytest.mark.unit

WIDTH, HIDDEN, LENGTH, VOCAB, BATCH, LAYERS = 32, 128, 64, 48, 4, 2
BF16, F16 = "p=f32,c=bf16,o=f32", "p=f32,c=f16,o=f32"
WIDE = "wide_contractions"


class Block(nn.Module):
    gated: bool = False

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        y = nn.LayerNorm()(x)
        h = nn.gelu(nn.Dense(HIDDEN)(y))
        if self.gated:  # a gated MLP (Llama's): two wide projections meet in the elementwise math
            h = h * nn.Dense(HIDDEN)(y)
        return x + nn.Dense(WIDTH)(h)


class Decoder(nn.Module):
    gated: bool = False

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = nn.Embed(VOCAB, WIDTH)(tokens)
        for _ in range(LAYERS):
            x = Block(self.gated)(x)
        return nn.Dense(VOCAB)(nn.LayerNorm()(x))


TOKENS = jax.random.randint(jax.random.key(0), (BATCH, LENGTH), 0, VOCAB)


def _loss(apply):
    return lambda p, t: optax.softmax_cross_entropy_with_integer_labels(apply({"params": p}, t), t).mean()


def _front(front: str, policy: str, gated: bool = False, **options):
    model = Decoder(gated)
    if front == "linen":
        return _loss(apply_policy(model, policy, **options).apply)
    return autocast(_loss(model.apply), policy, **options)


PARAMS = Decoder().init(jax.random.key(1), TOKENS)["params"]
GATED = Decoder(True).init(jax.random.key(1), TOKENS)["params"]


def _hidden(kept) -> list:
    return [r for r in kept.find() if r.shape[-1:] == (HIDDEN,) and r.shape != (WIDTH, HIDDEN)]


@pytest.mark.parametrize("policy", [BF16, F16])
@pytest.mark.parametrize("front", ["linen", "autocast"])
def test_the_mlp_hidden_state_is_rebuilt_not_kept(front, policy):
    kept = residual_bytes(_front(front, policy), PARAMS, TOKENS, argnums=0)
    lean = residual_bytes(_front(front, policy, recompute=WIDE), PARAMS, TOKENS, argnums=0)
    assert len(_hidden(kept)) == LAYERS, kept  # each layer's 16-bit hidden state, kept by default
    assert not _hidden(lean), [r.description for r in _hidden(lean)]
    hidden_bytes = LAYERS * BATCH * LENGTH * HIDDEN * 2
    assert lean.total == kept.total - hidden_bytes
    # the logits are wider than their operands too, but the loss's reductions read them: kept
    assert [r.shape for r in lean.find() if r.shape[-1:] == (VOCAB,) and len(r.shape) == 3] == [
        (BATCH, LENGTH, VOCAB)
    ]


def test_a_gated_mlp_rebuilds_both_of_its_wide_projections():
    kept = residual_bytes(_front("linen", BF16, gated=True), GATED, TOKENS, argnums=0)
    lean = residual_bytes(_front("linen", BF16, gated=True, recompute=WIDE), GATED, TOKENS, argnums=0)
    assert len(_hidden(kept)) == 2 * LAYERS, kept
    assert not _hidden(lean), [r.description for r in _hidden(lean)]


@pytest.mark.parametrize("policy", [BF16, F16])
@pytest.mark.parametrize("front", ["linen", "autocast"])
def test_values_and_gradients_are_those_of_the_kept_program_under_jit(front, policy):
    step = lambda **o: jax.jit(jax.value_and_grad(_front(front, policy, **o)))  # noqa: E731
    loss_k, grads_k = step()(PARAMS, TOKENS)
    loss_r, grads_r = step(recompute=WIDE)(PARAMS, TOKENS)
    # the same operations on the same values: rebuilt in the backward pass, they round as the forward did
    assert loss_r == loss_k
    for a, b in zip(jax.tree.leaves(grads_r), jax.tree.leaves(grads_k)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_each_region_is_a_checkpoint_of_its_own_in_the_backward_pass():
    # one per layer: its backward pass waits for the layer's cotangent, so the compiler cannot rebuild
    # every layer's hidden state at the start of the backward pass
    def checkpoints(**options) -> int:
        program = jax.make_jaxpr(jax.grad(_front("autocast", BF16, **options)))(PARAMS, TOKENS)
        return str(program).count("remat2[")

    assert checkpoints() == 1  # the 16-bit checkpoint itself
    assert checkpoints(recompute=WIDE) > 1 + LAYERS  # its regions, in the forward and backward pass


def test_nnx_rebuilds_the_hidden_state_too():
    class Mlp(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.up = nnx.Linear(WIDTH, HIDDEN, rngs=rngs)
            self.down = nnx.Linear(HIDDEN, WIDTH, rngs=rngs)

        def __call__(self, x: jax.Array) -> jax.Array:
            return x + self.down(nnx.gelu(self.up(x)))

    x = jax.random.normal(jax.random.key(3), (BATCH, LENGTH, WIDTH))

    def measured(view):
        graph, state = nnx.split(view)
        return residual_bytes(lambda s: jnp.sum(nnx.merge(graph, s)(x) ** 2), state)

    model = Mlp(nnx.Rngs(0))
    kept, lean = (measured(jnnx.apply_policy(model, BF16, recompute=r)) for r in (None, WIDE))
    assert _hidden(kept) and not _hidden(lean), (kept, lean)
    views = [jnnx.apply_policy(model, BF16, recompute=r) for r in (None, WIDE)]
    grads = [nnx.grad(lambda v: jnp.sum(v(x) ** 2))(view) for view in views]
    for a, b in zip(jax.tree.leaves(grads[0]), jax.tree.leaves(grads[1])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_layers_under_scan_rebuild_inside_each_iteration():
    class Scanned(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            body = nn.scan(
                lambda m, c, _: (Block()(c), None),
                variable_axes={"params": 0},
                split_rngs={"params": True},
                length=LAYERS,
            )
            return body(self, x, None)[0]

    x = jax.random.normal(jax.random.key(4), (BATCH, LENGTH, WIDTH))
    model = Scanned()
    params = model.init(jax.random.key(5), x)["params"]

    def loss(**o):
        applied = apply_policy(model, BF16, **o)
        return lambda p: jnp.mean(applied.apply({"params": p}, x) ** 2)

    kept = residual_bytes(loss(), params)
    lean = residual_bytes(loss(recompute=WIDE), params)
    stacked = [r for r in kept.find() if r.shape == (LAYERS, BATCH, LENGTH, HIDDEN)]
    assert stacked and not [r for r in lean.find() if r.shape[-1:] == (HIDDEN,) and r.shape[1:2] == (BATCH,)]
    grads = [jax.jit(jax.grad(loss(**o)))(params) for o in ({}, {"recompute": WIDE})]
    for a, b in zip(jax.tree.leaves(grads[0]), jax.tree.leaves(grads[1])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_fp8_contractions_are_kept_as_their_recipe_keeps_them():
    # an fp8 contraction's scaling lives in its own derivative: recompute leaves it alone
    fp8 = "hybrid,current"
    kept = residual_bytes(_front("linen", BF16, fp8=fp8), PARAMS, TOKENS, argnums=0)
    lean = residual_bytes(_front("linen", BF16, fp8=fp8, recompute=WIDE), PARAMS, TOKENS, argnums=0)
    assert lean.total == kept.total


def test_explain_names_each_rebuilt_contraction():
    x = jnp.ones((BATCH * LENGTH, WIDTH))
    w1, w2 = jnp.ones((WIDTH, HIDDEN)), jnp.ones((HIDDEN, WIDTH))

    def f(x, w1, w2):
        return jnp.sum(jax.nn.relu(x @ w1) @ w2)

    e = jmp_lite.explain(f, BF16, recompute=WIDE)(x, w1, w2)
    reasons = [ev.reason for ev in e.find(primitive="dot_general")]
    assert len(reasons) == 2 and "rebuilt in the backward pass" in reasons[0], reasons
    assert "rebuilt" not in reasons[1], reasons  # the down-projection's result is kept


def test_a_program_with_its_own_checkpoints_is_told_recompute_changes_nothing():
    def f(w1, w2, x):
        block = jax.checkpoint(lambda x: jax.nn.relu(x @ w1) @ w2)
        return jnp.sum(block(x) ** 2)

    x, w1, w2 = jnp.ones((64, WIDTH)), jnp.ones((WIDTH, HIDDEN)), jnp.ones((HIDDEN, WIDTH))
    plain = jax.grad(autocast(f, BF16))(w1, w2, x)
    with pytest.warns(UserWarning, match="recompute='wide_contractions' has no effect on this program"):
        asked = jax.grad(autocast(f, BF16, recompute=WIDE))(w1, w2, x)
    np.testing.assert_array_equal(np.asarray(plain), np.asarray(asked))


@pytest.mark.parametrize("front", ["autocast", "linen", "nnx"])
def test_bad_recompute_values_are_refused_with_what_is_accepted(front):
    def make(policy, **options):
        if front == "autocast":
            return autocast(lambda x: x, policy, **options)
        if front == "linen":
            return apply_policy(nn.Dense(2), policy, **options)
        return jnnx.apply_policy(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), policy, **options)

    with pytest.raises(ValueError, match=r"recompute must be one of None, 'wide_contractions'; got 'mlp'"):
        make(BF16, recompute="mlp")
    with pytest.raises(ValueError, match=r"recompute='wide_contractions' rebuilds 16-bit values .* float32"):
        make("p=f32,c=f32,o=f32", recompute=WIDE)
    with pytest.raises(ValueError, match="remat_float32=False switches off"):
        make(BF16, recompute=WIDE, remat_float32=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        make(F16, recompute=WIDE)  # accepted


@pytest.mark.parametrize(
    "activation",
    [jax.nn.relu, jax.nn.silu, lambda h: jax.nn.gelu(h, approximate=False), jax.nn.leaky_relu, jax.nn.elu],
    ids=["relu", "silu", "exact_gelu", "leaky_relu", "elu"],
)
def test_common_activations_are_rebuilt_with_their_matmul(activation):
    # comparisons (leaky_relu, elu), erfc (exact gelu) and custom_jvp calls (relu) are elementwise math
    def mlp(w1, w2, x):
        return jnp.sum(activation(x @ w1) @ w2)

    w1, w2, x = jnp.ones((WIDTH, HIDDEN)) / 8, jnp.ones((HIDDEN, WIDTH)) / 8, jnp.ones((256, WIDTH))
    kept = residual_bytes(autocast(mlp, BF16, recompute=WIDE), w1, w2, x, argnums=(0, 1))
    assert not [r for r in kept.find() if r.shape == (256, HIDDEN)], [r.description for r in kept.find()]


def test_a_wide_contraction_run_as_written_is_still_kept():
    # operands of two 16-bit dtypes: the contraction runs as written, outside any rule, and no region
    # rebuilds it (a reduction reads it too); it must stay kept, not be rebuilt for every layer at once
    def f(w1, w2, x):
        h = jax.lax.dot_general(
            x.astype(jnp.bfloat16), w1.astype(jnp.float16), (((1,), (0,)), ((), ())),
            preferred_element_type=jnp.bfloat16,
        )  # fmt: skip
        return jnp.sum(jnp.tanh(h).astype(jnp.float32) @ w2) + jnp.sum(jnp.max(h, 1).astype(jnp.float32))

    w1, w2, x = jnp.ones((WIDTH, HIDDEN)), jnp.ones((HIDDEN, WIDTH)), jnp.ones((256, WIDTH))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the mixed-dtype contraction's round trip is reported elsewhere
        for r in (None, WIDE):
            kept = residual_bytes(autocast(f, BF16, recompute=r), w1, w2, x, argnums=(0, 1))
            assert [x.dtype for x in kept.find() if x.shape == (256, HIDDEN)] == ["bfloat16"], (r, kept)


def test_explain_refuses_recompute_where_the_front_ends_do():
    with pytest.raises(ValueError, match="computes in float32"):
        jmp_lite.explain(lambda x: x, "p=f32,c=f32,o=f32", recompute=WIDE)
    with pytest.raises(ValueError, match="remat_float32=False switches off"):
        jmp_lite.explain(lambda x: x, BF16, recompute=WIDE, remat_float32=False)
