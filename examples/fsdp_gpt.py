"""Fully sharded (FSDP) training of a small GPT-style decoder, with 16 bits on the wire.

A Flax Linen decoder (byte vocabulary, pre-norm blocks, causal self-attention) trained with Adam on
the bytes of Python's standard-library sources, its float32 parameters sharded over every device
(8 virtual CPU devices unless XLA_FLAGS says otherwise) with
``jmp_lite.flax.linen.apply_policy(model, policy, mesh=mesh, fsdp_axis="data")``. Each kernel is
all-gathered just before its layer runs, in the dtype its module computes in (bfloat16 under the
bf16 policy, float32 for the LayerNorms a float32 rule keeps), and each gradient comes back
reduce-scattered in float32, so Adam updates 1/8 of the state on each device.

For float32 and bf16 the script prints the bytes each step all-gathers and reduce-scatters (read from
the program JAX hands the compiler) and the training loss.

    python examples/fsdp_gpt.py --steps 60
"""

from __future__ import annotations

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import argparse  # noqa: E402

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jmp_lite  # noqa: E402
from jmp_lite._demo.corpus import stdlib_bytes  # noqa: E402
from jmp_lite._src.tools.collectives import lowered_collectives  # noqa: E402
from jmp_lite.distributed import fsdp_layout, shard_params  # noqa: E402
from jmp_lite.flax.linen import apply_policy  # noqa: E402


class Block(nn.Module):
    width: int
    heads: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
        x = x + nn.MultiHeadDotProductAttention(self.heads)(nn.LayerNorm()(x), mask=mask)
        h = nn.gelu(nn.Dense(4 * self.width)(nn.LayerNorm()(x)))
        return x + nn.Dense(self.width)(h)


class Decoder(nn.Module):
    layers: int = 2
    width: int = 128
    heads: int = 4
    context: int = 64

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = nn.Embed(256, self.width)(tokens)
        x = x + self.param("position", nn.initializers.normal(0.02), (self.context, self.width))
        for _ in range(self.layers):
            x = Block(self.width, self.heads)(x)
        return nn.Dense(256, name="head")(nn.LayerNorm()(x))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=16, help="global batch (a multiple of the devices)")
    args = parser.parse_args()

    n = jax.device_count()
    mesh = jax.make_mesh((n,), ("data",))
    module = Decoder()
    text = stdlib_bytes(400_000)
    rng = np.random.default_rng(0)
    starts = rng.integers(0, len(text) - module.context - 1, size=(args.steps, args.batch))
    batches = np.stack([[text[s : s + module.context + 1] for s in row] for row in starts]).astype(np.int32)

    init = apply_policy(module, "f32").init(jax.random.key(0), jnp.asarray(batches[0, :, :-1]))
    layout = fsdp_layout(init["params"], mesh, "data")
    lays = jax.tree.leaves(layout, is_leaf=lambda x: isinstance(x, jmp_lite.distributed.FsdpLayout))
    reasons = sorted({lay.why for lay in lays if lay.dim is None})
    count = sum(x.size for x in jax.tree.leaves(init)) / 1e6
    print(
        f"decoder: {count:.2f}M parameters, {sum(lay.dim is not None for lay in lays)} of {len(lays)} "
        f"sharded over {n} {jax.devices()[0].platform} devices; replicated: {', '.join(reasons)}"
    )

    tx = optax.adam(1e-3)
    for name, policy in (("float32", "f32"), ("bf16", "p=f32,c=bf16,o=f32")):
        model = apply_policy(module, policy, mesh=mesh, fsdp_axis="data")

        def loss(params: dict, tokens: jax.Array, model=model) -> jax.Array:
            logits = model.apply({"params": params}, tokens[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

        @jax.jit
        def step(params: dict, opt_state: optax.OptState, tokens: jax.Array, loss=loss) -> tuple:
            value, grads = jax.value_and_grad(loss)(params, tokens)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, value

        params = shard_params(init["params"], mesh, "data")
        opt_state = tx.init(params)
        found = lowered_collectives(step.lower(params, opt_state, jnp.asarray(batches[0])))
        moved = {}
        for c in found:
            total, dtypes = moved.get(c.op, (0, set()))
            moved[c.op] = (total + c.bytes, dtypes | {c.dtype})
        per_op = [f"{op} {t / 1e6:.3f} MB ({','.join(sorted(d))})" for op, (t, d) in sorted(moved.items())]
        print(f"\n{name} ({policy}): per step and device, " + "; ".join(per_op))
        for i in range(args.steps):
            params, opt_state, value = step(params, opt_state, jnp.asarray(batches[i]))
            if i % max(1, args.steps // 6) == 0 or i == args.steps - 1:
                print(f"  step {i:4d}  loss {float(value):.4f}")
        kernel = params["Block_0"]["Dense_0"]["kernel"]
        print(f"  a kernel after training: {kernel.dtype}, sharded as {kernel.sharding.spec}")


if __name__ == "__main__":
    main()
