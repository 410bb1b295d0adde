"""A program that checkpoints itself (Flax's ``nn.remat``, ``jax.checkpoint``) under a 16-bit policy: its
own checkpoints decide what its backward pass keeps. JAX lets the outermost checkpoint's policy decide
inside nested ones, so the policy's 16-bit checkpoint used to keep every block's matmul results where the
user asked for the block's input only; and the 16-bit copies of the parameters, made once for the whole
step, were kept as the blocks' inputs. Both are counted here by tracing (``residual_bytes``); the
compiled programs are in test_compiled_targets.py."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from jax.ad_checkpoint import checkpoint_name

from jmp_lite.amp import autocast
from jmp_lite.flax.linen import apply_policy
from jmp_lite.memory import residual_bytes

pytestmark = pytest.mark.unit

WIDTH, HIDDEN, LENGTH, VOCAB, BATCH, LAYERS = 64, 256, 32, 128, 2, 3


class Block(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return x + nn.Dense(WIDTH)(nn.gelu(nn.Dense(HIDDEN)(nn.LayerNorm()(x))))


class Decoder(nn.Module):
    remat: bool

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = nn.Embed(VOCAB, WIDTH)(tokens)
        for _ in range(LAYERS):
            x = (nn.remat(Block) if self.remat else Block)()(x)
        return nn.Dense(VOCAB)(nn.LayerNorm()(x))


TOKENS = jax.random.randint(jax.random.key(0), (BATCH, LENGTH), 0, VOCAB)


def _loss(model: nn.Module):
    return lambda p, t: optax.softmax_cross_entropy_with_integer_labels(
        model.apply({"params": p}, t), t
    ).mean()


def _under_policy(front: str, remat: bool, policy: str):
    model = Decoder(remat)
    if front == "linen":
        return _loss(apply_policy(model, policy))
    return autocast(_loss(model), policy)


PLAIN = Decoder(False).init(jax.random.key(1), TOKENS)["params"]
# the same values under nn.remat's module names
REMAT = {k.replace("Block", "CheckpointBlock"): v for k, v in PLAIN.items()}


@pytest.mark.parametrize("policy", ["p=f32,c=bf16,o=f32", "p=f32,c=f16,o=f32"])
@pytest.mark.parametrize("front", ["linen", "autocast"])
def test_remat_blocks_keep_their_inputs_only_and_no_16_bit_copy_of_the_parameters(front, policy):
    f32 = residual_bytes(_loss(Decoder(True)), REMAT, TOKENS, argnums=0)
    mixed = residual_bytes(_under_policy(front, True, policy), REMAT, TOKENS, argnums=0)
    # nothing of a block's inside is kept: no MLP hidden state, no matmul result of a block
    assert not [r for r in mixed.find() if r.shape[-1:] == (HIDDEN,)], mixed
    # of a block's [batch, length, width] values, only its output (the next block's input), as float32 keeps
    block_0 = [r for r in mixed.find(scope="Decoder/CheckpointBlock_0") if r.shape == (BATCH, LENGTH, WIDTH)]
    assert [r.primitive for r in block_0] == ["add"], block_0
    # no 16-bit copy of a block's weights is kept: they cross into its checkpoint as they came in
    blocks = {(WIDTH, HIDDEN), (HIDDEN, WIDTH), (HIDDEN,)}
    assert not [r for r in mixed.find() if r.shape in blocks], [r.description for r in mixed.find()]
    # never more than float32 with the same checkpoints, but for the 16-bit copy of the output layer's
    # weight, which its backward pass reads outside every checkpoint (as it would read it in bfloat16 JAX)
    head = sum(r.bytes for r in mixed.find() if r.shape == (WIDTH, VOCAB))
    assert mixed.total - head < f32.total


def test_the_users_checkpoint_policy_decides_inside_it_under_the_policy():
    # the user keeps the named hidden state and nothing else of the block: the 16-bit checkpoint neither
    # adds its own choices (the block's matmul results) nor drops the user's
    def block(w1, w2, x):
        h = checkpoint_name(jnp.tanh(x @ w1), "hidden")
        return x + h @ w2

    kept = jax.checkpoint(block, policy=jax.checkpoint_policies.save_only_these_names("hidden"))

    def loss(ws, x):
        for w1, w2 in ws:
            x = kept(w1, w2, x)
        return jnp.mean(x.astype(jnp.float32) ** 2)

    k = jax.random.split(jax.random.key(2), 7)
    ws = [
        (jax.random.normal(k[2 * i], (WIDTH, HIDDEN)), jax.random.normal(k[2 * i + 1], (HIDDEN, WIDTH)))
        for i in range(3)
    ]
    x = jax.random.normal(k[6], (BATCH * LENGTH, WIDTH))
    f32 = residual_bytes(loss, ws, x, argnums=0)
    mixed = residual_bytes(autocast(loss, "p=f32,c=bf16,o=f32"), ws, x, argnums=0)
    # what float32 JAX keeps, value for value: the named hidden states (now 16-bit) and the blocks' inputs
    assert [(r.shape, r.primitive) for r in mixed.find()] == [(r.shape, r.primitive) for r in f32.find()]
    hidden = [r for r in mixed.find() if r.primitive == "name"]
    assert len(hidden) == 3 and {r.dtype for r in hidden} == {"bfloat16"}, mixed
    assert mixed.total < f32.total


@pytest.mark.parametrize("front", ["linen", "autocast"])
def test_remat_blocks_give_the_values_and_gradients_of_the_same_model_without_them(front):
    # within the policy's own rounding: nn.remat rounds each block's input to the compute dtype where it
    # is kept (JAX's reduce_precision on residuals), which XLA may otherwise fuse away
    policy = "p=f32,c=bf16,o=f32"
    loss_r, grads_r = jax.jit(jax.value_and_grad(_under_policy(front, True, policy)))(REMAT, TOKENS)
    loss_p, grads_p = jax.jit(jax.value_and_grad(_under_policy(front, False, policy)))(PLAIN, TOKENS)
    loss_f, grads_f = jax.jit(jax.value_and_grad(_loss(Decoder(False))))(PLAIN, TOKENS)
    assert abs(loss_r - loss_p) <= 2 * abs(loss_p - loss_f) + 1e-6
    grads_r = {k.replace("CheckpointBlock", "Block"): v for k, v in grads_r.items()}
    for a, b, c in zip(jax.tree.leaves(grads_r), jax.tree.leaves(grads_p), jax.tree.leaves(grads_f)):
        assert a.dtype == b.dtype == jnp.float32
        assert float(jnp.max(jnp.abs(a - b))) <= 2 * float(jnp.max(jnp.abs(b - c))) + 1e-6


def test_nnx_remat_blocks_keep_their_inputs_only_under_the_bf16_policy():
    from flax import nnx

    import jmp_lite.flax.nnx as jnnx

    class NnxBlock(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.norm = nnx.LayerNorm(WIDTH, rngs=rngs)
            self.up = nnx.Linear(WIDTH, HIDDEN, rngs=rngs)
            self.down = nnx.Linear(HIDDEN, WIDTH, rngs=rngs)

        def __call__(self, x: jax.Array) -> jax.Array:
            return x + self.down(nnx.gelu(self.up(self.norm(x))))

    class NnxStack(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.blocks = nnx.List([NnxBlock(rngs) for _ in range(LAYERS)])

        def __call__(self, x: jax.Array) -> jax.Array:
            for block in self.blocks:
                x = nnx.remat(lambda b, y: b(y))(block, x)
            return jnp.mean(x.astype(jnp.float32) ** 2)

    x = jax.random.normal(jax.random.key(3), (BATCH, LENGTH, WIDTH))
    kept = {}
    for policy in ("f32", "p=f32,c=bf16,o=f32"):
        view = jnnx.apply_policy(NnxStack(nnx.Rngs(0)), policy)
        graphdef, params = nnx.split(view)
        kept[policy] = residual_bytes(lambda p, x, g=graphdef: nnx.merge(g, p)(x), params, x, argnums=0)
    mixed = kept["p=f32,c=bf16,o=f32"]
    assert not [
        r for r in mixed.find() if r.shape[-1:] == (HIDDEN,) or r.shape in {(WIDTH, HIDDEN), (HIDDEN, WIDTH)}
    ]
    assert mixed.total <= kept["f32"].total, (mixed, kept["f32"])


class ScannedBlock(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array, _: None) -> tuple:
        return Block()(x), None


class ScannedDecoder(nn.Module):
    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = nn.Embed(VOCAB, WIDTH)(tokens)
        stack = nn.scan(
            nn.remat(ScannedBlock), variable_axes={"params": 0}, split_rngs={"params": True}, length=LAYERS
        )
        x, _ = stack()(x, None)
        return nn.Dense(VOCAB)(nn.LayerNorm()(x))


def test_a_scan_of_remat_blocks_keeps_no_16_bit_copy_of_the_stacked_parameters():
    # nn.scan reads the stacked parameters; Linen's front-end cast them once, before the scan, and the
    # checkpoint inside kept each layer's 16-bit slice: 2.4x float32's residuals here
    model = ScannedDecoder()
    params = model.init(jax.random.key(4), TOKENS)["params"]
    f32 = residual_bytes(_loss(model), params, TOKENS, argnums=0)
    mixed = residual_bytes(_loss(apply_policy(model, "p=f32,c=bf16,o=f32")), params, TOKENS, argnums=0)
    stacked = [
        r for r in mixed.find() if r.shape[:1] == (LAYERS,) and r.shape != (LAYERS, BATCH, LENGTH, WIDTH)
    ]
    assert not stacked, [(r.shape, r.dtype) for r in stacked]
    assert mixed.total < f32.total
    loss = jax.jit(_loss(apply_policy(model, "p=f32,c=bf16,o=f32")))(params, TOKENS)
    assert abs(float(loss) - float(_loss(model)(params, TOKENS))) < 0.05
