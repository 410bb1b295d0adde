"""A GPT-2-small-architecture decoder trained with Adam in every precision, side by side.

One Linen model, written once in float32 and run under ``jmp_lite.flax.apply_policy``:

  f32-highest    float32, ``jax.default_matmul_precision("highest")`` (true float32 on GPUs)
  f32            float32, default precision (TF32 on NVIDIA GPUs)
  bf16           bfloat16 policy (float32 params, float32-accumulating matmuls)
  bf16-noacc     bfloat16 policy with ``accumulate=False`` (Flax's own 16-bit matmuls)
  f16-dyn-cond   float16 policy + ``DynamicLossScale``, ``skip="cond"``
  f16-dyn-select float16 policy + ``DynamicLossScale``, ``skip="select"``
  f16-none       float16 policy, no loss scaling

Each variant trains on the same real text (Python's standard-library sources as bytes)
in the same order; the script reports step time and tokens/s (median, ratio to f32 with a
95% bootstrap interval from interleaved rounds), MFU (XLA's cost-analysis FLOPs over a
peak calibrated with a large 16-bit matmul on the same device), compiled memory, on GPU
the peak bytes in use (one subprocess per variant), compile time, and the held-out loss
after all steps. Protocol: benchmarks/README.md.

    MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TRIM_THRESHOLD_=4294967296 \\
        python benchmarks/lm.py --size tiny --rounds 10 --k 3
    python benchmarks/lm.py --size small --rounds 20 --k 5 --json out/lm.json   # a GPU
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _timing  # noqa: E402

import jmp_lite  # noqa: E402
from jmp_lite.flax import apply_policy  # noqa: E402

SIZES = {  # layers, width, heads, context, batch
    "tiny": (2, 256, 4, 256, 8),
    "small": (12, 768, 12, 1024, 16),
}
VARIANTS = ["f32-highest", "f32", "bf16", "bf16-noacc", "f16-dyn-cond", "f16-dyn-select", "f16-none"]


class Block(nn.Module):
    width: int
    heads: int

    @nn.compact
    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        x = x + nn.MultiHeadDotProductAttention(num_heads=self.heads)(nn.LayerNorm()(x), mask=mask)
        h = nn.gelu(nn.Dense(4 * self.width)(nn.LayerNorm()(x)))
        return x + nn.Dense(self.width)(h)


class GPT(nn.Module):
    """GPT-2's decoder (pre-LayerNorm blocks, learned positions, tied byte embedding)."""

    layers: int
    width: int
    heads: int
    context: int
    vocab: int = 256

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        embed = nn.Embed(self.vocab, self.width)
        pos = self.param("pos", nn.initializers.normal(0.02), (self.context, self.width))
        x = embed(tokens)
        x = x + pos[: tokens.shape[1]].astype(x.dtype)
        mask = nn.make_causal_mask(tokens)
        for _ in range(self.layers):
            x = Block(self.width, self.heads)(x, mask)
        return embed.attend(nn.LayerNorm()(x))


@dataclass
class Variant:
    policy: str
    loss_scale: Any = None
    skip: str = "auto"
    highest: bool = False
    accumulate: bool = True


def variant(name: str) -> Variant:
    return {
        "f32-highest": Variant("f32", highest=True),
        "f32": Variant("f32"),
        "bf16": Variant("p=f32,c=bf16,o=f32"),
        "bf16-noacc": Variant("p=f32,c=bf16,o=f32", accumulate=False),
        "f16-dyn-cond": Variant("p=f32,c=f16,o=f32", jmp_lite.DynamicLossScale(2.0**15), "cond"),
        "f16-dyn-select": Variant("p=f32,c=f16,o=f32", jmp_lite.DynamicLossScale(2.0**15), "select"),
        "f16-none": Variant("p=f32,c=f16,o=f32"),
    }[name]


def make_step(model: Any, v: Variant) -> tuple[Callable, optax.GradientTransformation]:
    adam = optax.adam(3e-4)
    tx = adam if v.loss_scale is None else jmp_lite.loss_scaling(adam, v.loss_scale, skip=v.skip)

    def step(state: tuple, batch: jax.Array) -> tuple:
        params, opt_state = state
        scale = jmp_lite.get_loss_scale(opt_state) if v.loss_scale is not None else jmp_lite.NoOpLossScale()

        def loss_fn(p: Any) -> jax.Array:
            logits = model.apply({"params": p}, batch[:, :-1])
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()
            return scale.scale(loss)

        grads = jax.grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return step, tx


def data(context: int, batch: int, batches: int) -> tuple[jax.Array, jax.Array]:
    """``batches`` training batches and one held-out batch of ``context + 1`` bytes each."""
    from jmp_lite._demo.corpus import stdlib_bytes

    text = stdlib_bytes(4_000_000)
    rng = np.random.default_rng(0)
    split = int(0.9 * len(text))
    starts = rng.integers(0, split - context - 1, (batches, batch))
    train = text[starts[..., None] + np.arange(context + 1)]
    held = rng.integers(split, len(text) - context - 1, batch)
    return jnp.asarray(train), jnp.asarray(text[held[:, None] + np.arange(context + 1)])


