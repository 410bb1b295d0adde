"""16-bit parameters without a float32 master copy: does the held-out loss hold, and at how many bytes?

The GPT-2-architecture decoder of ``lm.py`` (its model, data and held-out loss), trained with Adam
under the bfloat16 compute policy of ``lm.py``'s ``bf16`` variant (``p=f32,c=bf16,o=f32``: matmuls
in bfloat16 with float32 accumulation, norms and softmax in float32) in five configurations that
differ only in how parameters and optimizer state are stored and updated:

  f32-master     float32 parameters and float32 Adam moments (the baseline)
  bf16-nearest   bfloat16 parameters, plain ``optax.adam``: its moments follow the parameters'
                 dtype (optax issue #1552) and every update rounds to nearest
  bf16-nearest-f32-adam
                 bfloat16 parameters rounded to nearest, float32 Adam moments
                 (``low_precision_state(adam, float32)``): isolates the parameter rounding
  bf16-kahan     bfloat16 parameters + ``kahan_summation()``, bfloat16 Adam moments
                 (``low_precision_state``, stochastic rounding)
  bf16-stochastic
                 bfloat16 parameters + ``stochastic_rounding(key)``, bfloat16 Adam moments

and five with 8-bit Adam moments (``low_precision_state(adam, "int8", rounding="nearest")``:
block-wise, Dettmers et al., 2022, "8-bit Optimizers via Block-wise Quantization"; round to nearest as
bitsandbytes does, blocks of 256 along the last axis, arrays below 4096 elements in float32):

  f32-int8       float32 parameters, int8 moments: isolates the moments' quantization
  bf16-nearest-int8
                 bfloat16 parameters rounded to nearest, int8 moments (no Kahan, no stochastic
                 rounding: expected to fall behind, as bf16-nearest does)
  bf16-kahan-int8
                 bfloat16 parameters + ``kahan_summation()``, int8 moments
  bf16-stochastic-int8
                 bfloat16 parameters + ``stochastic_rounding(key)``, int8 moments
  bf16-stochastic-fp8
                 bfloat16 parameters + ``stochastic_rounding(key)``, float8_e4m3fn moments

and four whose 8-bit moments are rounded stochastically (``rounding="stochastic"``, the default)
instead of to nearest: ``f32-int8-sr``, ``bf16-kahan-int8-sr``, ``bf16-stochastic-int8-sr``,
``bf16-stochastic-fp8-sr``.

Each (configuration, seed) trains from the seed's initialisation on the seed's order of the same
training windows and reports the held-out loss on 64 windows of the held-out tenth of the text, and
the bytes per parameter that ``jmp_lite.memory.state_bytes`` counts from the actual pytrees:
parameters + optimizer state (compensation buffers, block scales and keys included), and with the
gradients (which have the parameters' dtype) added.

    python benchmarks/low_precision_params.py --steps 4000 --seeds 0,1,2 --out out/lowp
    python benchmarks/low_precision_params.py --summarize out/lowp

One (configuration, seed) per process with ``--config NAME --seed S`` (what ``--seeds`` runs in
turn); ``--summarize`` prints the table from the JSON files they write.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _timing  # noqa: E402
import lm  # noqa: E402

import jmp_lite  # noqa: E402
from jmp_lite.flax.linen import apply_policy  # noqa: E402

POLICY = "p=f32,c=bf16,o=f32"  # lm.py's bf16 variant
CONFIGS = [
    "f32-master",
    "bf16-nearest",
    "bf16-nearest-f32-adam",
    "bf16-kahan",
    "bf16-stochastic",
    "f32-int8",
    "bf16-nearest-int8",
    "bf16-kahan-int8",
    "bf16-stochastic-int8",
    "bf16-stochastic-fp8",
    "f32-int8-sr",
    "bf16-kahan-int8-sr",
    "bf16-stochastic-int8-sr",
    "bf16-stochastic-fp8-sr",
]
EIGHT_BIT = {"int8": "int8", "fp8": "float8_e4m3fn"}  # configuration suffix -> low_precision_state dtype
HELD_OUT_WINDOWS = 64


def optimizer(config: str, schedule: Any, seed: int) -> optax.GradientTransformation:
    adam = optax.adam(schedule)
    rounding_key = jax.random.fold_in(jax.random.key(seed), 1)
    state_key = jax.random.fold_in(jax.random.key(seed), 2)
    if config in ("f32-master", "bf16-nearest"):
        return adam
    if config == "bf16-nearest-f32-adam":
        return jmp_lite.low_precision_state(adam, jnp.float32)
    base = config.removesuffix("-sr")  # "-sr": 8-bit moments rounded stochastically, not to nearest
    suffix = base.rsplit("-", 1)[-1]
    if suffix in EIGHT_BIT:  # 8-bit moments; the rounding is spelled out, whatever the default
        stochastic = base != config
        rounding = dict(rounding="stochastic", key=state_key) if stochastic else dict(rounding="nearest")
        moments = jmp_lite.low_precision_state(adam, EIGHT_BIT[suffix], **rounding)
        if base in ("f32-int8", "bf16-nearest-int8"):
            return moments
    else:
        moments = jmp_lite.low_precision_state(adam, jnp.bfloat16, key=state_key)
    last = (
        jmp_lite.kahan_summation()
        if config.startswith("bf16-kahan")
        else jmp_lite.stochastic_rounding(rounding_key)
    )
    return optax.chain(moments, last)


def run(config: str, seed: int, steps: int, size: str, lr: float, chunk: int) -> dict:
    layers, width, heads, context, batch = lm.SIZES[size]
    model = apply_policy(lm.GPT(layers, width, heads, context), POLICY)
    tokens = jnp.zeros((batch, context), jnp.int32)
    params = jax.jit(model.init)(jax.random.key(seed), tokens)["params"]
    if config.startswith("bf16"):
        params = jax.tree_util.tree_map(lambda p: p.astype(jnp.bfloat16), params)
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, min(200, steps // 10), steps, end_value=0.0)
    tx = optimizer(config, schedule, seed)
    opt_state = tx.init(params)

    train, _ = lm.data(context, batch, steps)
    train = train[np.random.default_rng(seed).permutation(steps)]  # the seed's order of the same windows
    held = lm.data(context, HELD_OUT_WINDOWS, 1)[1]

    def loss_fn(p: Any, b: jax.Array) -> jax.Array:
        logits = model.apply({"params": p}, b[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, b[:, 1:]).mean()

    def step(carry: tuple, b: jax.Array) -> tuple:
        p, s = carry
        loss, grads = jax.value_and_grad(loss_fn)(p, b)
        updates, s = tx.update(grads, s, p)
        return (optax.apply_updates(p, updates), s), loss

    train_chunk = jax.jit(lambda carry, bs: jax.lax.scan(step, carry, bs), donate_argnums=0)
    evaluate = jax.jit(
        lambda p: jnp.mean(jnp.stack([loss_fn(p, held[i : i + batch]) for i in range(0, len(held), batch)]))
    )

    counted = jmp_lite.memory.state_bytes(params, opt_state)
    print(counted, flush=True)
    grad_bytes = counted.by_component["parameters"]  # gradients have the parameters' dtypes
    carry, curve, t0 = (params, opt_state), [], time.perf_counter()
    for start in range(0, steps, chunk):
        carry, losses = train_chunk(carry, train[start : start + chunk])
        curve.append([start + chunk, float(np.mean(np.asarray(losses)))])
        print(
            f"{config} seed {seed}: step {start + chunk} train loss {curve[-1][1]:.4f} "
            f"({time.perf_counter() - t0:.0f} s)",
            flush=True,
        )
    params, opt_state = carry
    return {
        "config": config,
        "seed": seed,
        "steps": steps,
        "size": size,
        "lr": lr,
        "held_out": float(evaluate(params)),
        "train_curve": curve,
        "params": counted.parameters,
        "bytes_per_param": counted.bytes_per_parameter,
        "bytes_per_param_with_grads": (counted.total + grad_bytes) / counted.parameters,
        "bytes_by_component": dict(counted.by_component),
        "param_dtypes": sorted({str(x.dtype) for x in jax.tree_util.tree_leaves(params)}),
        "wall_s": time.perf_counter() - t0,
    }


def summarize(rows: list[dict]) -> str:
    by = {c: [r for r in rows if r["config"] == c] for c in CONFIGS}
    by = {c: sorted(rs, key=lambda r: r["seed"]) for c, rs in by.items() if rs}
    base = np.mean([r["held_out"] for r in by.get("f32-master", [])]) if "f32-master" in by else None
    first = next(iter(by.values()))[0]
    lines = [
        f"GPT-2 architecture, size {first['size']} ({first['params'] / 1e6:.2f}M params), Adam, peak lr "
        f"{first['lr']:g}, warmup + cosine decay to 0 over {first['steps']} steps, policy {POLICY}\n",
        "| configuration | bytes/param: params + optimizer state | with gradients | held-out loss, mean "
        "(min to max) | vs f32-master | per seed |",
        "|---|---:|---:|---|---:|---|",
    ]
    for c, rs in by.items():
        h = np.array([r["held_out"] for r in rs])
        rel = "" if base is None else f"{100 * (h.mean() / base - 1):+.2f}%"
        seeds = ", ".join(f"{r['seed']}: {r['held_out']:.4f}" for r in rs)
        lines.append(
            f"| {c} | {rs[0]['bytes_per_param']:.2f} | {rs[0]['bytes_per_param_with_grads']:.2f} | "
            f"{h.mean():.4f} ({h.min():.4f} to {h.max():.4f}) | {rel} | {seeds} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size", choices=sorted(lm.SIZES), default="tiny")
    parser.add_argument("--steps", type=int, default=4000)
    parser.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    parser.add_argument("--chunk", type=int, default=100, help="steps per compiled scan")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--config", default=None, help="one configuration (with --seed)")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--out", default=None, help="folder for one JSON file per run")
    parser.add_argument("--summarize", default=None, help="print the table from a folder of JSON files")
    args = parser.parse_args()
    if args.summarize:
        rows = [json.load(open(f)) for f in sorted(glob.glob(os.path.join(args.summarize, "*.json")))]
        print(summarize([r for r in rows if "config" in r]))
        return
    if args.steps % args.chunk:
        parser.error("--steps must be a multiple of --chunk")
    env = _timing.environment()
    print(json.dumps(env), flush=True)
    runs = (
        [(args.config, args.seed if args.seed is not None else 0)]
        if args.config
        else [(c, int(s)) for s in args.seeds.split(",") for c in args.configs.split(",")]
    )
    unknown = sorted({c for c, _ in runs} - set(CONFIGS))
    if unknown:
        parser.error(f"unknown configurations {unknown}; choose from {CONFIGS}")
    rows = []
    for config, seed in runs:
        row = run(config, seed, args.steps, args.size, args.lr, args.chunk)
        row.update(environment=env, command=" ".join(sys.argv))
        rows.append(row)
        print(
            json.dumps({k: v for k, v in row.items() if k not in ("train_curve", "environment")}), flush=True
        )
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, f"{config}-seed{seed}.json"), "w") as f:
                json.dump(row, f, indent=1)
    print(summarize(rows))


if __name__ == "__main__":
    main()
