"""A GPT-2-small-architecture decoder trained with Adam in every precision, side by side.

One Linen model, written once in float32 and run under ``jmp_lite.flax.linen.apply_policy``:

  f32-highest    float32, ``jax.default_matmul_precision("highest")`` (true float32 on GPUs)
  f32            float32, default precision (TF32 on NVIDIA GPUs)
  bf16           bfloat16 policy (float32 params, float32-accumulating matmuls)
  bf16-noacc     bfloat16 policy with ``accumulate=False`` (Flax's own 16-bit matmuls)
  bf16-noattn    bfloat16 policy with ``attention=False`` (attention as written, not the blockwise kernel;
                 on request, as fp8-unscaled)
  f16-dyn-cond   float16 policy + ``DynamicLossScale``, ``skip="cond"``
  f16-dyn-select float16 policy + ``DynamicLossScale``, ``skip="select"``
  f16-none       float16 policy, no loss scaling
  fp8-current    bf16 policy + fp8 contractions (hybrid: E4M3 forward, E5M2 gradients), current scaling
  fp8-delayed    the same with delayed scaling (TransformerEngine's default: history 1024, margin 0)
  fp8-unscaled   fp8 with every scale fixed at 1 (a delayed state that is never updated)
  fp8-block      fp8 with a scale per tile (1x128 activations and gradients, 128x128 weights, float32
                 promotion every 128 elements of the contraction; DeepSeek-V3), no state; on request

The fp8 variants run every Dense and attention projection in fp8; the byte embedding is a lookup
(no contraction) and the tied output layer (``Embed.attend``, the last layer) stays bfloat16 through a
path rule on the embedding module.

Each variant trains on the same real text (Python's standard-library sources as bytes)
in the same order; the script reports step time and tokens/s (median, ratio to f32 with a
95% bootstrap interval from interleaved rounds), MFU (XLA's cost-analysis FLOPs over a
peak calibrated with a large 16-bit matmul on the same device), compiled memory, on GPU
the peak bytes in use (one subprocess per variant), compile time, and the held-out loss
after all steps. Protocol: benchmarks/README.md.

``--memory`` skips training and prints the memory table instead: per variant, the bytes the
backward pass keeps (``jmp_lite.memory.residual_bytes`` of the step's gradient, by dtype and
as a ratio to f32), the bytes per parameter of the training state, and on a GPU the peak
bytes in use of a compiled step. The residuals are counted by tracing with abstract inputs
(``jax.ShapeDtypeStruct``): nothing is compiled or allocated, so GPT-2-small at 16 x 1024
tokens takes seconds on a laptop.

    MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TRIM_THRESHOLD_=4294967296 \\
        python benchmarks/lm.py --size tiny --rounds 10 --k 3
    python benchmarks/lm.py --size small --rounds 20 --k 5 --json out/lm.json   # a GPU
    python benchmarks/lm.py --size small --memory                                # any machine
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
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _precisions  # noqa: E402
import _timing  # noqa: E402

from jmp_lite.flax.linen import apply_policy  # noqa: E402

SIZES = {  # layers, width, heads, context, batch
    "tiny": (2, 256, 4, 256, 8),
    "small": (12, 768, 12, 1024, 16),
}


class Block(nn.Module):
    width: int
    heads: int

    @nn.compact
    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        x = x + nn.MultiHeadDotProductAttention(num_heads=self.heads)(nn.LayerNorm()(x), mask=mask)
        h = nn.gelu(nn.Dense(4 * self.width)(nn.LayerNorm()(x)))
        return x + nn.Dense(self.width)(h)


class GPT(nn.Module):
    """GPT-2's decoder (pre-LayerNorm blocks, learned positions, tied byte embedding)."""

    layers: int
    width: int
    heads: int
    context: int
    vocab: int = 256

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        embed = nn.Embed(self.vocab, self.width)
        pos = self.param("pos", nn.initializers.normal(0.02), (self.context, self.width))
        x = embed(tokens)
        x = x + pos[: tokens.shape[1]].astype(x.dtype)
        mask = nn.make_causal_mask(tokens)
        for _ in range(self.layers):
            x = Block(self.width, self.heads)(x, mask)
        return embed.attend(nn.LayerNorm()(x))


def data(context: int, batch: int, batches: int, held_batches: int = 1) -> tuple[jax.Array, jax.Array]:
    """``batches`` training batches and ``held_batches`` held-out batches (as one) of ``context + 1``
    bytes per sequence."""
    from jmp_lite._demo.corpus import stdlib_bytes

    text = stdlib_bytes(4_000_000)
    rng = np.random.default_rng(0)
    split = int(0.9 * len(text))
    starts = rng.integers(0, split - context - 1, (batches, batch))
    train = text[starts[..., None] + np.arange(context + 1)]
    held = rng.integers(split, len(text) - context - 1, batch * held_batches)
    return jnp.asarray(train), jnp.asarray(text[held[:, None] + np.arange(context + 1)])


