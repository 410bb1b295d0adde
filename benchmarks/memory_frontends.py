"""Residual bytes of one GPT-2-architecture decoder under each of jmp_lite's front-ends.

The same decoder (benchmarks/lm.py's: pre-LayerNorm blocks, learned positions, tied byte embedding,
causal attention) run three ways under the bf16 policy (``p=f32,c=bf16,o=f32``), against the same
front-end in float32:

  linen      lm.py's Linen model under ``jmp_lite.flax.linen.apply_policy``
  autocast   the same Linen model's plain ``apply`` under ``jmp_lite.autocast``
  nnx        an NNX twin of it under ``jmp_lite.flax.nnx.apply_policy``

The bytes the backward pass keeps are counted by tracing (``jmp_lite.memory.residual_bytes`` of the
loss's gradient with respect to the parameters, abstract inputs: nothing is compiled or allocated).

    python benchmarks/memory_frontends.py --size small
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _timing  # noqa: E402
import lm  # noqa: E402

import jmp_lite  # noqa: E402
import jmp_lite.flax.nnx as jnnx  # noqa: E402
from jmp_lite.flax.linen import apply_policy  # noqa: E402

POLICY = "p=f32,c=bf16,o=f32"


class NNXBlock(nnx.Module):
    def __init__(self, width: int, heads: int, rngs: nnx.Rngs) -> None:
        self.norm1 = nnx.LayerNorm(width, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(heads, width, decode=False, rngs=rngs)
        self.norm2 = nnx.LayerNorm(width, rngs=rngs)
        self.up = nnx.Linear(width, 4 * width, rngs=rngs)
        self.down = nnx.Linear(4 * width, width, rngs=rngs)

    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        x = x + self.attn(self.norm1(x), mask=mask)
        return x + self.down(nnx.gelu(self.up(self.norm2(x))))


class NNXGPT(nnx.Module):
    """lm.py's ``GPT`` as an NNX model."""

    def __init__(self, layers: int, width: int, heads: int, context: int, rngs: nnx.Rngs) -> None:
        self.embed = nnx.Embed(256, width, rngs=rngs)
        self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (context, width)))
        self.blocks = nnx.List([NNXBlock(width, heads, rngs) for _ in range(layers)])
        self.norm = nnx.LayerNorm(width, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        mask = nnx.make_causal_mask(tokens)
        for block in self.blocks:
            x = block(x, mask)
        return self.embed.attend(self.norm(x))


def ce(logits: jax.Array, b: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits, b[:, 1:]).mean()


def linen_loss(policy: str, autocast: bool, kernel: bool) -> tuple:
    layers, width, heads, context, _ = lm.SIZES[ARGS.size]
    model = lm.GPT(layers, width, heads, context)
    if autocast:
        run = jmp_lite.autocast(model.apply, policy, attention=kernel)
    else:
        run = apply_policy(model, policy, attention=kernel).apply
    tokens = jax.ShapeDtypeStruct((1, context), jnp.int32)
    params = jax.eval_shape(model.init, jax.random.key(0), tokens)["params"]
    return (lambda p, b: ce(run({"params": p}, b[:, :-1]), b)), params


def nnx_loss(policy: str, kernel: bool) -> tuple:
    layers, width, heads, context, _ = lm.SIZES[ARGS.size]
    abstract = nnx.eval_shape(lambda: NNXGPT(layers, width, heads, context, nnx.Rngs(0)))
    view = jnnx.apply_policy(abstract, policy, attention=kernel)
    graphdef, params = nnx.split(view)

    def loss(p: Any, b: jax.Array) -> jax.Array:
        return ce(nnx.merge(graphdef, p)(b[:, :-1]), b)

    return loss, params


def measure(front_end: str, policy: str, kernel: bool = True) -> int:
    if front_end == "nnx":
        loss, params = nnx_loss(policy, kernel)
    else:
        loss, params = linen_loss(policy, front_end == "autocast", kernel)
    _, _, _, context, batch = lm.SIZES[ARGS.size]
    b = jax.ShapeDtypeStruct((batch, context + 1), jnp.int32)
    return jmp_lite.memory.residual_bytes(loss, params, b, argnums=0).total


def main() -> None:
    global ARGS
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--size", choices=sorted(lm.SIZES), default="tiny")
    parser.add_argument("--json", default=None)
    ARGS = parser.parse_args()
    print(json.dumps(_timing.environment()))
    rows = {}
    for front_end in ("linen", "autocast", "nnx"):
        f32, bf16 = measure(front_end, "f32"), measure(front_end, POLICY)
        written = measure(front_end, POLICY, kernel=False)
        rows[front_end] = {
            "f32_bytes": f32,
            "bf16_bytes": bf16,
            "ratio": bf16 / f32,
            "bf16_bytes_attention_as_written": written,
            "ratio_attention_as_written": written / f32,
        }
    print(f"\nGPT-2 architecture, size {ARGS.size}: bytes kept for the backward pass (10^9 bytes)\n")
    print(
        "| front-end | float32 | bf16 policy | ratio | bf16, attention=False | ratio |\n"
        "|---|---:|---:|---:|---:|---:|"
    )
    for name, r in rows.items():
        print(
            f"| {name} | {r['f32_bytes'] / 1e9:.3f} | {r['bf16_bytes'] / 1e9:.3f} | {r['ratio']:.3f} "
            f"| {r['bf16_bytes_attention_as_written'] / 1e9:.3f} | {r['ratio_attention_as_written']:.3f} |"
        )
    if ARGS.json:
        with open(ARGS.json, "w") as f:
            json.dump({"size": ARGS.size, "rows": rows, "environment": _timing.environment()}, f, indent=2)


ARGS: Any = None

if __name__ == "__main__":
    main()
