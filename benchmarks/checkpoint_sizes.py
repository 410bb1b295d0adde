"""Checkpoint sizes under mixed precision: training checkpoints vs exported inference weights.

A training checkpoint holds the float32 master parameters and the optimizer state
(Adam's two moments, float32), so it is the same size whether the run computes in
float32, bfloat16 or float16. Only weights exported with ``jmp_lite.export_params``
halve. Sizes are the bytes of ``flax.serialization.to_bytes`` (msgpack) of a small
Linen MLP (784-128-128-10) trained one step in each precision:

    python benchmarks/checkpoint_sizes.py
"""

from __future__ import annotations

import json
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import serialization

import jmp_lite
from jmp_lite.flax import TrainState
from jmp_lite.flax.linen import apply_policy

SIZES = (784, 128, 128, 10)
RUNS = {  # policy, loss scale
    "f32": ("p=f32,c=f32,o=f32", jmp_lite.NoOpLossScale()),
    "bf16": ("p=f32,c=bf16,o=f32", jmp_lite.NoOpLossScale()),
    "f16": ("p=f32,c=f16,o=f32", jmp_lite.DynamicLossScale(2.0**15)),
}


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        for width in SIZES[1:-1]:
            x = nn.relu(nn.Dense(width)(x))
        return nn.Dense(SIZES[-1])(x)


def trained_state(policy: str, loss_scale: jmp_lite.LossScale) -> TrainState:
    """A TrainState of MLP after one loss-scaled Adam step in ``policy``."""
    model = apply_policy(MLP(), policy)
    x, y = jnp.ones((8, SIZES[0])), jnp.arange(8) % SIZES[-1]
    tx = jmp_lite.loss_scaling(optax.adam(1e-3), loss_scale)
    state = TrainState.create(apply_fn=model.apply, params=model.init(jax.random.key(0), x)["params"], tx=tx)

    def loss_fn(params: Any) -> jax.Array:
        logits = state.apply_fn({"params": params}, x).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    _, grads = jmp_lite.value_and_grad(loss_fn)(state, state.params)
    return state.apply_gradients(grads=grads)


def measure() -> dict[str, dict[str, int]]:
    """Bytes of each run's training checkpoint (params + optimizer state) and of its exported params."""
    out = {}
    for name, (policy, loss_scale) in RUNS.items():
        state = trained_state(policy, loss_scale)
        out[name] = {
            "training_checkpoint": len(
                serialization.to_bytes({"params": state.params, "opt_state": state.opt_state})
            ),
            "params_float32": len(serialization.to_bytes(state.params)),
            "exported_bfloat16": len(serialization.to_bytes(jmp_lite.export_params(state.params, "bf16"))),
            "exported_float16": len(serialization.to_bytes(jmp_lite.export_params(state.params, "f16"))),
        }
    return out


def main() -> None:
    sizes = measure()
    print(json.dumps({"model": f"Linen MLP {'-'.join(map(str, SIZES))}", "bytes": sizes}))
    print("| run | training checkpoint | float32 params | exported bfloat16 | exported float16 |")
    print("|---|---|---|---|---|")
    for name, row in sizes.items():
        print(f"| {name} | " + " | ".join(f"{v / 1000:.1f} kB" for v in row.values()) + " |")


if __name__ == "__main__":
    main()
