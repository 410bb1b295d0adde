"""Compiled programs of GPT-2 training steps for TPU and NVIDIA targets, compiled here without them.

One training step (``value_and_grad`` of the next-token loss and an Adam update, parameters and
optimizer state donated) of a GPT-2-style Flax Linen decoder (``jmp-lite plan``'s built-in model:
``nn.MultiHeadDotProductAttention`` with a causal mask, tied embedding, vocabulary 50257, T = 1024,
batch 8), compiled by ``jmp_lite.memory.plan`` for each target. Per device: peak and temporary bytes,
contractions by dtype (float32 islands), collectives by kind and dtype, library calls; and, for the
one-device targets, the traced residual bytes (``jmp_lite.memory.residual_bytes``) beside them.

Setups: ``float32``; ``bf16-cast``, the parameters cast to bfloat16 by hand before the model;
``bf16-jmp``, jmp's recipe: the parameters cast to bfloat16 and the logits back to float32 for the loss;
``bf16``, the policy ``p=f32,c=bf16,o=f32`` through ``jmp_lite.autocast``; a setup ending in ``-linen``
(``bf16-linen``, ``fsdp-linen``) is that setup through ``jmp_lite.flax.linen.apply_policy`` (Flax's
front-end); ``fp8`` (``hybrid,current``);
``int8-state`` (the bf16 policy with 8-bit Adam moments); and, on targets of several devices,
``fsdp-float32`` and ``fsdp`` (bf16). On request, the lean loss
(``jmp_lite.losses.fused_linear_cross_entropy`` from the last hidden states and the tied embedding, no
``[tokens, vocabulary]`` logits): ``fused-float32`` (the float32 model), ``fused-bf16`` (bfloat16
operands, through autocast) and ``fused-bf16-linen``; ``bf16-recompute`` (``recompute="wide_contractions"``:
the MLP's up-projection rebuilt in the backward pass), ``bf16-recompute-linen``, ``fused-bf16-recompute`` and
``fused-bf16-recompute-linen``; and the bf16 policy with the engine's defaults
switched off, to weigh them: ``bf16-attention-off`` (``attention=False``: the program's own attention),
``bf16-remat-off`` (``remat_float32=False``: no 16-bit checkpoint) and ``bf16-both-off``; and
``fsdp-ring`` / ``fsdp-ring-linen``, the fsdp setup with its gradients reduce-scattered on a ring
(``reduce_scatter="ring"``: neighbour exchanges, ``lax.ppermute``) instead of by the compiler's collective.

    python benchmarks/compiled.py --size small --targets v5e,h100
    python benchmarks/compiled.py --size fsdp --targets v5e:2x2,v5e:4x4,v5e:16x16,h100:1x1x8 \\
        --variants fsdp-float32,fsdp,fsdp-linen
    python benchmarks/compiled.py --dry-run        # a 2-layer model, seconds per compile
    python benchmarks/compiled.py --size small --targets v5e --variants float32,bf16-linen --peak 8

``--peak N`` prints, per setup, the N largest groups of temporaries live where the program's heap of
temporaries peaks, each with the operation that made it (``compiled(..., peak_values=True)``).

Needs the ``aot`` extra (``pip install -e ".[aot]"``). Compiling GPT-2 small takes minutes per setup
for a TPU and seconds for an H100 on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the compile-only targets need no backend of their own

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _timing  # noqa: E402

import jmp_lite  # noqa: E402
from jmp_lite._demo.gpt import fused_next_token_loss, gpt_model, gpt_workload, next_token_loss  # noqa: E402
from jmp_lite.amp import autocast  # noqa: E402
from jmp_lite.flax.linen import apply_policy  # noqa: E402
from jmp_lite.memory import compile_only_target, plan, residual_bytes  # noqa: E402

SIZES = {  # layers, width, heads, context, vocab, batch
    "small": (12, 768, 12, 1024, 50257, 8),
    "medium": (24, 1024, 16, 1024, 50257, 8),
    "fsdp": (4, 768, 12, 1024, 50257, 8),  # GPT-2 small's width, 4 layers: FSDP's collectives
    "stock": (4, 512, 8, 512, 32000, 8),  # a small Flax Linen GPT as a new user writes one
    "dry": (2, 128, 4, 128, 1000, 8),
}
POLICY = "p=f32,c=bf16,o=f32"


def traced(workload: object) -> dict[str, int]:
    """Residual bytes of the loss's gradient, by tracing (no compile), for float32, cast and policy."""
    loss, params, batch = workload.loss, workload.params, workload.batch
    cast = jmp_lite.get_policy(POLICY).cast_to_compute
    return {
        "float32": residual_bytes(loss, params, *batch, argnums=0).total,
        "bf16-cast": residual_bytes(lambda p, *b: loss(cast(p), *b), params, *batch, argnums=0).total,
        "bf16": residual_bytes(autocast(loss, POLICY), params, *batch, argnums=0).total,
    }


def gb(n: float) -> str:
    return f"{n / 1e9:.2f}"


