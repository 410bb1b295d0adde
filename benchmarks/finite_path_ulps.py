"""How far a finite ``loss_scaling`` step is from the plain optimizer's, in float32 ulps.

For each optimizer, 3 steps of ``tx.update`` + ``optax.apply_updates`` on a 256x64 + 64
parameter tree with gradients ``0.37 * p + 0.01``, plain and under
``loss_scaling(..., DynamicLossScale(2**10), skip=...)`` (a power of two, so unscaling is
exact), eagerly and under ``jax.jit``. Prints the largest difference from the plain
optimizer in any parameter, in float32 ulps (the table in docs/optax.md).

    python benchmarks/finite_path_ulps.py
"""

from __future__ import annotations

import jax
import numpy as np
import optax

import jmp_lite

SCALE = 2.0**10


def run(opt: optax.GradientTransformation, mode: str, jit: bool, params: dict, grads: dict) -> dict:
    tx = opt if mode == "plain" else jmp_lite.loss_scaling(opt, jmp_lite.DynamicLossScale(SCALE), skip=mode)
    scale = 1.0 if mode == "plain" else SCALE
    update = jax.jit(tx.update) if jit else tx.update
    state, p = tx.init(params), params
    for _ in range(3):
        u, state = update(jax.tree_util.tree_map(lambda g: g * scale, grads), state, p)
        p = optax.apply_updates(p, u)
    return p


def ulps(a: dict, b: dict) -> int:
    def bits(t: dict) -> np.ndarray:
        flat = np.concatenate([np.asarray(x).ravel() for x in jax.tree_util.tree_leaves(t)])
        return flat.view(np.int32).astype(np.int64)

    return int(np.abs(bits(a) - bits(b)).max())


def main() -> None:
    params = {
        "w": jax.random.normal(jax.random.key(0), (256, 64)),
        "b": jax.random.normal(jax.random.key(1), (64,)),
    }
    grads = jax.tree_util.tree_map(lambda p: p * 0.37 + 0.01, params)
    optimizers = {
        "optax.adam": optax.adam(1e-3),
        "optax.adamw": optax.adamw(1e-3),
        "optax.sgd(momentum=0.9)": optax.sgd(0.1, momentum=0.9),
        "optax.lamb": optax.lamb(1e-3),
        "optax.lion": optax.lion(1e-4),
    }
    print(f"jax {jax.__version__}, optax {optax.__version__}, backend {jax.default_backend()}\n")
    print("| optimizer | `cond` eager | `cond` jit | `select` eager | `select` jit |")
    print("|---|---:|---:|---:|---:|")
    for name, opt in optimizers.items():
        plain = {jit: run(opt, "plain", jit, params, grads) for jit in (False, True)}
        cells = [
            ulps(run(opt, m, jit, params, grads), plain[jit])
            for m in ("cond", "select")
            for jit in (False, True)
        ]
        print(f"| `{name}` | " + " | ".join(str(c) for c in cells) + " |")


if __name__ == "__main__":
    main()