def make_loss(model: Any) -> Any:
    """``loss_fn(params, model_state, batch) -> (loss, model_state)``: next-byte cross-entropy
    (``model_state``: the ``"fp8"`` collection with delayed fp8 scaling, else empty)."""

    def loss_fn(p: Any, model_state: Any, b: jax.Array) -> tuple:
        logits = model.apply({"params": p, **model_state}, b[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, b[:, 1:]).mean(), model_state

    return loss_fn


def model_of(name: str, size: str) -> Any:
    layers, width, heads, context, _ = SIZES[size]
    v = _precisions.VARIANTS[name]
    rules = {"Embed_0": v.policy} if v.fp8 else None  # a rule opts the tied output layer out of fp8
    return apply_policy(
        GPT(layers, width, heads, context),
        v.policy,
        rules,
        accumulate=v.accumulate,
        fp8=v.fp8,
        attention=v.attention,
    )


def memory_row(name: str, size: str) -> dict:
    """The variant's memory by tracing only: abstract parameters and batch, nothing allocated."""
    _, _, _, context, batch = SIZES[size]
    model = model_of(name, size)
    tokens = jax.ShapeDtypeStruct((batch, context), jnp.int32)
    variables = dict(jax.eval_shape(model.init, jax.random.key(0), tokens))
    params = variables.pop("params")
    b = jax.ShapeDtypeStruct((batch, context + 1), jnp.int32)
    return _precisions.memory_row(_precisions.VARIANTS[name], make_loss(model), params, variables, b)


def build(name: str, size: str, learning_rate: Any = 3e-4) -> dict:
    _, _, _, context, batch = SIZES[size]
    v = _precisions.VARIANTS[name]
    model = model_of(name, size)
    tokens = jnp.zeros((batch, context), jnp.int32)
    variables = dict(jax.jit(model.init)(jax.random.key(0), tokens))
    params = variables.pop("params")  # what remains: the fp8 states of delayed scaling, if any
    loss_fn = make_loss(model)
    step, tx = _precisions.make_step(loss_fn, v, learning_rate)
    state = (params, variables, tx.init(params))
    with _precisions.precision_scope(v):
        compiled, compile_s = _timing.compile_ahead(step, state, jnp.zeros((batch, context + 1), jnp.int32))
        evaluate = jax.jit(lambda p, model_state, b: loss_fn(p, model_state, b)[0])
    return {
        "compiled": compiled,
        "state": state,
        "compile_s": compile_s,
        "evaluate": evaluate,
        "params": sum(a.size for a in jax.tree_util.tree_leaves(params)),
        "items": batch * context,
    }


def memory(names: list[str], size: str) -> dict:
    """The memory table's numbers for ``names`` at ``size`` (GPU peak bytes only on a GPU)."""
    rows = {n: memory_row(n, size) for n in names}
    result = _precisions.memory(rows, _precisions.peaks(__file__, size))
    layers, width, heads, context, batch = SIZES[size]
    result.update(size=size, params=next(iter(rows.values()))["params"], tokens=batch * context)
    print(
        f"GPT-2 architecture, size {size} ({result['params'] / 1e6:.1f}M params, {layers} layers, "
        f"width {width}, {heads} heads), Adam, {batch} x {context} tokens per step: memory"
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    # fp8-unscaled is an accuracy check, bf16-noattn a comparison of the kernel and fp8-block (emulated
    # tile by tile off a GPU) a recipe comparison: all on request
    default = [n for n in _precisions.VARIANTS if n not in ("fp8-unscaled", "bf16-noattn", "fp8-block")]
    parser.add_argument("--variants", default=",".join(default))
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--k", type=int, default=3, help="steps per timed round")
    parser.add_argument("--json", default=None)
    parser.add_argument("--train-batches", type=int, default=64, help="distinct training batches, cycled")
    parser.add_argument(
        "--held-batches", type=int, default=1, help="held-out batches the loss is measured on"
    )
    parser.add_argument("--curve", type=int, default=0, help="also measure the held-out loss every N rounds")
    parser.add_argument(
        "--decay",
        action="store_true",
        help="Adam at a peak 1e-3 after 50 warm-up steps, cosine-decayed to 0 over the run (the loss ends "
        "flat by construction; default: a constant 3e-4)",
    )
    parser.add_argument("--memory", action="store_true", help="print the memory table only, no training")
    parser.add_argument("--peak-of", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.peak_of:  # subprocess mode: a few steps of one variant, then the device's peak bytes
        _precisions.report_peak(
            build(args.peak_of, args.size), data(SIZES[args.size][3], SIZES[args.size][4], 4)[0]
        )
        return
    env = _timing.environment()
    print(json.dumps(env), flush=True)
    names = _precisions.parse_variants(parser, args.variants)
    if args.memory:
        result = memory(names, args.size)
        print(_precisions.memory_table(result), flush=True)
        _precisions.write_json(args.json, env, result)
        return
    lr: Any = 3e-4
    if args.decay:  # 5 warm-up steps of the timing protocol count too
        lr = optax.warmup_cosine_decay_schedule(0.0, 1e-3, 50, 5 + args.rounds * args.k)
    built = {n: build(n, args.size, lr) for n in names}
    batches, held = data(SIZES[args.size][3], SIZES[args.size][4], args.train_batches, args.held_batches)
    peak = _precisions.peaks(__file__, args.size)
    evaluate = lambda n, s: built[n]["evaluate"](s[0], s[1], held)  # noqa: E731
    result = _precisions.side_by_side(built, batches, args.rounds, args.k, evaluate, peak, args.curve)
    params = next(iter(built.values()))["params"]
    result.update(size=args.size, params=params)
    print(
        f"GPT-2 architecture, size {args.size} ({params / 1e6:.1f}M params, byte vocabulary), Adam, "
        f"{SIZES[args.size][4]} x {SIZES[args.size][3]} tokens per step"
    )
    print(_precisions.table(result, "tokens", "held-out loss"), flush=True)
    if args.curve:
        print(_precisions.curve_table(result, "held-out loss"), flush=True)
    _precisions.write_json(args.json, env, result)


if __name__ == "__main__":
    main()