def _ratio(report: dict, base: dict, key: str) -> str:
    return f"{report[key] / base[key]:.2f}x" if base else "-"  # "-": float32 did not fit


def tables(paths: list[str]) -> str:
    """RESULTS.md's tables from the JSON files of earlier runs (``--json``)."""
    out = []
    for path in paths:
        with open(path) as f:
            run = json.load(f)
        for name, target in run["targets"].items():
            reports = target["reports"]
            base = reports.get("float32") or reports.get("fsdp-float32") or {}
            batch = target.get("batch", SIZES[run["size"]][5])  # runs before per-target batches: the size's
            chips = f"{target['devices']} x {target['device_kind']}, batch {batch}"
            out.append(f"\n{run['size']} on {name} ({chips}): `{run['command']}`\n")
            # neighbour exchanges (fsdp's reduce_scatter="ring") get a column where a setup has them
            permute = any("collective_permute" in k for r in reports.values() for k in r["collective_bytes"])
            out.append(
                "| setup | temp GB | vs float32 | peak GB | vs float32 | arguments GB | contractions "
                "| all-gather MB (dtype) | reduce-scatter MB | all-reduce MB |"
                + (" collective-permute MB |" if permute else "")
                + " library calls |"
            )
            out.append("|---|---:|---:|---:|---:|---:|---|---|---:|---:|" + "---:|" * permute + "---|")
            for setup, r in reports.items():
                wire: dict = {}
                for key, n in r["collective_bytes"].items():
                    op, dtype = key.split(" ")
                    wire.setdefault(op, {})[dtype] = n
                mb = {op: sum(by_dtype.values()) / 1e6 for op, by_dtype in wire.items()}
                gathers = ", ".join(
                    f"{n / 1e6:.0f} {d}" for d, n in sorted(wire.get("all_gather", {}).items())
                )
                calls = ", ".join(
                    f"{k} {n}" for k, n in r["custom_calls"].items() if "cudnn" in k or "f8" in k
                )
                counts = ", ".join(f"{k}: {n}" for k, n in r["contraction_counts"].items())
                out.append(
                    f"| {setup} | {gb(r['temp_bytes'])} | {_ratio(r, base, 'temp_bytes')} "
                    f"| {gb(r['peak_bytes'])} | {_ratio(r, base, 'peak_bytes')} "
                    f"| {gb(r['argument_bytes'])} | {counts} | {gathers or '0'} "
                    f"| {mb.get('reduce_scatter', 0):.0f} | {mb.get('all_reduce', 0):.0f} |"
                    + (f" {mb.get('collective_permute', 0):.0f} |" if permute else "")
                    + f" {calls} |"
                )
            for setup, why in target.get("does_not_fit", {}).items():
                out.append(f"| {setup} | does not fit: {why} | | | | | | | | | |")
        if "traced_residual_bytes" in run:
            traced = run["traced_residual_bytes"]
            out.append(
                "\ntraced residual bytes (`residual_bytes`, no compile): "
                + ", ".join(f"{k} {gb(v)} GB ({v / traced['float32']:.3f}x)" for k, v in traced.items())
            )
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="small", choices=sorted(SIZES))
    parser.add_argument("--targets", default="v5e,h100")
    parser.add_argument("--variants", default="float32,bf16-cast,bf16-jmp,bf16,bf16-linen,fp8,int8-state")
    parser.add_argument("--batch", type=int, default=None, help="sequences per step (default: the size's)")
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--peak", type=int, default=0, metavar="N",
        help="print the N largest groups of temporaries live at each program's peak (slower compiles)",
    )  # fmt: skip
    parser.add_argument("--dry-run", action="store_true", help="a tiny model, h100 only, four setups")
    parser.add_argument(
        "--remat",
        action="store_true",
        help="each block under nn.remat (the user's own checkpointing), every setup",
    )
    parser.add_argument(
        "--tables", nargs="+", metavar="JSON", help="print RESULTS.md's tables of earlier runs"
    )
    args = parser.parse_args()
    if args.tables:
        print(tables(args.tables))
        return
    if args.dry_run:
        args.size, args.targets, args.variants = "dry", "h100", "float32,bf16-jmp,bf16,bf16-linen"
    layers, width, heads, context, vocab, batch = SIZES[args.size]
    batch = args.batch or batch
    # plan's bf16 and fsdp setups through autocast here; the -linen ones through Flax's front-end
    workload = gpt_workload(layers, width, heads, context, vocab, batch, args.remat)._replace(
        under_policy=None
    )
    env = _timing.environment()
    print(json.dumps(env))
    n_params = sum(x.size for x in jax.tree.leaves(workload.params))
    print(
        f"\nGPT-2-style Linen decoder, {args.size}: {n_params / 1e6:.1f}M parameters ({layers} layers, width "
        f"{width}, {heads} heads, vocabulary {vocab}), batch {batch} x {context} tokens, Adam; setups "
        f"{args.variants}{'; every block under nn.remat' if args.remat else ''}\n"
    )
    results: dict = {"environment": env, "command": " ".join(sys.argv), "size": args.size, "targets": {}}
    variants = tuple(args.variants.split(","))
    model = gpt_model(layers, width, heads, context, vocab, args.remat)
    cast = jmp_lite.get_policy(POLICY).cast_to_compute

    def jmp_recipe(p, t):  # jmp's README: cast the parameters to compute, the output to float32
        logits = model.apply({"params": cast(p)}, t[:, :-1]).astype("float32")
        return optax.softmax_cross_entropy_with_integer_labels(logits, t[:, 1:]).mean()

    def fused_under_policy(policy, **options):  # the lean loss of the model under apply_policy
        return fused_next_token_loss(apply_policy(model, policy, **options), dtype=jnp.bfloat16)

    def autocast_with(**switches):  # the bf16 policy with the engine's defaults switched off
        return lambda loss: lambda policy, **options: autocast(loss, policy, **switches, **options)

    def linen_with(**switches):  # the same through Flax's front-end
        return lambda loss: (
            lambda policy, **options: next_token_loss(apply_policy(model, policy, **switches, **options))
        )

    # setups that are another loss, or the loss under other engine options: (loss, plan's setup,
    # under_policy(loss) or None); loss None: the workload's; "float32": the loss as written
    extra = {
        "bf16-jmp": (jmp_recipe, "float32", None),
        "fused-float32": (fused_next_token_loss(model), "float32", None),
        "fused-bf16": (fused_next_token_loss(model, dtype=jnp.bfloat16), "bf16", None),
        "fused-bf16-linen": (fused_next_token_loss(model), "bf16", lambda loss: fused_under_policy),
        "fused-bf16-recompute": (fused_next_token_loss(model, dtype=jnp.bfloat16), "bf16-recompute", None),
        "fused-bf16-recompute-linen": (
            fused_next_token_loss(model),
            "bf16-recompute",
            lambda loss: fused_under_policy,
        ),
        "bf16-attention-off": (None, "bf16", autocast_with(attention=False)),
        "bf16-remat-off": (None, "bf16", autocast_with(remat_float32=False)),
        "bf16-both-off": (None, "bf16", autocast_with(attention=False, remat_float32=False)),
        "fsdp-ring": (None, "fsdp", autocast_with(reduce_scatter="ring")),
        "fsdp-ring-linen": (None, "fsdp", linen_with(reduce_scatter="ring")),
    }
    planned = tuple(v for v in variants if v not in extra and not v.endswith("-linen"))
    for name in args.targets.split(","):
        target = compile_only_target(name)
        start = time.perf_counter()
        # FSDP splits the batch along the devices: at least one sequence each
        per_target = -(-batch // len(target.devices)) * len(target.devices)
        if per_target != batch:
            print(f"(batch {per_target} on {target.name}: a whole number of sequences per device)")
        made = gpt_workload(layers, width, heads, context, vocab, per_target, args.remat)
        workload, linen = made._replace(under_policy=None), made.under_policy  # linen: Flax's front-end
        progress = lambda m: print("  " + m, file=sys.stderr, flush=True)  # noqa: E731
        common = dict(
            target=target, optimizer=workload.optimizer, policy=POLICY, progress=progress,
            peak_values=args.peak > 0,
        )  # fmt: skip
        result = plan(workload.loss, workload.params, *workload.batch, variants=planned, **common)
        for variant in (v for v in variants if v in extra):
            loss, setup, under = extra[variant]
            loss = workload.loss if loss is None else loss
            under = None if under is None else under(loss)
            other = plan(
                loss, workload.params, *workload.batch, variants=(setup,), under_policy=under, **common
            )
            if setup in other.does_not_fit:
                result.does_not_fit[variant] = other.does_not_fit[setup]
            elif setup in other.skipped:  # fsdp on one device
                result.skipped[variant] = other.skipped[setup]
            else:
                result.reports[variant] = other.reports[setup]
        through_linen = tuple(
            v.removesuffix("-linen") for v in variants if v.endswith("-linen") and v not in extra
        )
        if through_linen:
            other = plan(workload.loss, workload.params, *workload.batch, variants=through_linen,
                         under_policy=linen, **common)  # fmt: skip
            result.reports.update({f"{v}-linen": r for v, r in other.reports.items()})
            result.does_not_fit.update({f"{v}-linen": w for v, w in other.does_not_fit.items()})
        result.reports.update({v: result.reports.pop(v) for v in variants if v in result.reports})
        print(result.table())
        for variant, report in result.reports.items():
            print(f"\n{variant}:\n{report.table()}")
            if args.peak:
                print(report.peak_table(args.peak))
        print(f"\n({time.perf_counter() - start:.0f} s for {target.name})\n")
        results["targets"][target.name] = {**result.to_dict(), "batch": per_target}
    if len(compile_only_target(args.targets.split(",")[0]).devices) == 1:
        counts = traced(workload)
        results["traced_residual_bytes"] = counts
        print("traced residual bytes (residual_bytes, no compile):")
        for k, v in counts.items():
            print(f"  {k}: {v / 1e9:.2f} GB ({v / counts['float32']:.3f}x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
