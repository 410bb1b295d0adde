"""Does the skip's ``lax.cond`` make the host wait for the device?

A host sync inside a step shows as the Python loop stalling: with asynchronous dispatch,
issuing N steps returns long before they finish; if every step's ``cond`` copies its
predicate to the host first, issuing takes as long as running. For each skip mode (and
the same step without loss scaling) the script issues N steps of a small float16 MLP
without blocking, then blocks once, and reports the fraction of the total spent issuing
(near 1.0 = synchronous), over interleaved rounds. Protocol: benchmarks/README.md.

    python benchmarks/skip_sync.py --steps 200 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _timing  # noqa: E402

import jmp_lite  # noqa: E402


def step_for(tx: optax.GradientTransformation, scaled: bool):
    def step(state, batch):
        params, opt_state = state
        x, y = batch
        scale = jmp_lite.get_loss_scale(opt_state) if scaled else jmp_lite.NoOpLossScale()

        def loss(p):
            h = x.astype(jnp.float16)
            for w in p:
                h = jnp.tanh(h @ w.astype(jnp.float16))
            return scale.scale(((h.astype(jnp.float32) - y) ** 2).mean())

        updates, opt_state = tx.update(jax.grad(loss)(params), opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return step


def main() -> None:
    fmt = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=fmt)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    env = _timing.environment()
    print(json.dumps(env), flush=True)
    params = [jax.random.normal(jax.random.key(i), (256, 256)) * 0.06 for i in range(4)]
    batch = (jax.random.normal(jax.random.key(9), (64, 256)), jnp.zeros((64, 256)))
    adam = optax.adam(1e-3)
    modes = {
        "no loss scaling": (adam, False),
        "skip=cond": (jmp_lite.loss_scaling(adam, jmp_lite.DynamicLossScale(2.0**15), skip="cond"), True),
        "skip=select": (jmp_lite.loss_scaling(adam, jmp_lite.DynamicLossScale(2.0**15), skip="select"), True),
    }
    compiled, states = {}, {}
    for name, (tx, scaled) in modes.items():
        state = (jax.tree_util.tree_map(jnp.array, params), tx.init(params))
        compiled[name], _ = _timing.compile_ahead(step_for(tx, scaled), state, batch)
        states[name] = _timing.warm_up(lambda s, i, c=compiled[name]: c(s, batch), state)
    issue = {n: [] for n in modes}
    total = {n: [] for n in modes}
    rng = np.random.default_rng(0)
    for _ in range(args.rounds):
        for name in rng.permutation(list(modes)):
            c, s = compiled[name], states[name]
            t0 = time.perf_counter()
            for _ in range(args.steps):
                s = c(s, batch)
            t1 = time.perf_counter()
            jax.block_until_ready(s)
            t2 = time.perf_counter()
            states[name] = s
            issue[name].append(t1 - t0)
            total[name].append(t2 - t0)
    print(f"\n{args.rounds} interleaved rounds of {args.steps} steps issued without blocking\n")
    print("| step | ms/step | issuing / total (1.0 = host waits each step) |")
    print("|---|---:|---:|")
    rows = {}
    for name in modes:
        frac = float(np.median(np.array(issue[name]) / np.array(total[name])))
        ms = 1e3 * float(np.median(total[name])) / args.steps
        rows[name] = {"ms_per_step": ms, "issue_fraction": frac}
        print(f"| {name} | {ms:.3f} | {frac:.2f} |")
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"environment": env, "command": " ".join(sys.argv), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
