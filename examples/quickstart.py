"""Quickstart: a small real mixed-precision training run with dynamic loss scaling.

Trains an MLP classifier on the handwritten digits that ship inside
scikit-learn (1797 8x8 images, no download) in float32, in float16 compute
with float32 master weights and dynamic loss scaling, and in bfloat16, and
prints loss, loss scale and skipped steps as it goes.

    python examples/quickstart.py --steps 300
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jmp_lite


def load_digits() -> tuple[np.ndarray, np.ndarray]:
    try:
        from sklearn.datasets import load_digits as sk_load
    except ImportError:
        raise SystemExit("the quickstart needs scikit-learn: pip install scikit-learn") from None
    data = sk_load()
    return (data.data / 16.0).astype(np.float32), data.target.astype(np.int32)


def init_params(key: jax.Array, sizes: tuple[int, ...]) -> list[dict[str, jax.Array]]:
    params = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        w = jax.random.normal(jax.random.fold_in(key, i), (a, b)) * (2.0 / a) ** 0.5
        params.append({"w": w, "b": jnp.zeros(b)})
    return params


def forward(params: list, x: jax.Array, policy: jmp_lite.Policy) -> jax.Array:
    params, h = policy.cast_to_compute((params, x))
    for i, layer in enumerate(params):
        h = h @ layer["w"] + layer["b"]
        if i < len(params) - 1:
            h = jax.nn.gelu(h)
    return policy.cast_to_output(h)


def loss_fn(params: list, batch: tuple, policy: jmp_lite.Policy) -> jax.Array:
    x, y = batch
    logits = forward(params, x, policy).astype(jnp.float32)  # loss in float32
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def train(
    policy: jmp_lite.Policy, loss_scale: jmp_lite.LossScale, data: tuple, steps: int, seed: int
) -> dict:
    x_train, y_train, x_test, y_test = data
    params = init_params(jax.random.key(seed), (64, 256, 256, 10))
    tx = jmp_lite.loss_scaling(optax.adam(1e-3), loss_scale)
    opt_state = tx.init(params)
    loss = functools.partial(loss_fn, policy=policy)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, opt_state, batch):
        # scaled by the scale tx.update divides by (NoOpLossScale: a plain value_and_grad)
        value, grads = jmp_lite.value_and_grad(loss)(opt_state, params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    rng = np.random.default_rng(seed)
    start = time.perf_counter()
    for i in range(steps):
        idx = rng.integers(0, len(x_train), 128)
        params, opt_state, value = step(params, opt_state, (x_train[idx], y_train[idx]))
        if i % max(1, steps // 5) == 0 or i == steps - 1:
            state = jmp_lite.get_loss_scaling_state(opt_state)
            scale = float(jnp.asarray(jmp_lite.get_loss_scale(opt_state).loss_scale))
            skipped = 0 if state.skipped_total is None else int(state.skipped_total)
            print(f"  step {i:4d}  loss {float(value):.4f}  loss scale {scale:>8.0f}  skipped {skipped}")
    elapsed = time.perf_counter() - start
    pred = jnp.argmax(forward(params, x_test, policy), -1)
    return {"accuracy": float(jnp.mean(pred == y_test)), "seconds": elapsed}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    x, y = load_digits()
    perm = np.random.default_rng(0).permutation(len(x))
    x, y = x[perm], y[perm]
    data = (x[:1400], y[:1400], x[1400:], y[1400:])
    runs = {
        "float32": (jmp_lite.get_policy("f32"), jmp_lite.NoOpLossScale()),
        "float16 + dynamic loss scale": (
            jmp_lite.get_policy("p=f32,c=f16,o=f32"),
            jmp_lite.DynamicLossScale(2.0**15, period=100),
        ),
        "bfloat16": (jmp_lite.get_policy("p=f32,c=bf16,o=f32"), jmp_lite.NoOpLossScale()),
    }
    results = {}
    for name, (policy, ls) in runs.items():
        print(f"{name}  ({policy})")
        results[name] = train(policy, ls, data, args.steps, args.seed)
    print("\nconfiguration                    test accuracy   train time")
    for name, r in results.items():
        print(f"{name:<32} {100 * r['accuracy']:>12.2f}%   {r['seconds']:>8.2f} s")


if __name__ == "__main__":
    main()
