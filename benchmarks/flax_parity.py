"""Does ``apply_policy`` cost anything against threading ``dtype=``/``param_dtype=`` by hand?

For the two Flax examples' models (the Linen CNN and the NNX transformer LM) this
builds the same model twice: once plain and run under ``apply_policy``, once
hand-written with every dtype argument spelled out the way the policy's defaults
promise (norms in float32, output cast to the compute dtype; attention softmax in
float32). It compiles one full training step (forward, backward, Adam) of each,
compares the optimized HLO after stripping source metadata, and times both.

    python benchmarks/flax_parity.py --steps 100 --repeats 5
"""

from __future__ import annotations

import argparse
import platform
import re
import statistics
import sys
import time
from pathlib import Path

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from flax_linen_cnn import CNN  # noqa: E402
from flax_nnx_lm import LM  # noqa: E402

import jmp_lite  # noqa: E402
from jmp_lite.flax import apply_policy  # noqa: E402
from jmp_lite.flax.nnx import apply_policy as nnx_apply_policy  # noqa: E402
from jmp_lite.flax.nnx import attention  # noqa: E402

F32 = jnp.float32


class HandCNN(nn.Module):
    compute: object

    @nn.compact
    def __call__(self, x: jax.Array, train: bool) -> jax.Array:
        c = self.compute
        x = x.astype(c)
        for features in (32, 64):
            x = nn.Conv(features, (3, 3), dtype=c, param_dtype=F32)(x)
            x = nn.BatchNorm(use_running_average=not train, momentum=0.9, dtype=F32, param_dtype=F32)(x)
            x = nn.relu(x.astype(c))
        x = x.mean((1, 2))
        x = nn.relu(nn.Dense(128, dtype=c, param_dtype=F32)(x))
        return nn.Dense(10, dtype=c, param_dtype=F32)(x).astype(F32)


class HandBlock(nnx.Module):
    def __init__(self, width: int, heads: int, c: object, rngs: nnx.Rngs) -> None:
        self.c = c
        self.norm1 = nnx.LayerNorm(width, dtype=F32, param_dtype=F32, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(
            heads, width, decode=False, dtype=c, param_dtype=F32, attention_fn=attention, rngs=rngs
        )
        self.norm2 = nnx.LayerNorm(width, dtype=F32, param_dtype=F32, rngs=rngs)
        self.up = nnx.Linear(width, 4 * width, dtype=c, param_dtype=F32, rngs=rngs)
        self.down = nnx.Linear(4 * width, width, dtype=c, param_dtype=F32, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = self.norm1(x).astype(self.c)
        x = x + self.attn(h, mask=nnx.make_causal_mask(x[..., 0]))
        return x + self.down(nnx.gelu(self.up(self.norm2(x).astype(self.c))))


class HandLM(nnx.Module):
    def __init__(self, width: int, depth: int, heads: int, context: int, c: object, rngs: nnx.Rngs) -> None:
        self.c = c
        self.embed = nnx.Embed(256, width, dtype=c, param_dtype=F32, rngs=rngs)
        self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (context, width)))
        self.blocks = nnx.List([HandBlock(width, heads, c, rngs) for _ in range(depth)])
        self.norm = nnx.LayerNorm(width, dtype=F32, param_dtype=F32, rngs=rngs)
        self.head = nnx.Linear(width, 256, dtype=c, param_dtype=F32, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens) + self.pos[: tokens.shape[-1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x).astype(self.c)).astype(F32)


def linen_step(model: object, compute: object) -> tuple:
    """A jitted Linen train step and its arguments."""
    x = jnp.asarray(np.random.default_rng(0).random((64, 8, 8, 1), np.float32))
    y = jnp.arange(64) % 10
    variables = model.init(jax.random.key(0), x, train=False)
    tx = optax.adam(1e-3)
    params, stats = variables["params"], variables["batch_stats"]

    def step(params, opt_state, stats, x, y):
        def loss_fn(p):
            logits, upd = model.apply(
                {"params": p, "batch_stats": stats}, x, train=True, mutable=["batch_stats"]
            )
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), upd

        grads, upd = jax.grad(loss_fn, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, upd["batch_stats"]

    return jax.jit(step), (params, tx.init(params), stats, x, y)


def nnx_step(model: nnx.Module) -> tuple:
    """A jitted NNX train step (on split state, so plain jax.jit compiles it) and its arguments."""
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (32, 65)), jnp.int32)
    graphdef, params = nnx.split(model)
    tx = optax.adam(1e-3)

    def step(params, opt_state, tokens):
        def loss_fn(p):
            logits = nnx.merge(graphdef, p)(tokens[:, :-1]).astype(F32)
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

        grads = jax.grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return jax.jit(step), (params, tx.init(params), tokens)


def hlo(step: object, args: tuple) -> str:
    text = step.lower(*args).compile().as_text()
    # Source files, lines and op names differ between the two, not the program: drop them.
    text = re.sub(r"\n(FileNames|FunctionNames|FileLocations|StackFrames)\n(\d+ .*\n)*", "\n", text)
    text = re.sub(r", (metadata=\{[^}]*\}|stack_frame_id=\d+)", "", text)
    return re.sub(r"^HloModule \S+", "HloModule m", text, flags=re.M)


def time_steps(step: object, args: tuple, steps: int, repeats: int) -> float:
    """Median over ``repeats`` of the mean seconds per step over ``steps`` steps (state fed back)."""
    n_state = len(args) - (2 if len(args) == 5 else 1)
    state, rest = args[:n_state], args[n_state:]
    state = step(*state, *rest)
    jax.block_until_ready(state)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(steps):
            state = step(*state, *rest)
        jax.block_until_ready(state)
        times.append((time.perf_counter() - start) / steps)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    versions = f"jax {jax.__version__}, flax {flax.__version__}, optax {optax.__version__}"
    print(f"{versions}, jmp_lite {jmp_lite.__version__}, python {platform.python_version()}")
    print(f"{platform.processor() or platform.machine()}, {jax.devices()[0].device_kind}\n")
    print("| model | compute | optimized HLO | policy ms/step | hand-written ms/step | ratio |")
    print("|---|---|---|---|---|---|")
    for name, c in [("bfloat16", jnp.bfloat16), ("float16", jnp.float16)]:
        policy = jmp_lite.Policy(F32, c, F32)
        pairs = {
            "Linen CNN (digits)": (
                linen_step(apply_policy(CNN(), policy), c),
                linen_step(HandCNN(c), c),
            ),
            "NNX transformer LM": (
                nnx_step(nnx_apply_policy(LM(96, 2, 4, 64, nnx.Rngs(0)), policy)),
                nnx_step(HandLM(96, 2, 4, 64, c, nnx.Rngs(0))),
            ),
        }
        for model, ((fa, aa), (fb, ab)) in pairs.items():
            same = "identical" if hlo(fa, aa) == hlo(fb, ab) else "differs"
            ta = time_steps(fa, aa, args.steps, args.repeats)
            tb = time_steps(fb, ab, args.steps, args.repeats)
            print(f"| {model} | {name} | {same} | {1e3 * ta:.3f} | {1e3 * tb:.3f} | {ta / tb:.3f} |")


if __name__ == "__main__":
    main()
