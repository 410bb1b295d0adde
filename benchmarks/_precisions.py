"""The precision variants that lm.py and resnet.py compare, the side-by-side run, and the memory table."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import _timing
import jax
import numpy as np
import optax

import jmp_lite


@dataclass(frozen=True)
class Variant:
    policy: str
    loss_scale: Any = None
    skip: str = "auto"
    highest: bool = False
    accumulate: bool = True
    fp8: str | None = None  # an fp8 recipe for apply_policy(..., fp8=)
    fp8_update: bool = True  # False: the delayed-scaling state is never updated (every scale stays 1)
    attention: bool = True  # False: attention runs as written, not as the blockwise kernel (lm.py only)


F16 = "p=f32,c=f16,o=f32"
BF16 = "p=f32,c=bf16,o=f32"
# fp8 variants (lm.py only): hybrid formats (E4M3 forward, E5M2 gradients) over the bf16 policy; the
# delayed recipe is TransformerEngine's default (history 1024, margin 0). fp8-unscaled keeps a delayed
# state that is never updated, so every tensor is cast with scale 1: what fp8 without scaling gives.
# fp8-block scales per tile (1x128 activations and gradients, 128x128 weights; DeepSeek-V3) and keeps
# no state.
FP8_VARIANTS = ("fp8-current", "fp8-delayed", "fp8-unscaled", "fp8-block")
VARIANTS = {
    "f32-highest": Variant("f32", highest=True),  # true float32 matmuls on NVIDIA GPUs
    "f32": Variant("f32"),  # default precision: TF32 on NVIDIA GPUs
    "bf16": Variant("p=f32,c=bf16,o=f32"),
    "bf16-noacc": Variant("p=f32,c=bf16,o=f32", accumulate=False),
    "bf16-noattn": Variant("p=f32,c=bf16,o=f32", attention=False),
    "f16-dyn-cond": Variant(F16, jmp_lite.DynamicLossScale(2.0**15), "cond"),
    "f16-dyn-select": Variant(F16, jmp_lite.DynamicLossScale(2.0**15), "select"),
    "f16-none": Variant(F16),
    "fp8-current": Variant(BF16, fp8="hybrid,current"),
    "fp8-delayed": Variant(BF16, fp8="hybrid,delayed"),
    "fp8-unscaled": Variant(BF16, fp8="hybrid,delayed", fp8_update=False),
    "fp8-block": Variant(BF16, fp8="hybrid,block"),
}


def make_step(loss_fn: Callable, v: Variant, learning_rate: float) -> tuple[Callable, Any]:
    """A train step over ``(params, model_state, opt_state)``; ``loss_fn(params, model_state, batch)``
    returns ``(loss, new_model_state)``. A skipped float16 step keeps the model state too. With delayed
    fp8 scaling ``model_state["fp8"]`` holds the fp8 states: differentiated along with the parameters
    (their gradient is the observed amaxes) and updated by ``jmp_lite.fp8.update_fp8_state``."""
    adam = optax.adam(learning_rate)
    tx = adam if v.loss_scale is None else jmp_lite.loss_scaling(adam, v.loss_scale, skip=v.skip)

    def step(state: tuple, batch: Any) -> tuple:
        params, model_state, opt_state = state
        scale = jmp_lite.get_loss_scale(opt_state) if v.loss_scale is not None else jmp_lite.NoOpLossScale()
        fp8 = model_state.get("fp8") if isinstance(model_state, dict) else None

        def scaled(p: Any, fp8: Any) -> tuple:
            loss, new_model_state = loss_fn(
                p, model_state if fp8 is None else {**model_state, "fp8": fp8}, batch
            )
            return scale.scale(loss), new_model_state

        (grads, observed), new_model_state = jax.grad(scaled, argnums=(0, 1), has_aux=True)(params, fp8)
        updates, opt_state = tx.update(grads, opt_state, params)
        finite = None
        if v.loss_scale is not None:
            finite = jmp_lite.get_loss_scaling_state(opt_state).last_grads_finite
            new_model_state = jmp_lite.select_tree(finite, new_model_state, model_state)
        if fp8 is not None and v.fp8_update:
            new_fp8 = jmp_lite.fp8.update_fp8_state(fp8, observed, v.fp8, finite=finite)
            new_model_state = {**new_model_state, "fp8": new_fp8}
        return optax.apply_updates(params, updates), new_model_state, opt_state

    return step, tx


def precision_scope(v: Variant) -> Any:
    return jax.default_matmul_precision("highest") if v.highest else contextlib.nullcontext()


def peaks(script: str, size: str) -> Callable[[str], int | None] | None:
    """On a GPU, the per-variant peak-bytes probe for ``side_by_side``; elsewhere None."""
    if jax.default_backend() != "gpu":
        return None
    return lambda name: gpu_peak(script, name, size)


def report_peak(built: dict, batches: list) -> None:
    """``--peak-of`` mode: three steps of one variant, then print the device's peak bytes."""
    _timing.warm_up(lambda s, i: built["compiled"](s, batches[i % len(batches)]), built["state"], 3)
    print(jax.devices()[0].memory_stats()["peak_bytes_in_use"])


