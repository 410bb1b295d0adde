"""What a fully sharded (FSDP) training step puts on the wire, per precision: a communication audit.

A GPT-2-architecture decoder (``lm.py``'s model) trained with Adam through
``jmp_lite.flax.linen.apply_policy(..., mesh=, fsdp_axis=)`` (the fp8-gather variant: through
``jmp_lite.distributed.fsdp`` with ``gather_dtype="float8_e4m3fn"``) on every device JAX has (8
virtual CPU devices unless ``XLA_FLAGS`` says otherwise). For each policy the script prints, read
from the lowered program of one jitted ``value_and_grad`` step (``jax.jit(...).lower``; what JAX hands
the compiler):

- bytes all-gathered (the parameters, in the gather dtype) and reduce-scattered / all-reduced (the
  gradients, in ``reduce_dtype``) per step, one device's share, and the dtypes of each;
- parameter bytes stored per device (the float32 shards and the replicated parameters), and the bytes
  the forward pass keeps for the backward on one device (read from ``jax.vjp``'s residuals), with the
  number of full (gathered) parameters among them: 0 when the backward gathers again;
- on a GPU also the compiled program's collective dtypes (XLA:CPU computes 16-bit all-gathers in float32
  in its compiled code, so on a CPU only the lowered program is evidence);
- the step time of each policy as a ratio to float32 FSDP (interleaved rounds, median, 95% bootstrap
  interval; ``benchmarks/README.md``).

    python benchmarks/fsdp.py --size tiny --rounds 10 --k 3
"""

from __future__ import annotations

import os
import sys

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", "") and os.environ.get(
    "JAX_PLATFORMS", "cpu"
).startswith("cpu"):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import argparse  # noqa: E402
import collections  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import environment, interleaved, paired_ratio  # noqa: E402
from lm import GPT, SIZES, data  # noqa: E402

from jmp_lite._src.tools.collectives import lowered_collectives  # noqa: E402
from jmp_lite.distributed import fsdp, fsdp_layout, shard_params  # noqa: E402
from jmp_lite.flax.linen import apply_policy  # noqa: E402

BF16 = "p=f32,c=bf16,o=f32"
POLICIES = {  # name: (policy, gather dtype)
    "f32": ("f32", None),
    "bf16": (BF16, None),
    "f16": ("p=f32,c=f16,o=f32", None),
    "fp8-gather": (BF16, "float8_e4m3fn"),  # bf16 compute, parameters gathered as E4M3 with their scales
}


