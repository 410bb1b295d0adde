"""ResNet-50 on 32x32 images (the CIFAR variant) trained with Adam in every precision, side by side.

One Linen model under ``jmp_lite.flax.linen.apply_policy`` (BatchNorm stays float32: statistics,
scale and bias), the variants of benchmarks/lm.py. Mixed-precision training papers
report this model's size halving (90 MB vs 46 MB stored) and its epoch time dropping
from 1m32s to 1m15s on a P100 and 47s to 26s on a V100; this script measures step time,
images/s, MFU, compiled memory (and GPU peak bytes), the stored parameter bytes in float32 vs
16-bit, and the held-out loss after training on the same synthetic-but-learnable images
(class-dependent patterns plus noise; no download). Protocol: benchmarks/README.md.
``--memory`` skips training and prints the memory table of benchmarks/lm.py instead (bytes
kept for the backward pass per variant, by tracing only; bytes per parameter; GPU peak).

    MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TRIM_THRESHOLD_=4294967296 \\
        python benchmarks/resnet.py --size tiny --rounds 6 --k 2
    python benchmarks/resnet.py --size 50 --rounds 20 --k 5 --json out/resnet.json   # a GPU
    python benchmarks/resnet.py --size 50 --memory                                    # any machine
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
import optax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _precisions  # noqa: E402
import _timing  # noqa: E402

from jmp_lite.flax.linen import apply_policy  # noqa: E402

SIZES = {  # blocks per stage, base width, batch
    "tiny": ((1, 1, 1, 1), 16, 32),
    "50": ((3, 4, 6, 3), 64, 128),
}


class Bottleneck(nn.Module):
    width: int
    stride: int

    @nn.compact
    def __call__(self, x: jax.Array, train: bool) -> jax.Array:
        norm = lambda: nn.BatchNorm(use_running_average=not train, momentum=0.9)  # noqa: E731
        h = nn.relu(norm()(nn.Conv(self.width, (1, 1), use_bias=False)(x)))
        h = nn.relu(norm()(nn.Conv(self.width, (3, 3), self.stride, use_bias=False)(h)))
        h = norm()(nn.Conv(4 * self.width, (1, 1), use_bias=False)(h))
        if x.shape != h.shape:
            x = norm()(nn.Conv(4 * self.width, (1, 1), self.stride, use_bias=False)(x))
        return nn.relu(x + h)


class ResNet(nn.Module):
    """ResNet-50's bottleneck stages with a 3x3 stem and no max-pool, for 32x32 inputs."""

    blocks: tuple[int, ...]
    width: int
    classes: int = 10

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = True) -> jax.Array:
        x = nn.Conv(self.width, (3, 3), use_bias=False)(x)
        x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9)(x))
        for stage, n in enumerate(self.blocks):
            for i in range(n):
                stride = 2 if stage > 0 and i == 0 else 1
                x = Bottleneck(self.width * 2**stage, stride)(x, train)
        return nn.Dense(self.classes)(x.mean((1, 2)))


def data(batch: int, batches: int, seed: int = 0) -> tuple[list, tuple]:
    """Learnable images: a fixed random pattern per class, mixed with noise."""
    key = jax.random.key(seed)
    patterns = jax.random.normal(jax.random.fold_in(key, 0), (10, 32, 32, 3))

    def make(k: jax.Array) -> tuple:
        labels = jax.random.randint(jax.random.fold_in(k, 1), (batch,), 0, 10)
        noise = jax.random.normal(jax.random.fold_in(k, 2), (batch, 32, 32, 3))
        return 0.5 * patterns[labels] + noise, labels

    train = [make(jax.random.fold_in(key, 10 + i)) for i in range(batches)]
    return train, make(jax.random.fold_in(key, 999))


def model_of(name: str, size: str) -> Any:
    blocks, width, _ = SIZES[size]
    v = _precisions.VARIANTS[name]
    return apply_policy(ResNet(blocks, width), v.policy, accumulate=v.accumulate)


