"""Gradient all-reduce dtype: bytes communicated vs accuracy (docs/distributed.md).

Trains examples/data_parallel.py's digits MLP with shard_map on 8 CPU devices,
float16 compute and dynamic loss scaling, reducing gradients in float32,
bfloat16 or float16, over several seeds. Reports test accuracy, final loss,
the largest parameter difference from the float32-reduced run, and the bytes
each step all-reduces, read from the lowered program.

    python benchmarks/reduce_dtype.py --seeds 3 --steps 300
"""

from __future__ import annotations

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import argparse  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from data_parallel import train  # noqa: E402
from quickstart import init_params  # noqa: E402

import jmp_lite  # noqa: E402

BYTES = {"f32": 4, "bf16": 2, "f16": 2}


def all_reduce_bytes(reduce_dtype: str | None) -> int:
    """Bytes per device that one step's gradient all-reduce carries, as lowered."""
    mesh = Mesh(np.array(jax.devices()), ("d",))
    params = init_params(jax.random.key(0), (64, 256, 256, 10))
    f = jax.shard_map(
        lambda g: jmp_lite.reduce_gradients(g, "d", reduce_dtype=reduce_dtype),
        mesh=mesh,
        in_specs=P(),
        out_specs=P(),
    )
    text = jax.jit(f).lower(params).as_text()
    total = 0
    for dims, dtype in re.findall(
        r'"stablehlo\.all_reduce".*?\}\) : \(tensor<([0-9x]*?)x?(bf16|f16|f32)>', text, re.S
    ):
        total += int(np.prod([int(d) for d in dims.split("x") if d])) * BYTES[dtype]
    return total


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    print(
        f"jax {jax.__version__}, {jax.device_count()} {jax.devices()[0].platform} devices, {args.steps} steps"
    )
    print(
        "\n| all-reduce dtype | bytes all-reduced per step | test accuracy % (mean ± std) "
        "| final loss (mean) | max abs param diff vs f32 reduce | skipped steps |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    reference = {}
    for dtype in (None, "bf16", "f16"):
        accs, losses, diffs, skipped = [], [], [], []
        for seed in range(args.seeds):
            r = train("shard_map", args.steps, 256, "p=f32,c=f16,o=f32", dtype, seed, log_every=0)
            accs.append(100 * r["test_accuracy"])
            losses.append(r["final_loss"])
            skipped.append(r["skipped"])
            leaves = [np.asarray(x) for x in jax.tree_util.tree_leaves(r["params"])]
            if dtype is None:
                reference[seed] = leaves
            diffs.append(max(float(np.max(np.abs(a - b))) for a, b in zip(leaves, reference[seed])))
        print(
            f"| {dtype or 'f32 (gradient dtype)'} | {all_reduce_bytes(dtype):,} "
            f"| {np.mean(accs):.2f} ± {np.std(accs):.2f} "
            f"| {np.mean(losses):.4f} | {max(diffs):.2e} | {sum(skipped)} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
