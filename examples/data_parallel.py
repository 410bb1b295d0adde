"""Data-parallel mixed-precision training with pmap, shard_map or sharded jit.

The quickstart's digits MLP, trained with a global batch split over every
device, float16 compute, float32 master weights and dynamic loss scaling. On a
CPU the script asks XLA for 8 virtual devices unless XLA_FLAGS says otherwise.

    python examples/data_parallel.py --mode pmap
    python examples/data_parallel.py --mode jit --reduce-dtype bf16
"""

from __future__ import annotations

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import argparse  # noqa: E402
import functools  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from quickstart import forward, init_params, load_digits, loss_fn  # noqa: E402

import jmp_lite  # noqa: E402


def current_scale(opt_state: optax.OptState) -> jax.Array:
    """The loss scale as a new float32 array (1 for NoOpLossScale)."""
    return jnp.asarray(jmp_lite.get_loss_scale(opt_state).loss_scale, jnp.float32) * 1


def make_step(tx: optax.GradientTransformation, loss: Callable, axis_name: str | None) -> Callable:
    """One loss-scaled training step; with ``axis_name`` the reported loss is averaged over it."""

    def step(p, s, b):
        value, g = jmp_lite.value_and_grad(loss)(s, p, b)
        u, s = tx.update(g, s, p)
        if axis_name is not None:
            value = jax.lax.pmean(value, axis_name)
        return optax.apply_updates(p, u), s, (value, current_scale(s))

    return step


def train(
    mode: str,
    steps: int = 300,
    global_batch: int = 256,
    policy: str = "p=f32,c=f16,o=f32",
    reduce_dtype: str | None = None,
    seed: int = 0,
    log_every: int = 50,
) -> dict:
    """Trains and returns final test accuracy, loss-scale trajectory and timing."""
    pol = jmp_lite.get_policy(policy)
    x, y = load_digits()
    perm = np.random.default_rng(0).permutation(len(x))
    x, y = x[perm], y[perm]
    x_train, y_train, x_test, y_test = x[:1400], y[:1400], x[1400:], y[1400:]
    n = jax.device_count()
    if global_batch % n:
        raise SystemExit(f"--global-batch {global_batch} must be divisible by the {n} devices")
    loss = functools.partial(loss_fn, policy=pol)
    scale = (
        jmp_lite.DynamicLossScale(2.0**15, period=100)
        if pol.compute == jnp.float16
        else jmp_lite.NoOpLossScale()
    )
    params = init_params(jax.random.key(seed), (64, 256, 256, 10))
    rng = np.random.default_rng(seed)
    order = [rng.integers(0, len(x_train), global_batch) for _ in range(steps)]

    if mode not in ("pmap", "shard_map", "jit"):
        raise SystemExit(f"unknown --mode {mode!r}; choose pmap, shard_map or jit")
    if mode == "jit" and reduce_dtype is not None:
        raise SystemExit(
            "--reduce-dtype needs --mode pmap or shard_map (GSPMD reduces in the gradient dtype)"
        )
    # pmap and shard_map see local gradients and reduce them; jit sees global arrays.
    axis = None if mode == "jit" else "d"
    tx = jmp_lite.loss_scaling(
        optax.adam(1e-3), scale, axis_name=axis, reduce=axis and "mean", reduce_dtype=reduce_dtype
    )
    local_step = make_step(tx, loss, axis)

    if mode == "pmap":
        step = jax.pmap(local_step, axis_name="d", donate_argnums=(0, 1))
        state = jax.pmap(lambda t: t)(
            jax.tree_util.tree_map(lambda a: jnp.stack([a] * n), (params, tx.init(params)))
        )

        def put(idx):
            return (x_train[idx].reshape(n, -1, 64), y_train[idx].reshape(n, -1))

        unreplicate = functools.partial(jax.tree_util.tree_map, lambda a: a[0])
    else:
        mesh = Mesh(np.array(jax.devices()), ("d",))
        rep, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("d"))
        if mode == "shard_map":
            sharded = jax.shard_map(
                local_step, mesh=mesh, in_specs=(P(), P(), P("d")), out_specs=(P(), P(), P())
            )
            step = jax.jit(sharded, donate_argnums=(0, 1))
        else:
            step = jax.jit(local_step, out_shardings=(rep, rep, rep), donate_argnums=(0, 1))
        state = jax.device_put((params, tx.init(params)), rep)

        def put(idx):
            return jax.device_put((x_train[idx], y_train[idx]), split)

        def unreplicate(t):
            return t

    p, s = state
    cpu_devices = jax.devices()[0].platform == "cpu"
    scales, losses = [], []
    start = time.perf_counter()
    for i, idx in enumerate(order):
        p, s, (value, scale_now) = step(p, s, put(idx))
        scales.append(scale_now)  # a fresh output: the state itself is donated next step
        losses.append(value)
        if cpu_devices:
            # XLA:CPU runs the 8 virtual devices on a thread pool sized for the real
            # cores; with many steps in flight an all-reduce can wait forever for a
            # device whose thread is busy with a later step. One step in flight avoids it.
            jax.block_until_ready(value)
        if log_every and (i % log_every == 0 or i == steps - 1):
            ls_state = jmp_lite.get_loss_scaling_state(unreplicate(s))
            skipped = 0 if ls_state.skipped_total is None else int(ls_state.skipped_total)
            print(
                f"  step {i:4d}  loss {float(np.ravel(value)[0]):.4f}  "
                f"loss scale {float(np.ravel(scales[-1])[0]):>8.0f}  skipped {skipped}",
                flush=True,
            )
    jax.block_until_ready(p)
    elapsed = time.perf_counter() - start
    params = unreplicate(p)
    pred = jnp.argmax(forward(params, x_test, pol), -1)
    final = jmp_lite.get_loss_scaling_state(unreplicate(s))
    return {
        "mode": mode,
        "devices": n,
        "reduce_dtype": reduce_dtype or "gradient dtype",
        "test_accuracy": float(jnp.mean(pred == y_test)),
        "final_loss": float(np.mean([float(np.ravel(v)[0]) for v in losses[-20:]])),
        "skipped": 0 if final.skipped_total is None else int(final.skipped_total),
        "loss_scales": [float(np.ravel(v)[0]) for v in scales],
        "seconds": elapsed,
        "params": params,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mode", choices=["pmap", "shard_map", "jit"], default="pmap")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--global-batch", type=int, default=256)
    parser.add_argument("--policy", default="p=f32,c=f16,o=f32")
    parser.add_argument(
        "--reduce-dtype", default=None, help="all-reduce dtype: f32, bf16, f16 (pmap/shard_map)"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(f"{args.mode} on {jax.device_count()} {jax.devices()[0].platform} devices, policy {args.policy}")
    r = train(args.mode, args.steps, args.global_batch, args.policy, args.reduce_dtype, args.seed)
    print(
        f"test accuracy {100 * r['test_accuracy']:.2f}%  final loss {r['final_loss']:.4f}  "
        f"skipped {r['skipped']}  final loss scale {r['loss_scales'][-1]:.0f}  ({r['seconds']:.1f} s)"
    )


if __name__ == "__main__":
    main()
