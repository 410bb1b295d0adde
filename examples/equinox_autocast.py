"""Trains an Equinox MLP classifier with jmp_lite.autocast and loss scaling.

Equinox models are plain pytrees, so mixed precision needs no model changes:
``jmp_lite.autocast`` rewrites the loss function's program (matmuls in the
compute dtype with float32 accumulation, exp/log/sums in float32), and
``jmp_lite.loss_scaling`` with a ``DynamicLossScale`` keeps float16 gradients
from underflowing (Micikevicius et al., 2018, "Mixed Precision Training");
bfloat16 runs with ``NoOpLossScale``. ``jmp_lite.value_and_grad`` multiplies the
loss by the scale the optimizer will divide by.

Run: ``python examples/equinox_autocast.py --steps 200 --policy p=f32,c=f16,o=f32``
(or ``c=bf16``; the test suite runs both).
"""

from __future__ import annotations

import argparse

import equinox as eqx
import jax
import optax

import jmp_lite


def make_data(key: jax.Array, n: int = 512, features: int = 16, classes: int = 4) -> tuple:
    """Gaussian blobs: one centre per class."""
    kc, kx, ky = jax.random.split(key, 3)
    centres = 3.0 * jax.random.normal(kc, (classes, features))
    y = jax.random.randint(ky, (n,), 0, classes)
    x = centres[y] + jax.random.normal(kx, (n, features))
    return x, y


def train(steps: int = 200, policy: str = "p=f32,c=f16,o=f32", seed: int = 0) -> list[float]:
    """Trains and returns the loss of every step."""
    key = jax.random.key(seed)
    x, y = make_data(key)
    model = eqx.nn.MLP(16, 4, width_size=64, depth=2, key=jax.random.fold_in(key, 1))
    params, static = eqx.partition(model, eqx.is_inexact_array)

    @jmp_lite.autocast(policy)
    def loss_fn(params, x, y):
        logits = jax.vmap(eqx.combine(params, static))(x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    # float16 needs a loss scale (its gradients underflow); bfloat16 has float32's range
    half = jmp_lite.get_policy(policy).compute
    scale = jmp_lite.DynamicLossScale(2.0**15) if half == jax.numpy.float16 else jmp_lite.NoOpLossScale()
    tx = jmp_lite.loss_scaling(optax.adam(1e-2), scale)
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state):
        loss, grads = jmp_lite.value_and_grad(loss_fn)(opt_state, params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return eqx.apply_updates(params, updates), opt_state, loss

    losses = []
    for _ in range(steps):
        params, opt_state, loss = step(params, opt_state)
        losses.append(float(loss))
    return losses


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--policy", default="p=f32,c=f16,o=f32")
    args = parser.parse_args(argv)
    losses = train(args.steps, args.policy)
    print(f"policy {args.policy}: loss {losses[0]:.4f} -> {losses[-1]:.4f} after {args.steps} steps")


if __name__ == "__main__":
    main()