def compiled_dtypes(compiled_text: str) -> dict[str, list[str]]:
    """The element types of the compiled program's all-gathers and reduce-scatters (HLO text)."""
    found: dict[str, set] = collections.defaultdict(set)
    for line in compiled_text.splitlines():
        for op in ("all-gather", "reduce-scatter", "all-reduce"):
            if f" {op}(" in line or f" {op}-start(" in line:
                match = re.search(r"=\s*\(?([a-z]+\d*)\[", line)
                if match:
                    found[op].add(match.group(1))
    return {op: sorted(d) for op, d in found.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="tiny", choices=sorted(SIZES))
    parser.add_argument("--batch", type=int, default=16, help="global batch (a multiple of the devices)")
    parser.add_argument("--variants", default="f32,bf16")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--k", type=int, default=3, help="steps per timed round")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    names = args.variants.split(",")
    unknown = sorted(set(names) - set(POLICIES))
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {sorted(POLICIES)}")

    n = jax.device_count()
    mesh = jax.make_mesh((n,), ("data",))
    layers, width, heads, context, _ = SIZES[args.size]
    model = GPT(layers, width, heads, context)
    tokens, _ = data(context, args.batch, 4 * args.rounds * args.k + 8)
    params = jax.jit(model.init)(jax.random.key(0), tokens[0, :, :-1])["params"]
    layout = fsdp_layout(params, mesh, "data")
    sharded = shard_params(params, mesh, "data")
    leaves = jax.tree.leaves(params)
    lays = jax.tree.leaves(layout, is_leaf=lambda x: hasattr(x, "dim"))
    stored = sum(x.nbytes // (n if lay.dim is not None else 1) for x, lay in zip(leaves, lays))
    n_sharded = sum(lay.dim is not None for lay in lays)

    def loss(p, b):
        logits = model.apply({"params": p}, b[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, b[:, 1:]).mean()

    env = environment()
    print(json.dumps(env))
    size = sum(x.size for x in leaves) / 1e6
    platform = jax.devices()[0].platform
    print(
        f"\nGPT-2 architecture, size {args.size} ({size:.1f}M params, {layers} layers, width {width}), "
        f"global batch {args.batch} x {context} tokens, FSDP over {n} {platform} devices: {n_sharded} of "
        f"{len(leaves)} parameters sharded; parameter bytes stored per device {stored / 2**20:.2f} MiB "
        "(float32 shards and replicated parameters)\n"
    )
    tx = optax.adam(3e-4)
    rows, runners, states = {}, {}, {}
    full_shapes = {tuple(x.shape) for x, lay in zip(leaves, lays) if lay.dim is not None}
    for name in names:
        policy, gather = POLICIES[name]
        if gather is None:  # the Linen front-end: each kernel gathered in its module's compute dtype
            sharded_model = apply_policy(model, policy, mesh=mesh, fsdp_axis="data")

            def step_loss(p, b, sharded_model=sharded_model):
                logits = sharded_model.apply({"params": p}, b[:, :-1])
                return optax.softmax_cross_entropy_with_integer_labels(logits, b[:, 1:]).mean()
        else:  # fsdp over autocast, every sharded parameter gathered in the chosen dtype
            step_loss = fsdp(loss, mesh, axis="data", policy=policy, gather_dtype=gather)
        grad = jax.value_and_grad(step_loss)
        lowered = jax.jit(grad).lower(sharded, tokens[0])
        # what the forward keeps for the backward, on one device; a gathered parameter among it would
        # be a full parameter's shape per device
        _, backward = jax.vjp(jax.jit(step_loss), sharded, tokens[0])
        kept = [r.addressable_shards[0].data for r in jax.tree.leaves(backward) if isinstance(r, jax.Array)]
        kept_bytes = sum(r.nbytes for r in kept)
        full_kept = sum(tuple(r.shape) in full_shapes for r in kept)
        found = lowered_collectives(lowered)
        by_op: dict[str, dict] = {}
        for c in found:
            entry = by_op.setdefault(c.op, {"bytes": 0, "dtypes": set()})
            entry["bytes"] += c.bytes
            entry["dtypes"].add(c.dtype)
        gathered = sum(c.bytes for c in found if c.op == "all_gather")
        row = {
            "kept_bytes": kept_bytes,
            "full_parameters_kept": full_kept,
            "gathered_bytes": gathered,
            "reduced_bytes": sum(c.bytes for c in found if c.op in ("reduce_scatter", "all_reduce")),
            "collectives": {
                op: {"bytes": e["bytes"], "dtypes": sorted(e["dtypes"])} for op, e in by_op.items()
            },
        }
        if jax.devices()[0].platform == "gpu":
            row["compiled"] = compiled_dtypes(lowered.compile().as_text())

        @jax.jit
        def train(state, b, grad=grad):
            p, opt = state
            _, g = grad(p, b)
            updates, opt = tx.update(g, opt, p)
            return optax.apply_updates(p, updates), opt

        states[name] = (sharded, tx.init(sharded))
        runners[name] = lambda state, i, train=train: train(state, tokens[i % len(tokens)])
        states[name] = runners[name](states[name], 0)  # compile outside the timing
        rows[name] = row
    times = interleaved(runners, states, args.rounds, args.k)
    base = names[0]
    print(
        f"| policy | all-gathered MB (dtypes) | ratio to {base} | reduce-scattered + all-reduced MB "
        f"(dtypes) | kept for the backward MB/device (full parameters among it) | step ms | "
        f"ratio to {base} [95% CI] |"
    )
    print("|---|---:|---:|---:|---:|---:|---|")
    for name in names:
        row = rows[name]
        ratio, lo, hi = paired_ratio(times[name], times[base])
        row.update(step_ms=float(np.median(times[name]) * 1e3), ratio=ratio, ci=(lo, hi))
        gather_dtypes = ",".join(row["collectives"].get("all_gather", {}).get("dtypes", []))
        reduce_dtypes = sorted(
            {
                d
                for op in ("reduce_scatter", "all_reduce")
                for d in row["collectives"].get(op, {}).get("dtypes", [])
            }
        )
        print(
            f"| {name} | {row['gathered_bytes'] / 1e6:.3f} ({gather_dtypes}) | "
            f"{row['gathered_bytes'] / rows[base]['gathered_bytes']:.3f} | "
            f"{row['reduced_bytes'] / 1e6:.3f} ({','.join(reduce_dtypes)}) | "
            f"{row['kept_bytes'] / 1e6:.3f} ({row['full_parameters_kept']}) | {row['step_ms']:.1f} | "
            f"{ratio:.3f} [{lo:.3f}, {hi:.3f}] |"
        )
        if "compiled" in row:
            print(f"|   compiled on the GPU | {row['compiled']} | | | | |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"environment": env, "command": " ".join(sys.argv), "rows": rows}, f, indent=1, default=str
            )


if __name__ == "__main__":
    main()
