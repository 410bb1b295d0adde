"""One attention training step (forward + backward) on the blockwise kernel vs today's policy path.

  today       the policy attention of ``jmp_lite.flax.nnx.attention(..., fused=False)``: einsum with
              float32-accumulating 16-bit matmuls (``jmp_lite.accumulate``), float32 softmax, einsum.
              Its backward pass keeps the T x T weights.
  blockwise   ``jmp_lite.attention.dot_product_attention(..., implementation="blockwise")``: online
              softmax over key blocks, its own backward pass, no T x T array anywhere.

Both are causal self-attention, as in the language model of ``benchmarks/lm.py``; the shapes are its
``--size tiny`` (batch 8, 4 heads of depth 64, T=256) and ``--size small`` (batch 16, 12 heads of
depth 64, T=1024) attention layers. A step is ``q, k, v -= 1e-3 * grad`` of a fixed random projection
of the output, jitted with the state donated and compiled ahead. Variants run in interleaved rounds
and the ratio blockwise / today is the median of per-round ratios with a 95% bootstrap interval
(benchmarks/README.md). The table also shows the bytes each step keeps for its backward pass (JAX's
saved residuals, counted before XLA runs).

    MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TRIM_THRESHOLD_=4294967296 \\
        python benchmarks/attention.py --rounds 20 --k 3
    python benchmarks/attention.py --shapes check --rounds 2 --k 1   # seconds: does it run
    python benchmarks/attention.py --residuals-only                   # bytes only, no timing
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax._src.ad_checkpoint import (
    saved_residuals,
)  # the function behind jax.ad_checkpoint.print_saved_residuals

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _timing  # noqa: E402

from jmp_lite.attention import dot_product_attention  # noqa: E402
from jmp_lite.flax import nnx as jnnx  # noqa: E402

with warnings.catch_warnings():  # the baseline is the deprecated pre-engine path, measured as it was
    warnings.simplefilter("ignore", DeprecationWarning)
    plain_attention = jnnx.attention

SHAPES = {  # batch, length, heads, depth
    "tiny": (8, 256, 4, 64),
    "small": (16, 1024, 12, 64),
    "check": (2, 64, 2, 16),
}
DTYPES = {"bf16": jnp.bfloat16, "f32": jnp.float32}


def attention_fn(name: str, block_q: int | None, block_k: int | None) -> Callable:
    if name == "today":
        return lambda q, k, v: plain_attention(q, k, v, is_causal=True, fused=False)
    return lambda q, k, v: dot_product_attention(
        q, k, v, is_causal=True, implementation="blockwise", block_q=block_q, block_k=block_k
    )


def make_step(attn: Callable) -> Callable:
    def loss(q: jax.Array, k: jax.Array, v: jax.Array, w: jax.Array) -> jax.Array:
        return jnp.sum(attn(q, k, v).astype(jnp.float32) * w)

    def step(state: tuple, w: jax.Array) -> tuple:
        grads = jax.grad(loss, argnums=(0, 1, 2))(*state, w)
        return tuple((x - 1e-3 * g.astype(jnp.float32)).astype(x.dtype) for x, g in zip(state, grads))

    return step


def residual_bytes(attn: Callable, state: tuple) -> int:
    """Bytes JAX keeps for the backward pass of the attention itself (q, k, v included)."""
    return sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a, _ in saved_residuals(attn, *state))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shapes", default="tiny,small", help=f"comma-separated, of {sorted(SHAPES)}")
    parser.add_argument("--dtypes", default="bf16,f32", help=f"comma-separated, of {sorted(DTYPES)}")
    parser.add_argument("--block-q", type=int, default=None, help="blockwise query block (library default)")
    parser.add_argument("--block-k", type=int, default=None, help="blockwise key block (library default)")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--k", type=int, default=3, help="steps per timed round")
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--residuals-only", action="store_true", help="print the residual bytes, time nothing"
    )
    args = parser.parse_args()
    env = _timing.environment()
    print(json.dumps(env), flush=True)

    rows: list[dict[str, Any]] = []
    if args.residuals_only:
        print("\n| shape (B,T,H,D) | dtype | variant | residual MB |\n|---|---|---|---:|")
    for shape_name in args.shapes.split(","):
        b, t, h, d = SHAPES[shape_name]
        for dtype_name in args.dtypes.split(","):
            dtype = DTYPES[dtype_name]
            keys = jax.random.split(jax.random.key(0), 4)
            state = tuple(jax.random.normal(k, (b, t, h, d)).astype(dtype) for k in keys[:3])
            w = jax.random.normal(keys[3], (b, t, h, d))
            runners, states, info = {}, {}, {}
            if args.residuals_only:
                for name in ("today", "blockwise"):
                    mb = residual_bytes(attention_fn(name, args.block_q, args.block_k), state) / 2**20
                    print(
                        f"| {shape_name} ({b},{t},{h},{d}) | {dtype_name} | {name} | {mb:.1f} |", flush=True
                    )
                continue
            for name in ("today", "blockwise"):
                attn = attention_fn(name, args.block_q, args.block_k)
                step = make_step(attn)
                compiled, seconds = _timing.compile_ahead(step, state, w)
                fresh = tuple(jnp.array(x) for x in state)  # the compiled step donates its input
                runners[name] = lambda s, i, c=compiled, w=w: c(s, w)
                states[name] = _timing.warm_up(runners[name], fresh)
                info[name] = {"compile_s": seconds, "residual_bytes": residual_bytes(attn, state)}
            times = _timing.interleaved(runners, states, args.rounds, args.k)
            ratio, lo, hi = _timing.paired_ratio(times["blockwise"], times["today"])
            for name in ("today", "blockwise"):
                rows.append({
                    "shape": shape_name, "B,T,H,D": f"{b},{t},{h},{d}", "dtype": dtype_name, "variant": name,
                    "median_ms": 1e3 * float(np.median(times[name])),
                    "ratio": ratio if name == "blockwise" else 1.0,
                    "ci": (lo, hi) if name == "blockwise" else None,
                    **info[name], "times_s": times[name].tolist(),
                })  # fmt: skip

    if args.residuals_only:
        return
    print(f"\nCausal self-attention step (forward + backward), {args.rounds} interleaved rounds x {args.k}\n")
    print(
        "| shape (B,T,H,D) | dtype | variant | step ms | ratio to today | 95% CI | residual MB | compile s |"
    )
    print("|---|---|---|---:|---:|---|---:|---:|")
    for r in rows:
        ci = "" if r["ci"] is None else f"[{r['ci'][0]:.3f}, {r['ci'][1]:.3f}]"
        print(
            f"| {r['shape']} ({r['B,T,H,D']}) | {r['dtype']} | {r['variant']} | {r['median_ms']:.2f} | "
            f"{r['ratio']:.3f} | {ci} | {r['residual_bytes'] / 2**20:.1f} | {r['compile_s']:.1f} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": env, "args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
