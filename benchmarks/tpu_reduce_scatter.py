"""Which gradient reduce-scatters XLA:TPU keeps, compiled for TPU v5e slices without the hardware.

FSDP writes each sharded parameter's gradient as a reduce-scatter (``lax.psum_scatter``). XLA:TPU's
reduce-scatter decomposer rewrites some of them, after layout assignment, as an all-reduce of the whole
gradient followed by a slice: twice the bytes on the wire, and the whole float32 gradient on every chip.
This compiles one reduce-scatter per shape (a ``shard_map`` over all of the slice's chips, one axis,
float32) and prints what the compiled program holds instead. The shapes are GPT-2 small's parameters
with the dimension fsdp splits, and plain 2-d blocks.

    python benchmarks/tpu_reduce_scatter.py --targets v5e:2x2,v5e:4x4

Needs the ``aot`` extra (libtpu). About 1 s per shape on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the compile-only targets need no backend of their own

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _timing  # noqa: E402

from jmp_lite.memory import compile_only_target, compiled  # noqa: E402

# (what, shape, the dimension fsdp splits)
SHAPES = (
    ("MLP kernel 768 x 3072", (768, 3072), 0),
    ("MLP kernel 3072 x 768", (3072, 768), 0),
    ("attention out kernel 12 x 64 x 768", (12, 64, 768), 1),
    ("heads-split q/k/v kernel 768 x 12 x 64", (768, 12, 64), 1),
    ("the same, split along 768", (768, 12, 64), 0),
    ("the same, split along 64", (768, 12, 64), 2),
    ("tied embedding 50257 x 768", (50257, 768), 1),
    ("position embedding 1024 x 768", (1024, 768), 0),
)


def kept(target: object, shape: tuple, dim: int) -> str:
    """What the compiled program does with ``psum_scatter`` of a float32 ``shape`` along ``dim``."""
    mesh = target.mesh(("data",))
    n = len(target.devices)
    if shape[dim] % n:
        return f"not split ({shape[dim]} % {n})"
    spec = P(*["data" if i == dim else None for i in range(len(shape))])

    def step(g: jax.Array, x: jax.Array) -> jax.Array:
        def body(g: jax.Array, x: jax.Array) -> jax.Array:  # a gradient computed on each chip
            return jax.lax.psum_scatter(jnp.tanh(g * x[0]), "data", scatter_dimension=dim, tiled=True)

        return jax.shard_map(body, mesh=mesh, in_specs=(P(), P("data")), out_specs=spec, check_vma=False)(
            g, x
        )

    g = jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, P()))
    x = jax.ShapeDtypeStruct((n,), jnp.float32, sharding=NamedSharding(mesh, P("data")))
    report = compiled(step, g, x, target=target)
    ops = sorted({c.op for c in report.collectives if c.bytes > 1024})
    return " + ".join(ops) or "none"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--targets", default="v5e:2x2,v5e:4x4")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    env = _timing.environment()
    print(json.dumps(env))
    rows: dict = {}
    for name in args.targets.split(","):
        target = compile_only_target(name)
        for what, shape, dim in SHAPES:
            rows.setdefault(what, {"shape": shape, "dim": dim})[name] = kept(target, shape, dim)
    names = args.targets.split(",")
    print("\n| gradient | shape | split dim | " + " | ".join(names) + " |")
    print("|---|---|---:|" + "---|" * len(names))
    for what, row in rows.items():
        cells = " | ".join(row[n] for n in names)
        print(f"| {what} | {' x '.join(map(str, row['shape']))} | {row['dim']} | {cells} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": env, "command": " ".join(sys.argv), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
