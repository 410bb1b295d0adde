"""A Flax Linen CNN on real images in float32, bfloat16, and float16 with dynamic loss scaling.

The model is written with no dtype arguments at all; ``jmp_lite.flax.linen.apply_policy``
runs it in each precision, and ``jmp_lite.flax.TrainState`` does the loss-scaled,
skip-safe update (BatchNorm statistics included). Data: the 1797 handwritten digits
(8x8) that ship inside scikit-learn, split 55% train / 45% test so that one test
image is 0.12 accuracy points.

    python examples/flax_linen_cnn.py                  # ~1 minute on 2 CPU cores
    python examples/flax_linen_cnn.py --seeds 3 --steps 1500 --json out/cnn.json
"""

from __future__ import annotations

import argparse
import functools
import platform
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from _report import mean_spread, progress, set_postfix, table, write_json
from quickstart import load_digits

import jmp_lite
from jmp_lite.flax import TrainState
from jmp_lite.flax.linen import apply_policy


class CNN(nn.Module):
    """Two conv + BatchNorm blocks and a two-layer head; no dtype arguments anywhere."""

    @nn.compact
    def __call__(self, x: jax.Array, train: bool) -> jax.Array:
        for features in (32, 64):
            x = nn.Conv(features, (3, 3))(x)
            x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
            x = nn.relu(x)
        x = x.mean((1, 2))
        x = nn.relu(nn.Dense(128)(x))
        return nn.Dense(10)(x)


CONFIGS = {
    "float32": ("f32", jmp_lite.NoOpLossScale()),
    "bfloat16": ("p=f32,c=bf16,o=f32", jmp_lite.NoOpLossScale()),
    "float16 + dynamic loss scale": ("p=f32,c=f16,o=f32", jmp_lite.DynamicLossScale(2.0**15, period=200)),
}


def split_digits() -> tuple[np.ndarray, ...]:
    x, y = load_digits()
    x = x.reshape(-1, 8, 8, 1)
    perm = np.random.default_rng(0).permutation(len(x))  # one fixed split for every run
    x, y = x[perm], y[perm]
    n = int(0.55 * len(x))
    return x[:n], y[:n], x[n:], y[n:]


def train(name: str, data: tuple, steps: int, batch: int, seed: int) -> dict:
    policy, loss_scale = CONFIGS[name]
    x_train, y_train, x_test, y_test = data
    model = apply_policy(CNN(), policy)
    variables = model.init(jax.random.key(seed), jnp.asarray(x_train[:1]), train=False)
    schedule = optax.warmup_cosine_decay_schedule(0.0, 3e-3, steps // 20 + 1, steps)
    state = TrainState.create(
        apply_fn=model.apply,
        params=variables["params"],
        tx=jmp_lite.loss_scaling(optax.adamw(schedule, weight_decay=1e-4), loss_scale),
        model_state={"batch_stats": variables["batch_stats"]},
    )

    @functools.partial(jax.jit, donate_argnums=0)
    def step(state: TrainState, x: jax.Array, y: jax.Array) -> tuple[TrainState, jax.Array]:
        def loss_fn(params):
            logits, updates = model.apply(
                {"params": params, **state.model_state}, x, train=True, mutable=["batch_stats"]
            )
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
            return state.loss_scale.scale(loss), (loss, updates)

        grads, (loss, updates) = jax.grad(loss_fn, has_aux=True)(state.params)
        return state.apply_gradients(grads=grads, model_state=updates), loss

    @jax.jit
    def predict(state: TrainState, x: jax.Array) -> jax.Array:
        return jnp.argmax(model.apply({"params": state.params, **state.model_state}, x, train=False), -1)

    rng = np.random.default_rng(seed)
    losses = []
    bar = progress(steps, f"{name} seed {seed}")
    start = time.perf_counter()
    for i in bar:
        idx = rng.integers(0, len(x_train), batch)
        state, loss = step(state, x_train[idx], y_train[idx])
        if i % 50 == 0 or i == steps - 1:
            losses.append(float(loss))
            set_postfix(bar, loss=f"{losses[-1]:.3f}", scale=float(state.loss_scale.loss_scale))
    seconds = time.perf_counter() - start
    accuracy = float(np.mean(np.asarray(predict(state, x_test)) == y_test))
    info = jmp_lite.get_loss_scaling_state(state.opt_state)
    return {
        "accuracy": 100 * accuracy,
        "final_loss": float(np.mean(losses[-3:])),
        "skipped": 0 if info.skipped_total is None else int(info.skipped_total),
        "loss_scale": float(state.loss_scale.loss_scale),
        "seconds": seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()

    data = split_digits()
    print(
        f"digits: {len(data[0])} train / {len(data[2])} test images; {args.steps} steps of {args.batch_size}"
    )
    runs = {
        name: [train(name, data, args.steps, args.batch_size, s) for s in range(args.seeds)]
        for name in args.configs
    }
    base = runs.get("float32")
    rows = []
    for name, rs in runs.items():
        acc = [r["accuracy"] for r in rs]
        row = {
            "config": name,
            "accuracy": mean_spread(acc),
            "loss": mean_spread([r["final_loss"] for r in rs], 3),
            "skipped": sum(r["skipped"] for r in rs),
            "scale": f"{rs[-1]['loss_scale']:g}",
            "time": f"{np.mean([r['seconds'] for r in rs]):.1f} s",
        }
        if base is not None:
            row["delta"] = f"{np.mean(acc) - np.mean([r['accuracy'] for r in base]):+.2f}"
        rows.append(row)
    cols = [("configuration", "config"), (f"test acc % ({args.seeds} seeds)", "accuracy")]
    cols += [("vs fp32", "delta")] if base is not None else []
    cols += [("final loss", "loss"), ("skipped", "skipped"), ("loss scale", "scale"), ("train time", "time")]
    print(table(rows, cols))
    write_json(
        args.json,
        {
            "example": "flax_linen_cnn",
            "args": vars(args),
            "runs": runs,
            "machine": f"{platform.processor() or platform.machine()}, {jax.devices()[0].platform}",
            "versions": {"jax": jax.__version__, "jmp_lite": jmp_lite.__version__},
        },
    )


if __name__ == "__main__":
    main()
