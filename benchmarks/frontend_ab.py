"""This tree's ``apply_policy`` against an earlier revision's: step time and trace-plus-compile time.

The earlier revision's ``jmp_lite`` is exported with ``git archive`` and imported under
another package name (its ``jmp_lite`` imports renamed), so both versions run in one process
and one interleaved timing loop (benchmarks/README.md). Both build the same models under the
same policy:

  mlp    the Linen MLP of mlp.py (4 x Dense(1024) + LayerNorm, batch 1024, Adam), bf16 policy
  lm     the tiny GPT-2-architecture decoder of lm.py (2 layers, d=256, context 256), bf16 policy
  lm24   the same decoder with 24 layers (trace plus compile only)

Step time is the paired ratio (this tree / base) over interleaved rounds. Trace-plus-compile
is ``jax.jit(step).lower(...).compile()`` of a newly built model (``apply_policy`` keeps what it
traced per model) after ``jax.clear_caches()``, alternating base and this tree, median ratio over
``--compile-rounds``. Process-wide caches of values computed from constants (the attention analysis'
causal masks) stay warm after the first round, as they do for any later model in a process.

    MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TRIM_THRESHOLD_=4294967296 \\
        python benchmarks/frontend_ab.py --base 50c46cd --rounds 20 --k 3

``--split`` instead splits the 24-layer decoder's time into tracing (``.lower()``) and XLA's compile
(``.compile()``), for the base and for this tree with each memory feature of ``apply_policy`` on and
off (``attention=``, ``remat_float32=``), interleaved, median over ``--compile-rounds``.
"""

from __future__ import annotations

import argparse
import importlib
import io
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import jax
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _timing  # noqa: E402
import lm  # noqa: E402
import mlp  # noqa: E402

POLICY = "p=f32,c=bf16,o=f32"
ROOT = Path(__file__).resolve().parents[1]


