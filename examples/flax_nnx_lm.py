"""A Flax NNX transformer language model on Python's own standard library, in three precisions.

A byte-level causal transformer (pre-LayerNorm, no dtype arguments anywhere)
learns to continue Python source. The corpus is the ``.py`` files of the
standard library of the Python running this script, read in sorted order (no
download; its exact bytes depend on the Python version). The first 90% is for
training, the last 10% for validation. ``jmp_lite.flax.nnx.apply_policy`` runs
the model in float32, bfloat16 and float16; ``LossScaledOptimizer`` does the
loss-scaled, skip-safe update.

    python examples/flax_nnx_lm.py                    # ~2 minutes on 2 CPU cores
    python examples/flax_nnx_lm.py --seeds 3 --steps 2000 --width 256 --json out/lm.json
"""

from __future__ import annotations

import argparse
import platform
import sysconfig
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _report import mean_spread, progress, set_postfix, table, write_json
from flax import nnx

import jmp_lite
from jmp_lite.flax.nnx import LossScaledOptimizer, apply_policy

CONFIGS = {
    "float32": ("f32", jmp_lite.NoOpLossScale()),
    "bfloat16": ("p=f32,c=bf16,o=f32", jmp_lite.NoOpLossScale()),
    "float16 + dynamic loss scale": ("p=f32,c=f16,o=f32", jmp_lite.DynamicLossScale(2.0**15, period=200)),
}


def load_corpus(max_bytes: int) -> np.ndarray:
    """The standard library's sources as bytes, ``max_bytes`` of them, in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if total < 10_000:
        raise SystemExit(f"found only {total} bytes of Python sources under {root}")
    return np.frombuffer(b"".join(chunks)[:max_bytes], dtype=np.uint8).astype(np.int32)


class Block(nnx.Module):
    def __init__(self, width: int, heads: int, rngs: nnx.Rngs) -> None:
        self.norm1 = nnx.LayerNorm(width, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(heads, width, decode=False, rngs=rngs)
        self.norm2 = nnx.LayerNorm(width, rngs=rngs)
        self.up = nnx.Linear(width, 4 * width, rngs=rngs)
        self.down = nnx.Linear(4 * width, width, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(self.norm1(x), mask=nnx.make_causal_mask(x[..., 0]))
        return x + self.down(nnx.gelu(self.up(self.norm2(x))))


class LM(nnx.Module):
    def __init__(self, width: int, depth: int, heads: int, context: int, rngs: nnx.Rngs) -> None:
        self.embed = nnx.Embed(256, width, rngs=rngs)
        self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (context, width)))
        self.blocks = nnx.List([Block(width, heads, rngs) for _ in range(depth)])
        self.norm = nnx.LayerNorm(width, rngs=rngs)
        self.head = nnx.Linear(width, 256, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens) + self.pos[: tokens.shape[-1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def cross_entropy(model: LM, tokens: jax.Array) -> jax.Array:
    logits = model(tokens[:, :-1]).astype(jnp.float32)  # the loss in float32
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


@nnx.jit
def train_step(model: LM, optimizer: LossScaledOptimizer, tokens: jax.Array) -> jax.Array:
    def loss_fn(model: LM) -> tuple[jax.Array, jax.Array]:
        loss = cross_entropy(model, tokens)
        return optimizer.loss_scale.scale(loss), loss

    grads, loss = nnx.grad(loss_fn, has_aux=True)(model)
    optimizer.update(model, grads, rollback=())  # no BatchNorm, dropout or other state to roll back
    return loss


@nnx.jit
def eval_loss(model: LM, tokens: jax.Array) -> jax.Array:
    return cross_entropy(model, tokens)


def windows(data: np.ndarray, starts: np.ndarray, length: int) -> np.ndarray:
    return data[starts[:, None] + np.arange(length)]


def train(name: str, corpus: tuple, args: argparse.Namespace, seed: int) -> dict:
    policy, loss_scale = CONFIGS[name]
    train_data, val_data = corpus
    length = args.context + 1
    model = LM(args.width, args.depth, args.heads, args.context, nnx.Rngs(seed))
    view = apply_policy(model, policy)
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, args.lr, args.steps // 10 + 1, args.steps, args.lr / 10
    )
    tx = jmp_lite.loss_scaling(optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule)), loss_scale)
    optimizer = LossScaledOptimizer(view, tx)
    rng = np.random.default_rng(seed)
    losses = []
    bar = progress(args.steps, f"{name} seed {seed}")
    start = time.perf_counter()
    for i in bar:
        starts = rng.integers(0, len(train_data) - length, args.batch_size)
        loss = train_step(view, optimizer, windows(train_data, starts, length))
        if i % 25 == 0 or i == args.steps - 1:
            losses.append(float(loss))
            set_postfix(bar, loss=f"{losses[-1]:.3f}", scale=float(optimizer.loss_scale.loss_scale))
    seconds = time.perf_counter() - start
    # A fixed validation set: the same windows for every configuration and seed.
    val_starts = np.linspace(0, len(val_data) - length - 1, args.val_batches * args.batch_size).astype(int)
    val = [
        float(eval_loss(view, windows(val_data, chunk, length)))
        for chunk in np.array_split(val_starts, args.val_batches)
    ]
    info = jmp_lite.get_loss_scaling_state(nnx.as_pure(optimizer.opt_state))
    return {
        "val_loss": float(np.mean(val)),
        "final_train_loss": float(np.mean(losses[-3:])),
        "skipped": 0 if info.skipped_total is None else int(info.skipped_total),
        "loss_scale": float(optimizer.loss_scale.loss_scale),
        "seconds": seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--width", type=int, default=96)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--corpus-bytes", type=int, default=2_000_000)
    parser.add_argument("--val-batches", type=int, default=8)
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()

    data = load_corpus(args.corpus_bytes)
    split = int(0.9 * len(data))
    corpus = (data[:split], data[split:])
    print(
        f"corpus: {len(data):,} bytes of Python {platform.python_version()} stdlib sources; "
        f"{args.steps} steps of {args.batch_size}x{args.context} bytes"
    )
    runs = {name: [train(name, corpus, args, s) for s in range(args.seeds)] for name in args.configs}
    base = runs.get("float32")
    rows = []
    for name, rs in runs.items():
        val = [r["val_loss"] for r in rs]
        row = {
            "config": name,
            "val": mean_spread(val, 4),
            "train": mean_spread([r["final_train_loss"] for r in rs], 3),
            "skipped": sum(r["skipped"] for r in rs),
            "scale": f"{rs[-1]['loss_scale']:g}",
            "time": f"{np.mean([r['seconds'] for r in rs]):.1f} s",
        }
        if base is not None:
            ref = np.mean([r["val_loss"] for r in base])
            row["delta"] = f"{100 * (np.mean(val) - ref) / ref:+.2f}%"
        rows.append(row)
    cols = [("configuration", "config"), (f"val loss, nats/byte ({args.seeds} seeds)", "val")]
    cols += [("vs fp32", "delta")] if base is not None else []
    cols += [("train loss", "train"), ("skipped", "skipped"), ("loss scale", "scale"), ("train time", "time")]
    print(table(rows, cols))
    write_json(
        args.json,
        {
            "example": "flax_nnx_lm",
            "args": vars(args),
            "runs": runs,
            "machine": f"{platform.processor() or platform.machine()}, {jax.devices()[0].platform}",
            "versions": {"jax": jax.__version__, "python": platform.python_version()},
        },
    )


if __name__ == "__main__":
    main()