def build(name: str, size: str) -> dict:
    layers, width, heads, context, batch = SIZES[size]
    v = variant(name)
    model = apply_policy(GPT(layers, width, heads, context), v.policy, accumulate=v.accumulate)
    tokens = jnp.zeros((batch, context), jnp.int32)
    params = jax.jit(model.init)(jax.random.key(0), tokens)["params"]
    step, tx = make_step(model, v)
    state = (params, tx.init(params))
    precision = jax.default_matmul_precision("highest") if v.highest else contextlib.nullcontext()
    with precision:
        compiled, compile_s = _timing.compile_ahead(step, state, jnp.zeros((batch, context + 1), jnp.int32))
        evaluate = jax.jit(
            lambda p, b: optax.softmax_cross_entropy_with_integer_labels(
                model.apply({"params": p}, b[:, :-1]), b[:, 1:]
            ).mean()
        )
    return {
        "compiled": compiled,
        "state": state,
        "compile_s": compile_s,
        "evaluate": evaluate,
        "params": sum(a.size for a in jax.tree_util.tree_leaves(params)),
        "tokens": batch * context,
    }


def gpu_peak(name: str, size: str) -> int | None:
    """Peak bytes in use for one variant, measured in a fresh process (the counter never resets)."""
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    cmd = [sys.executable, __file__, "--size", size, "--peak-of", name]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    try:
        return int(out.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        print(f"peak for {name} failed: {out.stderr[-500:]}", file=sys.stderr)
        return None


def run(size: str, names: list[str], rounds: int, k: int, peak: bool) -> dict:
    built = {n: build(n, size) for n in names}
    batches, held = data(SIZES[size][3], SIZES[size][4], 64)
    runners = {n: (lambda s, i, c=b["compiled"]: c(s, batches[i % len(batches)])) for n, b in built.items()}
    states = {n: _timing.warm_up(runners[n], b["state"]) for n, b in built.items()}
    times = _timing.interleaved(runners, states, rounds, k)
    peak_flops = _timing.peak_flops()
    base = times["f32"] if "f32" in times else times[names[0]]
    rows = {}
    for n, b in built.items():
        flops = _timing.compiled_flops(b["compiled"])
        t = float(np.median(times[n]))
        ratio, lo, hi = _timing.paired_ratio(times[n], base)
        rows[n] = {
            "step_ms": 1e3 * t,
            "tokens_per_s": b["tokens"] / t,
            "ratio": ratio,
            "ci": [lo, hi],
            "mfu": None if flops is None else flops / t / peak_flops,
            "compiled_bytes": _timing.compiled_bytes(b["compiled"]),
            "peak_bytes": gpu_peak(n, size) if peak else None,
            "compile_s": b["compile_s"],
            "steps": 5 + rounds * k,
            "held_out_loss": float(b["evaluate"](states[n][0], held)),
        }
    params = next(iter(built.values()))["params"]
    return {"size": size, "params": params, "rounds": rounds, "k": k, "peak_flops": peak_flops, "rows": rows}


def table(result: dict) -> str:
    def mib(x: int | None) -> str:
        return "-" if x is None else f"{x / 2**20:.0f}"

    base = result["rows"].get("f32", {}).get("compiled_bytes")
    lines = [
        f"GPT-2 architecture, size {result['size']} ({result['params'] / 1e6:.1f}M params), Adam; "
        f"{result['rounds']} interleaved rounds x {result['k']} steps; calibrated peak "
        f"{result['peak_flops'] / 1e12:.2f} TFLOP/s (16-bit matmul, float32 accumulation)\n",
        "| variant | step (ms) | tokens/s | ratio to f32 [95% CI] | MFU | compiled MiB (ratio) "
        "| GPU peak MiB | compile (s) | held-out loss |",
        "|---|---:|---:|---|---:|---|---:|---:|---:|",
    ]
    for n, r in result["rows"].items():
        mem = r["compiled_bytes"]
        mem_ratio = "" if not (mem and base) else f" ({mem / base:.2f})"
        mfu = "-" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
        lines.append(
            f"| {n} | {r['step_ms']:.1f} | {r['tokens_per_s']:.0f} | {r['ratio']:.3f} "
            f"[{r['ci'][0]:.3f}, {r['ci'][1]:.3f}] | {mfu} | {mib(mem)}{mem_ratio} | {mib(r['peak_bytes'])} "
            f"| {r['compile_s']:.1f} | {r['held_out_loss']:.4f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--k", type=int, default=3, help="steps per timed round")
    parser.add_argument("--json", default=None)
    parser.add_argument("--peak-of", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.peak_of:  # subprocess mode: a few steps of one variant, then the device's peak bytes
        b = build(args.peak_of, args.size)
        batches, _ = data(SIZES[args.size][3], SIZES[args.size][4], 4)
        _timing.warm_up(lambda s, i: b["compiled"](s, batches[i % 4]), b["state"], 3)
        print(jax.devices()[0].memory_stats()["peak_bytes_in_use"])
        return
    env = _timing.environment()
    print(json.dumps(env), flush=True)
    names = args.variants.split(",")
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {VARIANTS}")
    on_gpu = jax.default_backend() == "gpu"
    result = run(args.size, names, args.rounds, args.k, peak=on_gpu)
    print(table(result), flush=True)
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"environment": env, "command": " ".join(sys.argv), **result}, f, indent=2)


if __name__ == "__main__":
    main()