def make_loss(model: Any) -> Any:
    """``loss_fn(params, batch_stats, batch) -> (loss, new batch_stats)``, in training mode."""

    def loss_fn(p: Any, batch_stats: Any, b: tuple) -> tuple:
        logits, new = model.apply({"params": p, "batch_stats": batch_stats}, b[0], mutable=["batch_stats"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, b[1]).mean(), new["batch_stats"]

    return loss_fn


def memory_row(name: str, size: str) -> dict:
    """The variant's memory by tracing only: abstract parameters and images, nothing allocated."""
    batch = SIZES[size][2]
    model = model_of(name, size)
    images = jax.ShapeDtypeStruct((batch, 32, 32, 3), jnp.float32)
    variables = jax.eval_shape(model.init, jax.random.key(0), images)
    b = (images, jax.ShapeDtypeStruct((batch,), jnp.int32))
    v = _precisions.VARIANTS[name]
    return _precisions.memory_row(v, make_loss(model), variables["params"], variables["batch_stats"], b)


def memory(names: list[str], size: str) -> dict:
    """The memory table's numbers for ``names`` at ``size`` (GPU peak bytes only on a GPU)."""
    rows = {n: memory_row(n, size) for n in names}
    result = _precisions.memory(rows, _precisions.peaks(__file__, size))
    params = next(iter(rows.values()))["params"]
    result.update(size=size, params=params)
    print(
        f"ResNet ({size}) on 32x32 images, {params / 1e6:.1f}M params, Adam, batch {SIZES[size][2]}: memory"
    )
    return result


def build(name: str, size: str) -> dict:
    _, _, batch = SIZES[size]
    v = _precisions.VARIANTS[name]
    model = model_of(name, size)
    images = jnp.zeros((batch, 32, 32, 3))
    variables = jax.jit(model.init)(jax.random.key(0), images)
    params, stats = variables["params"], variables["batch_stats"]
    loss_fn = make_loss(model)

    def evaluate(p: Any, batch_stats: Any, b: tuple) -> jax.Array:
        logits = model.apply({"params": p, "batch_stats": batch_stats}, b[0], train=False)
        return optax.softmax_cross_entropy_with_integer_labels(logits, b[1]).mean()

    step, tx = _precisions.make_step(loss_fn, v, 1e-3)
    state = (params, stats, tx.init(params))
    with _precisions.precision_scope(v):
        compiled, compile_s = _timing.compile_ahead(step, state, (images, jnp.zeros(batch, jnp.int32)))
        evaluate = jax.jit(evaluate)
    leaves = jax.tree_util.tree_leaves(params)
    return {
        "compiled": compiled,
        "state": state,
        "compile_s": compile_s,
        "evaluate": evaluate,
        "params": sum(a.size for a in leaves),
        "items": batch,
    }


def main() -> None:
    fmt = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=fmt)
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--variants", default="f32-highest,f32,bf16,f16-dyn-cond,f16-none")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--k", type=int, default=2, help="steps per timed round")
    parser.add_argument("--json", default=None)
    parser.add_argument("--memory", action="store_true", help="print the memory table only, no training")
    parser.add_argument("--peak-of", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    batch = SIZES[args.size][2]
    if args.peak_of:  # subprocess mode: a few steps of one variant, then the device's peak bytes
        _precisions.report_peak(build(args.peak_of, args.size), data(batch, 2)[0])
        return
    env = _timing.environment()
    print(json.dumps(env), flush=True)
    names = _precisions.parse_variants(parser, args.variants, fp8=False)  # convolutions stay 16-bit
    if args.memory:
        result = memory(names, args.size)
        print(_precisions.memory_table(result), flush=True)
        _precisions.write_json(args.json, env, result)
        return
    built = {n: build(n, args.size) for n in names}
    batches, held = data(batch, 16)
    peak = _precisions.peaks(__file__, args.size)
    result = _precisions.side_by_side(
        built, batches, args.rounds, args.k, lambda n, s: built[n]["evaluate"](s[0], s[1], held), peak
    )
    params = next(iter(built.values()))["params"]
    result.update(size=args.size, params=params, param_mb_f32=4 * params / 1e6, param_mb_16=2 * params / 1e6)
    print(
        f"ResNet ({args.size}) on 32x32 images, {params / 1e6:.1f}M params "
        f"({4 * params / 1e6:.1f} MB float32, {2 * params / 1e6:.1f} MB as 16-bit), Adam, batch {batch}"
    )
    print(_precisions.table(result, "images", "held-out loss"), flush=True)
    _precisions.write_json(args.json, env, result)


if __name__ == "__main__":
    main()
