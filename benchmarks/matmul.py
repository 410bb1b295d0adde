"""A raw 2048 x 2048 x 2048 matmul per dtype: what the CPU (or GPU) itself gains from 16 bits.

  f32            float32 x float32 -> float32
  bf16->f32      bfloat16 x bfloat16, float32 accumulation and result (what the bf16 policy runs)
  bf16           bfloat16 x bfloat16 -> bfloat16
  f16->f32       float16 x float16, float32 accumulation and result

Ratios are to f32 from interleaved rounds (benchmarks/README.md). The first JSON line names
the CPU and whether it has AMX (``amx_bf16``) and AVX512-BF16 (``avx512_bf16``), the two
flags that decide whether XLA:CPU has a fast bfloat16 matmul.

    MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TRIM_THRESHOLD_=4294967296 \\
        python benchmarks/matmul.py --rounds 20 --k 3
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _timing  # noqa: E402

VARIANTS = {  # operand dtype, preferred_element_type
    "f32": (jnp.float32, None),
    "bf16->f32": (jnp.bfloat16, jnp.float32),
    "bf16": (jnp.bfloat16, None),
    "f16->f32": (jnp.float16, jnp.float32),
}


def cpu_flags() -> list[str]:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next(line.split(":", 1)[1].split() for line in f if line.startswith("flags"))
    except (OSError, StopIteration):
        return []
    return sorted(set(flags) & {"amx_bf16", "amx_tile", "avx512_bf16", "avx512_fp16", "avx512f"})


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--n", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--k", type=int, default=3)
    args = parser.parse_args()
    env = _timing.environment()
    env["cpu_flags"] = cpu_flags()
    print(json.dumps(env), flush=True)
    a = jax.random.normal(jax.random.key(0), (args.n, args.n))
    runners, states = {}, {}
    for name, (dtype, pet) in VARIANTS.items():
        x = a.astype(dtype)
        f = jax.jit(lambda x, pet=pet: jax.lax.dot(x, x, preferred_element_type=pet))
        runners[name] = lambda s, i, f=f, x=x: f(x)
        states[name] = _timing.warm_up(runners[name], x)
    times = _timing.interleaved(runners, states, args.rounds, args.k)
    print(f"\n{args.n}^3 matmul, {args.rounds} interleaved rounds x {args.k}\n")
    print("| variant | median (ms) | ratio to f32 | 95% CI |")
    print("|---|---:|---:|---|")
    for name in VARIANTS:
        ratio, lo, hi = _timing.paired_ratio(times[name], times["f32"])
        print(f"| {name} | {1e3 * float(np.median(times[name])):.1f} | {ratio:.3f} | [{lo:.3f}, {hi:.3f}] |")


if __name__ == "__main__":
    main()
