"""A matmul-heavy Linen MLP (4 x Dense(1024) + LayerNorm, batch 1024, Adam) in float32 and bfloat16.

Variants, interleaved in one process (protocol: benchmarks/README.md):

  f32            float32
  bf16           ``apply_policy(model, "p=f32,c=bf16,o=f32")``: float32-accumulating bf16 matmuls
  bf16-noacc     the same with ``accumulate=False`` (Flax's own bf16 matmuls)
  flax-bf16      Flax's own recipe: every layer ``dtype=bfloat16``, ``param_dtype=float32``

    MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TRIM_THRESHOLD_=4294967296 \\
        python benchmarks/mlp.py --rounds 20 --k 3
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _timing  # noqa: E402

from jmp_lite.flax.linen import apply_policy  # noqa: E402


class MLP(nn.Module):
    dtype: object = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        for _ in range(4):
            x = nn.LayerNorm(dtype=self.dtype)(nn.relu(nn.Dense(1024, dtype=self.dtype)(x)))
        return nn.Dense(10, dtype=self.dtype)(x).astype(jnp.float32)


MODELS = {
    "f32": MLP(),
    "bf16": apply_policy(MLP(), "p=f32,c=bf16,o=f32"),
    "bf16-noacc": apply_policy(MLP(), "p=f32,c=bf16,o=f32", accumulate=False),
    "flax-bf16": MLP(dtype=jnp.bfloat16),
}


def step_for(model: object, tx: optax.GradientTransformation):
    def step(state, batch):
        params, opt_state = state
        x, y = batch

        def loss_fn(p):
            logits = model.apply({"params": p}, x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        grads = jax.grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return step


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    env = _timing.environment()
    print(json.dumps(env), flush=True)
    x = jax.random.normal(jax.random.key(1), (args.batch, 1024))
    y = jax.random.randint(jax.random.key(2), (args.batch,), 0, 10)
    tx = optax.adam(1e-3)
    params = MODELS["f32"].init(jax.random.key(0), x)["params"]
    runners, states, info = {}, {}, {}
    for name, model in MODELS.items():
        state = jax.tree_util.tree_map(jnp.array, (params, tx.init(params)))
        compiled, compile_s = _timing.compile_ahead(step_for(model, tx), state, (x, y))
        runners[name] = lambda s, i, c=compiled: c(s, (x, y))
        states[name] = _timing.warm_up(runners[name], state)
        info[name] = {"compile_s": compile_s}
    times = _timing.interleaved(runners, states, args.rounds, args.k)
    print(f"\n{args.rounds} interleaved rounds x {args.k} steps, batch {args.batch}\n")
    print("| variant | median step (ms) | ratio to f32 | 95% CI | compile (s) |")
    print("|---|---:|---:|---|---:|")
    for name in MODELS:
        ratio, lo, hi = _timing.paired_ratio(times[name], times["f32"])
        info[name].update(step_ms=1e3 * float(np.median(times[name])), ratio=ratio, ci=[lo, hi])
        print(
            f"| {name} | {info[name]['step_ms']:.1f} | {ratio:.3f} | [{lo:.3f}, {hi:.3f}] "
            f"| {info[name]['compile_s']:.1f} |"
        )
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"environment": env, "command": " ".join(sys.argv), "variants": info}, f, indent=2)


if __name__ == "__main__":
    main()