def write_json(path: str | None, env: dict, result: dict) -> None:
    if path:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w") as f:
            json.dump({"environment": env, "command": " ".join(sys.argv), **result}, f, indent=2)


def gpu_peak(script: str, name: str, size: str) -> int | None:
    """Peak bytes in use for one variant, in a fresh process (the device's counter never resets)."""
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    cmd = [sys.executable, script, "--size", size, "--peak-of", name]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    try:
        return int(out.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        print(f"peak for {name} failed: {out.stderr[-500:]}", file=sys.stderr)
        return None


def side_by_side(
    built: dict[str, dict],
    batches: list,
    rounds: int,
    k: int,
    evaluate: Callable,
    peak: Callable | None,
    curve: int = 0,
) -> dict:
    """Interleaved timing of compiled steps, then MFU, memory and the held-out metric per variant.

    ``built[name]`` holds ``compiled``, ``state``, ``compile_s`` and ``items`` (tokens or images
    per step); ``evaluate(name, state)`` gives the held-out metric after training, and also every
    ``curve`` rounds when ``curve`` is set (each row's ``curve``: ``[steps, metric]`` pairs).
    """
    runners = {n: (lambda s, i, c=b["compiled"]: c(s, batches[i % len(batches)])) for n, b in built.items()}
    states = {n: _timing.warm_up(runners[n], b["state"]) for n, b in built.items()}
    chunks = [rounds] if not curve else [min(curve, rounds - r) for r in range(0, rounds, curve)]
    parts: dict[str, list] = {n: [] for n in built}
    curves: dict[str, list] = {n: [] for n in built}
    done = 0
    for chunk in chunks:  # later chunks continue with the next batches
        shifted = {n: (lambda s, i, r=r, o=done * k: r(s, i + o)) for n, r in runners.items()}
        for n, t in _timing.interleaved(shifted, states, chunk, k, seed=done).items():
            parts[n].append(t)
        done += chunk
        if curve:
            for n in built:
                curves[n].append([5 + done * k, float(evaluate(n, states[n]))])
            points = {n: round(c[-1][1], 4) for n, c in curves.items()}
            print(f"after {5 + done * k} steps:", points, flush=True)
    times = {n: np.concatenate(t) for n, t in parts.items()}
    peak_flops = _timing.peak_flops()
    base_name = "f32" if "f32" in times else next(iter(times))  # the first variant when f32 is not run
    base = times[base_name]
    rows = {}
    for n, b in built.items():
        flops = _timing.compiled_flops(b["compiled"])
        t = float(np.median(times[n]))
        ratio, lo, hi = _timing.paired_ratio(times[n], base)
        rows[n] = {
            "step_ms": 1e3 * t,
            "items_per_s": b["items"] / t,
            "ratio": ratio,
            "ci": [lo, hi],
            "mfu": None if flops is None else flops / t / peak_flops,
            "compiled_bytes": _timing.compiled_bytes(b["compiled"]),
            "peak_bytes": peak(n) if peak else None,
            "compile_s": b["compile_s"],
            "steps": 5 + rounds * k,
            "held_out": float(evaluate(n, states[n])),
        }
        if curve:
            rows[n]["curve"] = curves[n]
    return {"rounds": rounds, "k": k, "peak_flops": peak_flops, "base": base_name, "rows": rows}


def curve_table(result: dict, metric: str) -> str:
    """The held-out metric after each ``curve`` chunk: one column per variant."""
    names = list(result["rows"])
    lines = [f"| steps | {' | '.join(names)} |", "|---:|" + "---:|" * len(names)]
    for i, (steps, _) in enumerate(result["rows"][names[0]]["curve"]):
        values = " | ".join(f"{result['rows'][n]['curve'][i][1]:.4f}" for n in names)
        lines.append(f"| {steps} | {values} |")
    return f"{metric} during training\n\n" + "\n".join(lines) + "\n"


def table(result: dict, items: str, metric: str) -> str:
    def mib(x: int | None) -> str:
        return "-" if x is None else f"{x / 2**20:.0f}"

    base = result["rows"].get("f32", {}).get("compiled_bytes")
    lines = [
        f"{result['rounds']} interleaved rounds x {result['k']} steps; calibrated peak "
        f"{result['peak_flops'] / 1e12:.2f} TFLOP/s (16-bit matmul, float32 accumulation)\n",
        f"| variant | step (ms) | {items}/s | ratio to {result.get('base', 'f32')} [95% CI] | MFU "
        "| compiled MiB (ratio) "
        f"| GPU peak MiB | compile (s) | {metric} |",
        "|---|---:|---:|---|---:|---|---:|---:|---:|",
    ]
    for n, r in result["rows"].items():
        mem = r["compiled_bytes"]
        mem_ratio = "" if not (mem and base) else f" ({mem / base:.2f})"
        mfu = "-" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
        lines.append(
            f"| {n} | {r['step_ms']:.1f} | {r['items_per_s']:.0f} | {r['ratio']:.3f} "
            f"[{r['ci'][0]:.3f}, {r['ci'][1]:.3f}] | {mfu} | {mib(mem)}{mem_ratio} | {mib(r['peak_bytes'])} "
            f"| {r['compile_s']:.1f} | {r['held_out']:.4f} |"
        )
    return "\n".join(lines) + "\n"


def parse_variants(parser: Any, text: str, fp8: bool = True) -> list[str]:
    names = text.split(",")
    known = [n for n in VARIANTS if fp8 or n not in FP8_VARIANTS]
    unknown = sorted(set(names) - set(known))
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {known}")
    return names


def memory_row(v: Variant, loss_fn: Callable, params: Any, model_state: Any, batch: Any) -> dict:
    """One variant's memory, from tracing only (``params`` etc. may be ``jax.ShapeDtypeStruct``).

    ``loss_fn(params, model_state, batch) -> (loss, new_model_state)`` as for ``make_step``; the
    residuals are those of the step's own gradient (with respect to the parameters, the loss
    multiplied by the variant's loss scale). Bytes per parameter count the stored training state
    (parameters + optimizer state) and, in a second column, the gradients a step adds.
    """
    scale = jmp_lite.NoOpLossScale() if v.loss_scale is None else v.loss_scale

    def scaled(p: Any, model_state: Any, b: Any) -> jax.Array:
        return scale.scale(loss_fn(p, model_state, b)[0])

    with precision_scope(v):
        measured = jmp_lite.memory.residual_bytes(scaled, params, model_state, batch, argnums=0)
    _, tx = make_step(loss_fn, v, 1e-3)
    opt_state = jax.eval_shape(tx.init, params)

    def nbytes(tree: Any) -> int:
        return sum(a.size * np.dtype(a.dtype).itemsize for a in jax.tree_util.tree_leaves(tree))

    count = sum(a.size for a in jax.tree_util.tree_leaves(params))
    return {
        "residual_bytes": measured.total,
        "residual_by_dtype": measured.by_dtype,
        "residual_inputs": measured.inputs,
        "params": count,
        "param_bytes": nbytes(params),
        "opt_state_bytes": nbytes(opt_state),
        "bytes_per_param": (nbytes(params) + nbytes(opt_state)) / count,
        "bytes_per_param_with_grads": (2 * nbytes(params) + nbytes(opt_state)) / count,
    }


def memory(rows: dict[str, dict], peak: Callable[[str], int | None] | None) -> dict:
    """Adds the ratio to f32 (and the GPU peak where lent) to ``memory_row`` results."""
    base = rows["f32"]["residual_bytes"] if "f32" in rows else next(iter(rows.values()))["residual_bytes"]
    for name, row in rows.items():
        row["ratio"] = row["residual_bytes"] / base if base else None
        row["peak_bytes"] = peak(name) if peak else None
    return {"memory": rows}


def memory_table(result: dict) -> str:
    """The Markdown memory table: residual bytes per variant, by dtype, per parameter, GPU peak."""

    rows = result["memory"]
    big = max(r["residual_bytes"] for r in rows.values()) >= 1e9
    unit, div, power = ("GB", 1e9, 9) if big else ("MB", 1e6, 6)

    def gb(x: float | None) -> str:
        return "-" if x is None else f"{x / div:.3f}"

    floats = ("float32", "bfloat16", "float16")
    found = {d for r in rows.values() for d in r["residual_by_dtype"]}
    dtypes = [d for d in floats if d in found] + sorted(found - set(floats))
    lines = [
        "Residual bytes: what the backward pass keeps, counted by tracing the step's gradient before XLA "
        f"runs (jmp_lite.memory.residual_bytes; {unit} = 10^{power} bytes). B/param: parameters + Adam "
        "state, then with the gradients.\n",
        f"| variant | residuals {unit} | ratio to f32 | "
        + " | ".join(f"{d} {unit}" for d in dtypes)
        + f" | B/param | B/param with grads | GPU peak {unit} |",
        "|---|---:|---:|" + "---:|" * len(dtypes) + "---:|---:|---:|",
    ]
    for name, r in rows.items():
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.3f}"
        by = " | ".join(gb(r["residual_by_dtype"].get(d, 0)) for d in dtypes)
        lines.append(
            f"| {name} | {gb(r['residual_bytes'])} | {ratio} | {by} | {r['bytes_per_param']:.2f} "
            f"| {r['bytes_per_param_with_grads']:.2f} | {gb(r['peak_bytes'])} |"
        )
    return "\n".join(lines) + "\n"