def load_base(rev: str, into: Path) -> Any:
    """The package ``jmp_lite`` at ``rev``, importable as ``jmp_lite_base``."""
    archive = subprocess.run(
        ["git", "archive", rev, "jmp_lite"], cwd=ROOT, check=True, capture_output=True
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    (into / "jmp_lite").rename(into / "jmp_lite_base")
    for path in (into / "jmp_lite_base").rglob("*.py"):
        path.write_text(re.sub(r"\bjmp_lite\b", "jmp_lite_base", path.read_text()))
    sys.path.insert(0, str(into))
    return importlib.import_module("jmp_lite_base")


def linen_apply_policy(package: str) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            return importlib.import_module(f"{package}.flax.linen").apply_policy
        except (ImportError, AttributeError):
            return importlib.import_module(f"{package}.flax").apply_policy


def step_for(model: Any, tx: optax.GradientTransformation, loss_of: Any) -> Any:
    def step(state: tuple, batch: Any) -> tuple:
        params, opt_state = state
        grads = jax.grad(lambda p: loss_of(model.apply({"params": p}, batch[0]), batch[1]))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return step


def ce(logits: jax.Array, labels: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def setups(apply_policy: Any) -> dict[str, tuple]:
    """(model under the policy, batch, loss) for each model name."""
    x = jax.random.normal(jax.random.key(1), (1024, 1024))
    y = jax.random.randint(jax.random.key(2), (1024,), 0, 10)
    layers, width, heads, context, batch = lm.SIZES["tiny"]
    tokens = jax.random.randint(jax.random.key(3), (batch, context + 1), 0, 256)
    lm_batch = (tokens[:, :-1], tokens[:, 1:])
    return {
        "mlp": (apply_policy(mlp.MLP(), POLICY), (x, y)),
        "lm": (apply_policy(lm.GPT(layers, width, heads, context), POLICY), lm_batch),
        "lm24": (apply_policy(lm.GPT(24, width, heads, context), POLICY), lm_batch),
    }


SPLIT_OPTIONS = {
    "defaults": {},
    "attention=False": {"attention": False},
    "remat_float32=False": {"remat_float32": False},
    "both off": {"attention": False, "remat_float32": False},
}


def split(rounds: int, base: str) -> None:
    """Trace and compile seconds of the 24-layer decoder's step, per front-end and options."""
    layers, width, heads, context, batch = lm.SIZES["tiny"]
    tokens = jax.random.randint(jax.random.key(3), (batch, context + 1), 0, 256)
    lm_batch = (tokens[:, :-1], tokens[:, 1:])
    tx = optax.adam(1e-3)
    fronts = {f"{base} (base)": ("jmp_lite_base", {})}
    fronts.update({name: ("jmp_lite", options) for name, options in SPLIT_OPTIONS.items()})
    secs: dict[str, list[tuple[float, float]]] = {name: [] for name in fronts}
    for r in range(rounds):
        for name in list(fronts) if r % 2 == 0 else list(fronts)[::-1]:
            jax.clear_caches()
            # a new model each round: apply_policy keeps the programs it traced per model
            package, options = fronts[name]
            model = linen_apply_policy(package)(lm.GPT(24, width, heads, context), POLICY, **options)
            params = jax.jit(model.init)(jax.random.key(0), lm_batch[0])["params"]
            state = (params, tx.init(params))
            t0 = time.perf_counter()
            lowered = jax.jit(step_for(model, tx, ce)).lower(state, lm_batch)
            t1 = time.perf_counter()
            lowered.compile()
            secs[name].append((t1 - t0, time.perf_counter() - t1))
    print(f"\n24-layer decoder, bf16 policy: trace and compile, median of {rounds}\n")
    print("| apply_policy | trace s | XLA compile s | total s |")
    print("|---|---:|---:|---:|")
    for name, runs in secs.items():
        trace, compile_ = (float(np.median([run[i] for run in runs])) for i in (0, 1))
        total = float(np.median([sum(run) for run in runs]))
        print(f"| {name} | {trace:.2f} | {compile_:.2f} | {total:.2f} |")


def build(model: Any, batch: tuple, tx: optax.GradientTransformation) -> tuple[Any, Any, float]:
    params = jax.jit(model.init)(jax.random.key(0), batch[0])["params"]
    state = (params, tx.init(params))
    compiled, seconds = _timing.compile_ahead(step_for(model, tx, ce), state, batch)
    return compiled, state, seconds


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base", required=True, help="git revision to compare against")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--compile-rounds", type=int, default=5)
    parser.add_argument("--json", default=None)
    parser.add_argument("--split", action="store_true", help="trace vs compile of the 24-layer decoder")
    args = parser.parse_args()
    env = _timing.environment()
    env["base"] = subprocess.run(
        ["git", "rev-parse", "--short", args.base], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout.strip()
    env["head"] = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout.strip()
    print(json.dumps(env), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        load_base(args.base, Path(tmp))
        if args.split:
            split(args.compile_rounds, env["base"])
            return
        packages = {"base": "jmp_lite_base", "head": "jmp_lite"}
        fronts = {side: setups(linen_apply_policy(package)) for side, package in packages.items()}
        tx = optax.adam(1e-3)
        result: dict[str, Any] = {}

        # trace plus compile, alternating, from a cleared cache each time
        for name in ("lm", "lm24"):
            secs: dict[str, list[float]] = {"base": [], "head": []}
            for r in range(args.compile_rounds):
                for side in ("base", "head") if r % 2 == 0 else ("head", "base"):
                    jax.clear_caches()
                    # new models each round: apply_policy keeps the programs it traced per model
                    model, batch = setups(linen_apply_policy(packages[side]))[name]
                    params = jax.jit(model.init)(jax.random.key(0), batch[0])["params"]
                    state = (params, tx.init(params))
                    t0 = time.perf_counter()
                    jax.jit(step_for(model, tx, ce)).lower(state, batch).compile()
                    secs[side].append(time.perf_counter() - t0)
            ratio = float(np.median(np.array(secs["head"]) / np.array(secs["base"])))
            result[f"{name} trace+compile"] = {
                "base_s": float(np.median(secs["base"])),
                "head_s": float(np.median(secs["head"])),
                "ratio": ratio,
            }

        # step time, interleaved rounds
        for name in ("mlp", "lm"):
            runners, states = {}, {}
            for side in ("base", "head"):
                model, batch = fronts[side][name]
                compiled, state, _ = build(model, batch, tx)
                runners[side] = lambda s, i, c=compiled, b=batch: c(s, b)
                states[side] = _timing.warm_up(runners[side], state)
            times = _timing.interleaved(runners, states, args.rounds, args.k)
            ratio, lo, hi = _timing.paired_ratio(times["head"], times["base"])
            result[f"{name} step"] = {
                "base_ms": 1e3 * float(np.median(times["base"])),
                "head_ms": 1e3 * float(np.median(times["head"])),
                "ratio": ratio,
                "ci": [lo, hi],
            }

    print(f"\nbf16 policy ({POLICY}) under apply_policy: {env['head']} vs {env['base']}\n")
    print("| measure | base | this tree | ratio | 95% CI |")
    print("|---|---:|---:|---:|---|")
    for key, r in result.items():
        if "ci" in r:
            print(
                f"| {key} (ms) | {r['base_ms']:.1f} | {r['head_ms']:.1f} | {r['ratio']:.3f} "
                f"| [{r['ci'][0]:.3f}, {r['ci'][1]:.3f}] |"
            )
        else:
            print(
                f"| {key} (s) | {r['base_s']:.2f} | {r['head_s']:.2f} | {r['ratio']:.3f} | median of "
                f"{args.compile_rounds} |"
            )
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"environment": env, "command": " ".join(sys.argv), "results": result}, f, indent=2)


if __name__ == "__main__":
    main()
