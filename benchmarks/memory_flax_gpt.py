"""Residual bytes of a stock Flax Linen GPT under the bf16 policy, with the attention kernel.

A decoder written the way Flax's own examples write one: pre-LayerNorm blocks of ``nn.SelfAttention`` with
a causal mask from ``nn.make_causal_mask`` (Flax fills masked logits with ``finfo.min``), a GELU MLP,
learned positions and a tied embedding; GPT-2-small widths (d=768, 12 heads) at T=512, with fewer layers
by default. Under ``jmp_lite.flax.linen.apply_policy(model, "p=f32,c=bf16,o=f32")`` the engine runs each
attention as the blockwise kernel, with the fill as Flax wrote it (``mask_value``), so that no T x T
array is kept for the backward pass.

The bytes the backward pass keeps are counted by tracing (``jmp_lite.memory.residual_bytes`` of the
loss's gradient with respect to the parameters, abstract inputs: nothing is compiled or allocated) for
the float32 model, the bf16 policy, and the bf16 policy with ``attention=False`` (the chain as written,
its T x T weights kept). The count does not depend on the machine.

    python benchmarks/memory_flax_gpt.py
    python benchmarks/memory_flax_gpt.py --layers 12 --batch 16   # GPT-2 small, whole
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.extend import core as jcore

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _timing  # noqa: E402

import jmp_lite  # noqa: E402
from jmp_lite.flax.linen import apply_policy  # noqa: E402

POLICY = "p=f32,c=bf16,o=f32"


class Block(nn.Module):
    heads: int

    @nn.compact
    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        x = x + nn.SelfAttention(num_heads=self.heads, deterministic=True)(nn.LayerNorm()(x), mask=mask)
        width = x.shape[-1]
        return x + nn.Dense(width)(nn.gelu(nn.Dense(4 * width)(nn.LayerNorm()(x))))


class GPT(nn.Module):
    layers: int
    width: int
    heads: int
    context: int
    vocab: int = 50257

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        embed = nn.Embed(self.vocab, self.width)
        pos = self.param("pos", nn.initializers.normal(0.02), (self.context, self.width))
        x = embed(tokens) + pos[: tokens.shape[1]]
        mask = nn.make_causal_mask(tokens)
        for _ in range(self.layers):
            x = Block(self.heads)(x, mask)
        return embed.attend(nn.LayerNorm()(x))


def kernel_calls(jaxpr: Any) -> int:
    """Calls of the blockwise attention kernel in a traced program, nested calls included."""
    count = 0
    for eqn in jaxpr.eqns:
        if eqn.params.get("name") == "_blockwise_attention":
            count += 1
        else:
            count += sum(kernel_calls(sub) for sub in jcore.jaxprs_in_params(eqn.params))
    return count


def measure(args: argparse.Namespace, policy: str | None, attention: bool = True) -> dict:
    """Residual bytes of the loss's gradient w.r.t. the parameters, and the kernel calls traced."""
    model = GPT(args.layers, args.width, args.heads, args.context)
    run = model if policy is None else apply_policy(model, policy, attention=attention)
    tokens = jax.ShapeDtypeStruct((args.batch, args.context), jnp.int32)
    params = jax.eval_shape(run.init, jax.random.key(0), tokens)["params"]
    batch = jax.ShapeDtypeStruct((args.batch, args.context + 1), jnp.int32)

    def loss(p: Any, b: jax.Array) -> jax.Array:
        logits = run.apply({"params": p}, b[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, b[:, 1:]).mean()

    kept = jmp_lite.memory.residual_bytes(loss, params, batch, argnums=0)
    calls = kernel_calls(jax.make_jaxpr(loss)(params, batch).jaxpr)
    square = kept.find(trailing_shape=(args.context, args.context))
    return {
        "bytes": kept.total,
        "by_dtype": kept.by_dtype,
        "kernel_calls": calls,
        "t_by_t_bytes": sum(r.bytes for r in square),
    }


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    env = _timing.environment()
    print(json.dumps(env), flush=True)
    rows = {
        "f32": measure(args, None),
        "bf16": measure(args, POLICY),
        "bf16, attention=False": measure(args, POLICY, attention=False),
    }
    f32 = rows["f32"]["bytes"]
    print(
        f"\nFlax Linen GPT ({args.layers} layers, width {args.width}, {args.heads} heads, nn.SelfAttention, "
        f"nn.make_causal_mask), {args.batch} x {args.context} tokens: bytes kept for the backward pass "
        "(jmp_lite.memory.residual_bytes, 10^9 bytes)\n"
    )
    print("| variant | residuals GB | ratio to f32 | T x T GB | attention kernel calls | by dtype (GB) |")
    print("|---|---:|---:|---:|---:|---|")
    for name, r in rows.items():
        dtypes = ", ".join(f"{k} {v / 1e9:.3f}" for k, v in sorted(r["by_dtype"].items()))
        print(
            f"| {name} | {r['bytes'] / 1e9:.3f} | {r['bytes'] / f32:.3f} | {r['t_by_t_bytes'] / 1e9:.3f} "
            f"| {r['kernel_calls']} | {dtypes} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows, "environment": env}, f, indent=2)


if __name__ == "__main__":
    main()
